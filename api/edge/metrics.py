"""Prometheus metrics of the front end, served at ``/metrics``.

Each app has its own registry, so several apps in one process (tests, embedded servers) do
not collide. Under ``tokcap serve --workers N`` a scrape reaches one worker, which alone
knows only its own share; there PROMETHEUS_MULTIPROC_DIR is set (by ``tokcap serve``,
before the workers start), prometheus_client keeps every count in files in that directory,
and ``exposition()`` sums all workers' files (``MultiProcessCollector``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

# prometheus_client reads it when first imported: it must be set before the worker starts.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)

# Outcomes of one model call, as counted in tokcap_calls_total.
OUTCOMES = (
    "captured",
    "incomplete",
    "unrecorded",
    "uncaptured",
    "upstream_error",
    "cut",
    "bad_request",
    "abandoned",
)


@dataclass
class FrontEndMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # The directory every worker's counts are summed from; None: this process's counts.
    multiprocess_dir: str | None = field(default_factory=lambda: os.environ.get(MULTIPROC_ENV))

    def __post_init__(self) -> None:
        # Each labelled child once looked up: ``labels()`` checks and locks on every call.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._count_updates()
        self._count_engines()
        self._count_calls()
        self._time_calls()
        self._count_prompts()
        self._watch_redis()

    def _count_engines(self) -> None:
        """Each engine of the pool (``api.engine.pool``), labelled by its host and port."""
        self.engine_calls = Counter(
            "tokcap_engine_calls",
            "Model calls sent to each engine, by outcome (served, or failed upstream)",
            ["engine", "outcome"],
            registry=self.registry,
        )
        self.engine_in_flight = Gauge(
            "tokcap_engine_in_flight",
            "Model calls in flight to each engine, summed over workers",
            ["engine"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.engine_ejections = Counter(
            "tokcap_engine_ejections",
            "Times an engine was taken out of the pool (unreachable, or answering 5xx)",
            ["engine"],
            registry=self.registry,
        )
        self.engine_moves = Counter(
            "tokcap_engine_moves",
            "Rollouts whose call went to another engine than their last call, by the new one",
            ["engine"],
            registry=self.registry,
        )

    def _count_updates(self) -> None:
        """Calls across weight updates: cut by their engine, then continued or failed."""
        self.cut_calls = Counter(
            "tokcap_cut_calls",
            "Calls their engine cut (finish_reason abort, a weight update's pause): resumed "
            "and served whole, or failed with a retryable error",
            ["outcome"],
            registry=self.registry,
        )
        self.resumed_parts = Counter(
            "tokcap_resumed_parts",
            "Continuations of cut calls sent token-in (a call cut twice counts two)",
            registry=self.registry,
        )
        self.held_seconds = Histogram(
            "tokcap_held_seconds",
            "Time a call was held by this front end while its engine was paused",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resent = Counter(
            "tokcap_resent_requests",
            "Engine requests still out without a sampled token when a resume came, sent "
            "again so that each reply's policy version is exact",
            registry=self.registry,
        )
        self.pauses = Counter(
            "tokcap_pauses",
            "Engine pauses the trainer asked of this front end",
            ["mode"],
            registry=self.registry,
        )

    def record_resumes(self, resumes: int) -> None:
        if resumes:
            self.cut_calls.labels(outcome="resumed").inc()
            self.resumed_parts.inc(resumes)

    def _count_calls(self) -> None:
        """Calls by outcome, and the outcomes that matter for training on their own."""
        self.calls = Counter(
            "tokcap_calls",
            "Model calls served, by dialect and outcome",
            ["dialect", "outcome"],
            registry=self.registry,
        )
        self.captured = Counter(
            "tokcap_captured_calls", "Calls whose ids were stored", registry=self.registry
        )
        self.incomplete = Counter(
            "tokcap_incomplete_calls",
            "Calls that reached the harness without stored ids (rollout marked incomplete)",
            registry=self.registry,
        )
        self.unrecorded = Counter(
            "tokcap_unrecorded_calls",
            "Calls answered 503: neither their entry nor their loss became durable in time",
            registry=self.registry,
        )
        self.unreceived = Counter(
            "tokcap_unreceived_calls",
            "Calls whose client went away before the reply (or the stream's final event)",
            registry=self.registry,
        )

    def _time_calls(self) -> None:
        self.put_seconds = Histogram(
            "tokcap_capture_put_seconds",
            "Time to extract and durably put one call's entry",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "tokcap_upstream_seconds",
            "Time of the upstream chat-completions call",
            ["dialect"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def _count_prompts(self) -> None:
        """Faithful prompts, and rollout ids two harness runs share."""
        self.faithful_prompts = Counter(
            "tokcap_faithful_prompts",
            "Faithful prompts built: continued (extends a recorded call) or root",
            ["kind"],
            registry=self.registry,
        )
        self.faithful_fallbacks = Counter(
            "tokcap_faithful_fallbacks",
            "Faithful prompts rendered whole although the history held an assistant turn",
            ["reason"],
            registry=self.registry,
        )

        self.rollout_id_collisions = Counter(
            "tokcap_rollout_id_collisions",
            "Rollouts with two conversations of the same harness in flight at once (a "
            "rollout id used by two harness runs?), each counted once per worker",
            registry=self.registry,
        )

    def _watch_redis(self) -> None:
        """Read off the sink's Redis at each scrape and readiness probe; across workers the
        latest reading of each server is shown."""
        self.redis_used_memory = Gauge(
            "tokcap_redis_used_memory_bytes",
            "Memory the capture Redis uses (INFO memory used_memory), per server",
            ["server"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.redis_max_memory = Gauge(
            "tokcap_redis_maxmemory_bytes",
            "The capture Redis's maxmemory (0: no limit), per server; full, it refuses writes",
            ["server"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once per label values: every label of the
        front end takes a handful of values (dialects, outcomes, engines)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def record_memory(self, readouts: Iterable[Any]) -> None:
        """Set the memory gauges from ``transports.redis.eviction.Memory`` readouts."""
        for memory in readouts:
            self.redis_used_memory.labels(server=memory.server).set(memory.used_bytes)
            self.redis_max_memory.labels(server=memory.server).set(memory.max_bytes)

    def record_prompt(self, continued: bool, fallback: str | None) -> None:
        self.labelled(self.faithful_prompts, "continued" if continued else "root").inc()
        if fallback is not None:
            self.faithful_fallbacks.labels(reason=fallback).inc()

    def record_call(self, dialect: str, outcome: str, put_seconds: float | None = None) -> None:
        self.labelled(self.calls, dialect, outcome).inc()
        if outcome == "captured":
            self.captured.inc()
        elif outcome == "incomplete":
            self.incomplete.inc()
        elif outcome == "unrecorded":
            self.unrecorded.inc()
        if put_seconds is not None and outcome in ("captured", "incomplete", "unrecorded"):
            self.put_seconds.observe(put_seconds)

    def exposition(self) -> tuple[bytes, str]:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        # A fresh registry per scrape: the collector reads the files as they are now.
        everyone = CollectorRegistry()
        MultiProcessCollector(everyone, path=self.multiprocess_dir)
        return generate_latest(everyone), CONTENT_TYPE_LATEST
