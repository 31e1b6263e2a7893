"""The property under faults (issue 8): no rollout is unmasked and missing a replied call.

Sixteen or more concurrent streamed Anthropic-SDK tool loops (6-10 turns) run through the
front end to the tokcap engine while a fault strikes the store or the engine's replies;
every rollout is then rebuilt and checked against the engine's ground-truth log
(``tests.support.fault_loops``). 503s reach the harness and are fine: the SDK retries them, and a
loop that gives up still submits what it was answered. Every server here is private (a
redis-server of the test's own, on a free port) and stopped by PID when the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from api.settings import ServerSettings
from capture import context
from capture.config import TokenIdCaptureConfig
from capture.filestore.store import FileTokenStore
from tests.support.corrupting_proxy import MODES, corrupting_proxy
from tests.support.fault_loops import (
    Engine,
    Outcome,
    Rollout,
    Tally,
    harness_client,
    judge,
    rebuild,
    run_loops,
    write_script,
)
from tests.support.frontend import engine_server, front_end
from tokcap_devtools.engine.tokenizer import load_tokenizer
from transports.redis import RedisTokenStore

pytestmark = pytest.mark.slow
LOOPS = 16
SLOW_EVENT_MS = 200  # Redis notes events slower than this, in ms (its latency monitor)
STALL_MS = 1000  # an AOF write or fsync this slow is the disk's fault, not the load's
CAPTURE_TIMEOUT_S = 2.0
# Short store timeouts, so an outage is seen within the capture timeout.
REDIS_TIMEOUTS = {"socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "max_retries": 1}


def redis_settings(
    upstream: str, url: str, prefix: str, cluster: bool = False, **server: Any
) -> ServerSettings:
    store = {
        "url": url,
        "key_prefix": prefix,
        **REDIS_TIMEOUTS,
        **({"cluster": True} if cluster else {}),
    }
    capture = TokenIdCaptureConfig(
        enabled=True, sink="transports.redis:RedisTokenSink", sink_kwargs=store
    )
    server = {"capture_timeout_s": CAPTURE_TIMEOUT_S, **server}
    return ServerSettings(upstream=upstream, capture=capture, **server)


def file_settings(upstream: str, store_dir: Path) -> ServerSettings:
    capture = TokenIdCaptureConfig(enabled=True, dir=str(store_dir))
    return ServerSettings(upstream=upstream, capture=capture, capture_timeout_s=CAPTURE_TIMEOUT_S)


def new_rollouts(name: str, count: int = LOOPS, turns: tuple[int, ...] = (6, 7, 8, 9, 10)):
    return [Rollout(f"{name}-{n}", turns[n % len(turns)]) for n in range(count)]


async def background_notes_done(timeout: float = 60.0) -> None:
    """Wait for the front end's background notes of unserved calls (same process)."""
    deadline = time.monotonic() + timeout
    while context._background and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def after(delay: float, *steps: Any) -> None:
    """Run blocking fault steps in order, ``delay`` seconds in, then between each."""
    for step in steps:
        await asyncio.sleep(delay)
        await asyncio.to_thread(step)


@contextlib.asynccontextmanager
async def redis_source(
    url: str, prefix: str, cluster: bool = False
) -> AsyncIterator[RedisTokenStore]:
    store = RedisTokenStore(url=url, key_prefix=prefix, cluster=cluster)
    try:
        yield store
    finally:
        await store.close()


async def redis_run(
    fault: str,
    engine: Engine,
    server: Any,
    prefix: str,
    rollouts: list[Rollout],
    *fault_tasks: Any,
    upstream: str | None = None,
    server_settings: dict[str, Any] | None = None,
    cluster: bool = False,
    before_rebuild: Callable[[], Awaitable[None]] | None = None,
    **options: Any,
) -> Outcome:
    """Loops through a front end on ``server``'s Redis (a cluster's, with ``cluster``), with
    faults alongside; then ``before_rebuild`` (the operator's fix), the rebuild, the outcome."""
    tally = Tally()
    settings = redis_settings(
        upstream or engine.url, server.url, prefix, cluster, **(server_settings or {})
    )
    with front_end(settings) as front:
        async with harness_client(tally) as http:
            gathered = await asyncio.gather(
                run_loops(front, rollouts, http, **options), *fault_tasks
            )
        await background_notes_done()
    if before_rebuild is not None:
        await before_rebuild()
    async with redis_source(server.url, prefix, cluster) as source:
        records = await rebuild(source, gathered[0])
    return judge(fault, gathered[0], records, engine.truth(), tally)


def felt(outcome: Outcome) -> bool:
    """The fault reached the harnesses: 503s, or streams ended by their error event (which
    the SDK does not retry, so the loop gives up)."""
    return outcome.statuses.get(503, 0) > 0 or outcome.failed_loops > 0


def assert_no_critical(outcome: Outcome) -> None:
    assert not outcome.critical, "\n".join(outcome.critical)


async def test_no_fault_every_call_is_delivered(engine: Engine, redis_server_factory, redis_prefix):
    server = redis_server_factory()
    rollouts = new_rollouts("calm")
    outcome = await redis_run("no fault", engine, server, redis_prefix, rollouts)
    assert_no_critical(outcome)
    assert outcome.masked == 0 and outcome.failed_loops == 0
    assert outcome.answered_calls == sum(r.turns for r in rollouts)


@pytest.mark.parametrize("down_s", [3.0, 8.0])
async def test_redis_kill9_mid_run_then_restart(
    engine: Engine, redis_server_factory, redis_prefix, down_s: float
):
    server = redis_server_factory()
    fault = after(0.8, server.kill9)
    back = after(0.8 + down_s, server.start)
    outcome = await redis_run(
        f"redis kill -9 for {down_s:.0f} s",
        engine,
        server,
        redis_prefix,
        new_rollouts("kill9"),
        fault,
        back,
    )
    assert_no_critical(outcome)


# Relayed streams at once through a Redis kill -9 (issue 22): 200 here; the figure of 1,000
# comes from TOKCAP_FAULT_STREAMS=1000 (a few minutes on two cores).
STREAMS = int(os.environ.get("TOKCAP_FAULT_STREAMS", "200"))


async def test_relayed_streams_at_once_through_a_redis_kill9(
    tmp_path: Path, redis_server_factory, redis_prefix
):
    """Every loop's calls stream from a paced engine (1.5 s to the first token, then 20 ms a
    token), so the deltas of hundreds of calls are out when Redis dies: those calls end
    with an error event instead of their final one, and none may be delivered unmasked."""
    server = redis_server_factory()
    truth = tmp_path / "ground_truth.jsonl"
    script = write_script(tmp_path / "script.yaml")
    paced = {"first_token_s": 1.5, "token_s": 0.02}
    with engine_server(script_path=script, ground_truth_path=str(truth), **paced) as url:
        outcome = await redis_run(
            f"{STREAMS} relayed streams, redis kill -9 for 4 s",
            Engine(url, truth),
            server,
            redis_prefix,
            new_rollouts("streams", STREAMS, turns=(2, 3)),
            after(3.5, server.kill9),
            after(7.5, server.start),
            server_settings={"keepalive_s": 1.0},
        )
    print(outcome.row())
    assert_no_critical(outcome)
    assert felt(outcome)


async def test_redis_down_for_the_last_call_of_each_rollout(
    engine: Engine, redis_server_factory, redis_prefix
):
    """Every loop waits before its last call; Redis dies; the last calls get 503s only."""
    server = redis_server_factory()
    rollouts = new_rollouts("last")
    waiting = 0
    down = asyncio.Event()

    async def before_turn(rollout: Rollout, turn: int) -> None:
        nonlocal waiting
        if turn == rollout.turns - 1:
            waiting += 1
            await down.wait()

    async def kill_when_all_wait() -> None:
        while waiting < len(rollouts):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(server.kill9)
        down.set()

    tally = Tally()
    with front_end(redis_settings(engine.url, server.url, redis_prefix)) as front:
        async with harness_client(tally) as http:
            loops = run_loops(front, rollouts, http, max_retries=1, before_turn=before_turn)
            done, _ = await asyncio.gather(loops, kill_when_all_wait())
        await asyncio.to_thread(server.start)  # same port and data: the notes land now
        await background_notes_done()
    async with redis_source(server.url, redis_prefix) as source:
        records = await rebuild(source, done)
    outcome = judge("redis down for the last call", done, records, engine.truth(), tally)
    assert_no_critical(outcome)
    assert outcome.failed_loops == len(rollouts)  # no last call was answered
    assert outcome.answered_calls == sum(r.turns - 1 for r in rollouts)
    # Each last call was answered with the overloaded error: a 503, or the error event of
    # a stream relayed before its capture failed; never with its final event.
    assert all("overloaded_error" in (rollout.error or "") for rollout in done)


async def test_redis_stopped_longer_than_its_client_timeout(
    engine: Engine, redis_server_factory, redis_prefix
):
    """SIGSTOP for 4 s (socket timeout 1 s): writes stall, time out, and some land late."""
    server = redis_server_factory()
    pid = server.proc.pid
    try:
        outcome = await redis_run(
            "redis SIGSTOP for 4 s",
            engine,
            server,
            redis_prefix,
            new_rollouts("sigstop"),
            after(0.8, lambda: os.kill(pid, signal.SIGSTOP)),
            after(4.8, lambda: os.kill(pid, signal.SIGCONT)),
        )
    finally:
        os.kill(pid, signal.SIGCONT)  # never leave a stopped server behind
    assert_no_critical(outcome)
    assert felt(outcome)


def swap_out(store_dir: Path) -> Any:
    """Make the store's path unusable (a plain file where the directory was); undo after."""
    away = store_dir.with_name(store_dir.name + ".away")

    def block() -> None:
        store_dir.rename(away)
        store_dir.write_text("not a directory: the file store is unwritable for a while\n")

    def restore() -> None:
        store_dir.unlink()
        away.rename(store_dir)

    return block, restore


async def test_file_store_unwritable_mid_run(engine: Engine, tmp_path: Path):
    store_dir = tmp_path / "captures"
    store_dir.mkdir()
    block, restore = swap_out(store_dir)
    rollouts = new_rollouts("unwritable")
    tally = Tally()
    with front_end(file_settings(engine.url, store_dir)) as front:
        async with harness_client(tally) as http:
            done, *_ = await asyncio.gather(
                run_loops(front, rollouts, http), after(0.8, block), after(3.8, restore)
            )
        await background_notes_done()
    store = FileTokenStore(store_dir)
    try:
        records = await rebuild(store, done)
    finally:
        await store.close()
    outcome = judge("file store unwritable for 3 s", done, records, engine.truth(), tally)
    assert_no_critical(outcome)
    assert felt(outcome)


async def test_500_concurrent_loops_without_a_fault_capture_every_call(
    engine: Engine, redis_server_factory, redis_prefix
):
    """More loops than the Redis pool has connections: every call waits its turn, none fails.

    Redis notes every event slower than ``SLOW_EVENT_MS`` (its latency monitor). A run in
    which a call was lost while the disk held Redis's AOF writes for ``STALL_MS`` or more had a
    fault after all (a CI run here saw the file store's writes wait over 5 s): it is skipped,
    saying so. Any other loss fails the test with what Redis noted."""
    server = redis_server_factory(**{"latency-monitor-threshold": str(SLOW_EVENT_MS)})
    rollouts = new_rollouts("crowd", 500, turns=(2, 3))
    outcome = await redis_run(
        "500 concurrent loops",
        engine,
        server,
        redis_prefix,
        rollouts,
        server_settings={"capture_timeout_s": context.DEFAULT_CAPTURE_TIMEOUT_S},
    )
    assert_no_critical(outcome)
    if outcome.masked or outcome.failed_loops:
        slow = await slow_events(server.url)
        stalled = [event for event in slow if event[0].startswith(b"aof") and event[3] >= STALL_MS]
        if stalled:  # a fault after all: the disk held Redis's own writes for seconds
            pytest.skip(f"the disk stalled Redis's AOF writes: {stalled}; {outcome.masked} masked")
        raise AssertionError(f"{outcome.masked} masked; Redis's slow events: {slow}")
    assert outcome.statuses == {200: sum(r.turns for r in rollouts)}, outcome.errors


async def slow_events(url: str) -> Any:
    """What Redis's latency monitor kept: per event, when it last happened, its last and
    its longest time in ms (``aof-fsync-always``: the fsync of each write)."""
    client = aioredis.Redis.from_url(url)
    try:
        return await client.execute_command("LATENCY", "LATEST")
    finally:
        await client.aclose()


async def test_a_corrupting_proxy_between_front_end_and_engine(
    engine: Engine, redis_server_factory, redis_prefix
):
    """Every corruption mode once, one call in ten, while 16 loops make 126 calls.

    At most 13 calls are corrupted, so at least three rollouts run clean and must come out
    unmasked and exact, while every corrupted one is masked.
    """
    server = redis_server_factory()
    with corrupting_proxy(engine.url) as proxy:
        proxy.interleave(clean_calls=9)
        outcome = await redis_run(
            "corrupting proxy",
            engine,
            server,
            redis_prefix,
            new_rollouts("corrupt"),
            upstream=proxy.url,
            server_settings={"vocab_size": load_tokenizer().vocab_size},
        )
    assert_no_critical(outcome)
    assert set(proxy.applied) == set(MODES)
    assert 0 < outcome.masked < outcome.rollouts
