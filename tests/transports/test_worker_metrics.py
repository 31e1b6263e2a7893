"""A rebuild worker's Prometheus metrics on a real redis-server (issue 36, item 3).

The queue gauges follow the jobs (waiting, then taken, then gone, and the oldest one's age),
the job counters follow what became of them (rebuilt by result, masked by reason, retried,
dead-lettered by reason), and the metrics are served over HTTP on loopback only when a port
is named: from the flag, or from ``TOKCAP_WORKER_METRICS_PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from capture.delivery import RolloutBuild
from tests.support.rebuild import finished_record, make_worker, populate, stream_holds, wait_for
from tokcap.commands import worker as worker_cli
from transports.rebuild.jobs import RebuildQueue, encode_job
from transports.rebuild.metrics import WorkerMetrics, read_depth
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis.keys import stream_names

README = Path(__file__).resolve().parents[2] / "README.md"


class GatedWorker(RebuildWorker):
    """Holds every build until the test opens the gate, so the queue can be seen full."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.gate = asyncio.Event()

    async def _build(self, rollout_id: str, record: dict[str, Any]) -> RolloutBuild:
        await self.gate.wait()
        return await super()._build(rollout_id, record)


def value(worker: RebuildWorker, name: str, **labels: str) -> float:
    """One sample of the worker's registry (0 when it has none yet)."""
    return worker.metrics.registry.get_sample_value(name, labels) or 0.0


def queue(worker: RebuildWorker) -> tuple[float, float]:
    return (
        value(worker, "tokcap_rebuild_queue_jobs", state="waiting"),
        value(worker, "tokcap_rebuild_queue_jobs", state="pending"),
    )


def scrape(worker: RebuildWorker) -> dict[tuple[str, tuple], float]:
    """The worker's ``/metrics`` over HTTP, as {(sample name, labels): value}."""
    assert worker.metrics_server is not None
    text = httpx.get(worker.metrics_server.url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_queue_gauges_and_job_counts_move_as_jobs_come_and_go(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    rollouts = ["m-1", "m-2", "m-3"]
    await populate(redis_url, redis_prefix, rollouts, turns=2)
    jobs, _, _ = stream_names(redis_prefix)
    settings = WorkerSettings(
        url=redis_url,
        key_prefix=redis_prefix,
        consumer="metered",
        concurrency=1,
        block_ms=50,
        metrics_port=0,
        metrics_interval_s=0.05,
    )
    worker = GatedWorker(settings)
    task = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: _holds(worker.metrics_server is not None), "the metrics server")
        assert worker.metrics_server.url.startswith("http://127.0.0.1:")  # loopback by default
        for rollout_id in rollouts:
            await redis_client.xadd(jobs, encode_job(finished_record(rollout_id)))
        # One job taken and held at the gate, two waiting; the oldest is getting older.
        await wait_for(lambda: _holds(queue(worker) == (2, 1)), "the queue sampled full")
        await asyncio.sleep(0.2)
        await wait_for(
            lambda: _holds(value(worker, "tokcap_rebuild_oldest_job_age_seconds") >= 0.2),
            "the oldest job's age",
        )
        served = scrape(worker)
        assert served[("tokcap_rebuild_queue_jobs", (("state", "waiting"),))] == 2
        assert served[("tokcap_rebuild_jobs_in_flight", ())] == 1
        assert served[("tokcap_rebuilt_jobs_total", (("result", "delivered"),))] == 0
        worker.gate.set()
        await wait_for(
            lambda: _holds(value(worker, "tokcap_rebuilt_jobs_total", result="delivered") == 3),
            "three jobs rebuilt",
        )
        await wait_for(lambda: _holds(queue(worker) == (0, 0)), "the queue sampled empty")
        assert value(worker, "tokcap_rebuild_oldest_job_age_seconds") == 0
        served = scrape(worker)
        assert served[("tokcap_rebuild_seconds_count", ())] == 3
        assert served[("tokcap_rebuilt_jobs_total", (("result", "masked"),))] == 0
        assert served[("tokcap_rebuild_jobs_in_flight", ())] == 0
    finally:
        worker.gate.set()  # a held job would keep the worker from stopping
        worker.stop()
        await asyncio.wait_for(task, 30)
    assert worker.metrics_server is None, "the metrics stop being served with the worker"


async def _holds(condition: bool) -> bool:
    return condition


async def test_read_depth_counts_waiting_and_taken_jobs_of_the_group(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    jobs, _, _ = stream_names(redis_prefix)
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()  # the group, no reading
    try:
        empty = await read_depth(worker.jobs)
        assert (empty.waiting, empty.pending, empty.oldest_age_s) == (0, 0, 0.0)
        for number in range(3):
            await redis_client.xadd(jobs, encode_job(finished_record(f"d-{number}")))
        await redis_client.xreadgroup("rebuild", "someone", {jobs: ">"}, count=1)
        depth = await read_depth(worker.jobs)
        assert (depth.waiting, depth.pending) == (2, 1)
        assert 0 <= depth.oldest_age_s < 60
    finally:
        await worker.close()


async def test_read_depth_sums_the_shards_of_a_cluster_queue(
    redis_cluster: Any, redis_prefix: str
) -> None:
    """Each shard on its own master; the age is read against a node's clock."""
    worker = make_worker(redis_cluster.url, redis_prefix, cluster=True, shards=3)
    await worker.start()
    try:
        queue_of = RebuildQueue(
            client=worker.client, stream=worker.settings.jobs_stream, shards=3, cluster=True
        )
        for number in range(6):
            await queue_of.submit(finished_record(f"c-{number}"))
        depth = await read_depth(worker.jobs)
        assert (depth.waiting, depth.pending) == (6, 0)
        assert 0 <= depth.oldest_age_s < 60
    finally:
        await worker.close()


async def test_retries_dead_letters_and_mask_reasons_are_counted(
    redis_url: str, redis_prefix: str, redis_client: aioredis.Redis
) -> None:
    jobs, results, dead = stream_names(redis_prefix)
    await populate(redis_url, redis_prefix, ["lost-1"], turns=2, lose_one=True)
    worker = make_worker(redis_url, redis_prefix)
    await worker.start()
    await redis_client.xadd(jobs, {"v": "1", "rollout_id": "junk-1", "record": b"\xc1"})
    await redis_client.xadd(jobs, encode_job(finished_record("lost-1")))
    task = asyncio.create_task(worker.run())
    try:
        await wait_for(stream_holds(redis_client, dead, 1), "the malformed job's dead letter")
        await wait_for(
            lambda: _holds(value(worker, "tokcap_rebuilt_jobs_total", result="masked") == 1),
            "the masked result",
        )
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    assert value(worker, "tokcap_dead_jobs_total", reason="malformed") == 1
    assert value(worker, "tokcap_mask_reasons_total", reason="incomplete_capture") == 1
    assert value(worker, "tokcap_rebuilt_jobs_total", result="delivered") == 0

    # A results stream that cannot take a result fails every attempt: retried, then dead.
    await populate(redis_url, redis_prefix, ["blocked-1"], turns=2)
    await redis_client.delete(results)
    await redis_client.set(results, "not a stream")
    retrier = make_worker(redis_url, redis_prefix, max_attempts=2, claim_idle_ms=50, block_ms=20)
    task = asyncio.create_task(retrier.run())
    try:
        await redis_client.xadd(jobs, encode_job(finished_record("blocked-1")))
        await wait_for(stream_holds(redis_client, dead, 2), "the dead letter", timeout=30)
    finally:
        retrier.stop()
        await asyncio.wait_for(task, 30)
    assert value(retrier, "tokcap_retried_jobs_total") == 1
    assert value(retrier, "tokcap_dead_jobs_total", reason="attempts") == 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(["--url", "redis://127.0.0.1:1/0", *argv])


def test_metrics_are_served_only_when_a_port_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(worker_cli.METRICS_PORT_ENV, raising=False)
    settings = worker_cli.settings_from_args(parse([]))
    assert settings.metrics_port is None and settings.metrics_host == "127.0.0.1"
    settings = worker_cli.settings_from_args(parse(["--metrics-port", "9100"]))
    assert settings.metrics_port == 9100 and settings.metrics_host == "127.0.0.1"
    monkeypatch.setenv(worker_cli.METRICS_PORT_ENV, "9101")
    settings = worker_cli.settings_from_args(parse(["--metrics-host", "0.0.0.0"]))
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9101)
    assert worker_cli.settings_from_args(parse(["--metrics-port", "9102"])).metrics_port == 9102
    monkeypatch.setenv(worker_cli.METRICS_PORT_ENV, "nine")
    with pytest.raises(SystemExit) as exit_info:
        parse([])
    assert exit_info.value.code == 2


async def test_a_metrics_port_already_taken_stops_the_worker_before_it_reads_a_job(
    redis_url: str, redis_prefix: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        worker = make_worker(redis_url, redis_prefix, metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            await worker.run()
        await worker.close()


def test_the_readme_lists_every_worker_metric() -> None:
    text = README.read_text()
    reference = text[text.index("## Metrics reference") : text.index("## Commands")]
    exposition = generate_latest(WorkerMetrics().registry).decode()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", exposition, re.MULTILINE):
        if name.endswith("_created"):  # the time a counter began, beside each counter
            continue
        shown = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
        assert f"`{shown}`" in reference, f"a worker serves {shown}, the README does not list it"
