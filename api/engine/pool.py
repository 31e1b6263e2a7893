"""The engines behind one front end: each rollout on one of them, failover, a changing pool.

A real RL run serves the policy from many engine replicas. Each call of a rollout resends
its whole growing conversation, so all of them go to one engine, whose prefix cache holds
it: the engine is chosen by rendezvous hashing of the rollout id over the engines' URLs.
Every worker and every front end makes the same choice without sharing anything, and an
engine that joins or leaves moves only the rollouts it takes or held (their next call is
rendered whole on the new engine, so capture stays exact). A call without a rollout goes to
the least busy engine.

Bounded load: a rollout whose engine has more calls in flight than ``LOAD_BOUND`` times an
even share (and at least ``LOAD_SLACK`` more than the share) goes to the next engine in its
order for that call, so one engine never takes far more than its share. The counts are one
worker's, a few dozen calls an engine, whose ordinary swings reach 1.5 times the share
(2-5% of rollouts split at 15 calls an engine): the bound is set above them.

Failover: an engine that cannot be reached, or answers 5xx, is taken out at once; its call
fails as a lone engine's does (the harness retries), and its rollouts' next calls go to the
next engine in their order. So is one that fails its health check (``GET /v1/models``,
asked of each engine every ``HEALTH_S``), before a call finds it gone. It is asked again
every ``REPROBE_S`` until it answers, and then takes its rollouts back. An engine removed from the pool is drained: it
takes no call from then on, and is closed once its calls in flight are done.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from api.engine.client import UpstreamClient
from api.engine.generation import UpstreamError

LOAD_BOUND = 2.0
LOAD_SLACK = 16
REPROBE_S = 1.0
HEALTH_S = 5.0

State = Literal["up", "out", "draining"]


def score(key: str, url: str) -> int:
    """The rendezvous weight of ``url`` for ``key``: the same in every process."""
    digest = hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(eq=False)
class Engine:
    """One engine of the pool: its client, whether it takes calls, its calls in flight."""

    url: str  # as configured, credentials stripped: the name it is hashed and shown by
    client: UpstreamClient
    state: State = "up"
    in_flight: int = 0
    served: int = 0
    failed: int = 0
    ejections: int = 0
    reprobe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return self.client.where


class EnginePool:
    """The engines of this worker: a call's engine chosen by its rollout, failover, changes."""

    def __init__(self, clients: Iterable[UpstreamClient], metrics: Any = None) -> None:
        self.engines: list[Engine] = [Engine(client.base_url, client) for client in clients]
        if not self.engines:
            raise ValueError("an engine pool needs at least one engine")
        self._metrics = metrics
        self._placed: dict[str, str] = {}  # rollout -> the engine of its last call
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def first(self) -> UpstreamClient:
        """The engine asked what every engine of the pool answers alike (family, models)."""
        live = self._taking()
        return (live[0] if live else self.engines[0]).client

    def _taking(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.state == "up"]

    def choose(self, rollout_id: str | None) -> Engine:
        """The engine for a call of ``rollout_id`` (None: the least busy engine)."""
        live = self._taking() or [e for e in self.engines if e.state != "draining"]
        if not live:
            raise UpstreamError(503, "no engine of the pool takes calls now: retry the request")
        if rollout_id is None:
            return min(live, key=lambda engine: engine.in_flight)
        order = sorted(live, key=lambda engine: score(rollout_id, engine.url), reverse=True)
        busy = sum(engine.in_flight for engine in live)
        share = (busy + 1) / len(live)
        bound = max(math.ceil(share * LOAD_BOUND), math.ceil(share) + LOAD_SLACK)
        chosen = next((engine for engine in order if engine.in_flight < bound), order[0])
        self._note_placement(rollout_id, chosen)
        return chosen

    def _note_placement(self, rollout_id: str, engine: Engine) -> None:
        before = self._placed.pop(rollout_id, None)
        if before is not None and before != engine.url and self._metrics is not None:
            self._metrics.engine_moves.labels(engine=engine.where).inc()
        self._placed[rollout_id] = engine.url
        if len(self._placed) > 100_000:  # remembered only to count moves: the oldest go
            del self._placed[next(iter(self._placed))]

    async def learn(self) -> None:
        """Ask each engine what it is as the worker starts. Left to the first call, the
        questions went out on an event loop busy with the first burst, and every call of it
        waited for their answers (1,000 calls, 0.15 s); an engine that does not answer now
        is asked again at its first call."""
        await asyncio.gather(
            *(engine.client.learn() for engine in self.engines), return_exceptions=True
        )

    @asynccontextmanager
    async def serving(self, engine: Engine) -> AsyncIterator[UpstreamClient]:
        """``engine``'s client for one call: counted in flight, taken out if it fails as a
        dead engine does."""
        engine.in_flight += 1
        self._gauge(engine)
        try:
            yield engine.client
        except UpstreamError as exc:
            engine.failed += 1
            self._count(engine, "failed")
            if exc.engine_down:
                self.eject(engine)
            raise
        else:
            engine.served += 1
            self._count(engine, "served")
        finally:
            engine.in_flight -= 1
            self._gauge(engine)
            if engine.state == "draining" and engine.in_flight == 0:
                self._close_later(engine)

    def _count(self, engine: Engine, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.labelled(self._metrics.engine_calls, engine.where, outcome).inc()

    def _gauge(self, engine: Engine) -> None:
        if self._metrics is not None:
            gauge = self._metrics.labelled(self._metrics.engine_in_flight, engine.where)
            gauge.set(engine.in_flight)

    def eject(self, engine: Engine) -> None:
        """Take a failing engine out, and ask it until it answers again."""
        if engine.state != "up":
            return
        engine.state = "out"
        engine.ejections += 1
        if self._metrics is not None:
            self._metrics.engine_ejections.labels(engine=engine.where).inc()
        engine.reprobe = asyncio.ensure_future(self._reprobe(engine))

    async def _reprobe(self, engine: Engine) -> None:
        while engine.state == "out":
            await asyncio.sleep(REPROBE_S)
            status, _ = await engine.client.ask("/v1/models")
            if status == 200 and engine.state == "out":
                engine.state = "up"

    async def watch_health(self) -> None:
        """Take out each engine that fails its health check, until cancelled."""
        while True:
            await asyncio.sleep(HEALTH_S)
            live = self._taking()
            answers = await asyncio.gather(*(e.client.ask("/v1/models") for e in live))
            for engine, (status, _) in zip(live, answers, strict=True):
                if status != 200:
                    self.eject(engine)

    def change(self, keep: set[str], joining: dict[str, UpstreamClient]) -> None:
        """Make the pool the engines in ``keep`` and ``joining`` (url -> its new client):
        the joining ones take calls at once, any other is drained."""
        for engine in list(self.engines):
            if engine.url not in keep and engine.state != "draining":
                engine.state = "draining"
                if engine.in_flight == 0:
                    self._close_later(engine)
        self.engines += [Engine(url, client) for url, client in joining.items()]

    def _close_later(self, engine: Engine) -> None:
        if engine in self.engines:
            self.engines.remove(engine)
        if engine.reprobe is not None:
            engine.reprobe.cancel()
        task = asyncio.ensure_future(engine.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _each(
        self, engines: list[Engine], action: str, *args: Any
    ) -> list[tuple[Engine, Exception]]:
        """Run a control command (pause, resume) on ``engines`` at once; the failures."""
        outcomes = await asyncio.gather(
            *(getattr(engine.client, action)(*args) for engine in engines),
            return_exceptions=True,
        )
        failures = []
        for engine, outcome in zip(engines, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failures.append((engine, outcome))
            elif isinstance(outcome, BaseException):  # a cancellation: not the engine's failure
                raise outcome
        return failures

    async def pause(self, mode: str) -> None:
        """Pause every engine not taken out; if one fails, those paused are resumed (the
        pool runs on as one) and its error raised."""
        engines = [engine for engine in self.engines if engine.state != "out"]
        failures = await self._each(engines, "pause", mode)
        if failures:
            failed = {engine for engine, _ in failures}
            await self._each([e for e in engines if e not in failed], "resume")
            raise failures[0][1]

    async def resume(self) -> None:
        """Resume every engine not taken out; the first failure raised once all were asked."""
        failures = await self._each([e for e in self.engines if e.state != "out"], "resume")
        if failures:
            raise failures[0][1]

    async def models(self) -> list[dict[str, Any]]:
        return await self.first.models()

    async def can_relay(self, token_in: bool = False) -> bool:
        return await self.first.can_relay(token_in)

    def report(self) -> list[dict[str, Any]]:
        """Each engine as ``/ready`` shows it."""
        return [
            {
                "engine": engine.where,
                "state": engine.state,
                "in_flight": engine.in_flight,
                "served": engine.served,
                "failed": engine.failed,
                "ejections": engine.ejections,
            }
            for engine in self.engines
        ]

    async def close(self) -> None:
        for engine in self.engines:
            if engine.reprobe is not None:
                engine.reprobe.cancel()
        await asyncio.gather(*(engine.client.close() for engine in self.engines))
        await asyncio.gather(*self._closing, return_exceptions=True)
