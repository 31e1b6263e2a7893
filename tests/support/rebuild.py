"""Rollouts written straight into a Redis store, the checks of their rebuilt records, the
workers the rebuild tests run, and polls of Redis state to wait on them.

``python -m tests.support.rebuild --delay-after-publish-ms N <tokcap worker flags>`` runs
the slow worker (``SlowRetireWorker``) as a process, for tests that kill or stop a worker
between publish and retire.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis

from capture.records import TokenEntry
from tests.support.rollouts import growing_rollout
from tokcap.commands import worker as worker_cli
from transports.rebuild.publish import Published
from transports.rebuild.results import decode_result
from transports.rebuild.settings import WorkerSettings
from transports.rebuild.worker import RebuildWorker
from transports.redis import RedisTokenStore


def final_message(rollout_id: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": f"done with {rollout_id}", "annotations": []}],
    }


def rollout_entries(
    rollout_id: str, turns: int, *, system: int = 40, gen: int = 6, tool: int = 10
) -> list[TokenEntry]:
    """A tool-using rollout whose last call gave the harness's final answer."""
    return growing_rollout(
        rollout_id,
        turns,
        system_tokens=system,
        generated_per_turn=gen,
        tool_tokens_per_turn=tool,
        final_item=final_message(rollout_id),
    )


def finished_record(rollout_id: str) -> dict[str, Any]:
    return {
        "_ng_rollout_id": rollout_id,
        "response": {"output": [final_message(rollout_id)]},
        "reward": 1.0,
    }


async def populate(
    url: str, prefix: str, rollout_ids: list[str], turns: int = 3, lose_one: bool = False
) -> None:
    """Put every call of each rollout; ``lose_one`` adds an intent that never gets its entry."""
    store = RedisTokenStore(url=url, key_prefix=prefix)
    try:
        for rollout_id in rollout_ids:
            for entry in rollout_entries(rollout_id, turns):
                await store.put(entry)
            if lose_one:
                await store.begin_call(rollout_id, "mc-lost")
    finally:
        await store.close()


async def inspect(url: str, prefix: str, rollout_id: str) -> dict[str, Any]:
    store = RedisTokenStore(url=url, key_prefix=prefix)
    try:
        return await store.inspect(rollout_id)
    finally:
        await store.close()


def assert_rebuilt(record: dict[str, Any], turns: int) -> None:
    """The delivered chain covers every call, and its last item carries the exact sequence."""
    rollout_id = record["_ng_rollout_id"]
    expected = rollout_entries(rollout_id, turns)[-1]
    assert record["mask_sample"] is False
    assert record["_ng_token_capture"]["n_calls"] == turns
    carriers = [item for item in record["response"]["output"] if "generation_token_ids" in item]
    assert len(carriers) == turns
    last = carriers[-1]
    assert last["prompt_token_ids"] == expected.prompt_token_ids
    assert last["generation_token_ids"] == expected.generation_token_ids
    assert last["generation_log_probs"] == expected.generation_log_probs


def make_worker(
    url: str, prefix: str, *, delay_after_publish_s: float = 0, **settings: Any
) -> RebuildWorker:
    """A worker of one task that takes over no other consumer's jobs in a test's time;
    ``settings`` override that. With a delay it is a ``SlowRetireWorker``."""
    options = dict(claim_idle_ms=60_000, block_ms=50, consumer="test-worker", concurrency=1)
    worker_settings = WorkerSettings(url=url, key_prefix=prefix, **{**options, **settings})
    if delay_after_publish_s:
        return SlowRetireWorker(worker_settings, delay_after_publish_s)
    return RebuildWorker(worker_settings)


class SlowRetireWorker(RebuildWorker):
    """A worker that waits after each publish, so a test can act before the retire."""

    def __init__(self, settings: WorkerSettings, delay_after_publish_s: float) -> None:
        super().__init__(settings)
        self.delay_after_publish_s = delay_after_publish_s

    async def _publish(self, *args: Any) -> Published:
        published = await super()._publish(*args)
        await asyncio.sleep(self.delay_after_publish_s)
        return published


Predicate = Callable[[], Awaitable[bool]]


class Alive(Protocol):
    def check_alive(self) -> None: ...


async def wait_for(
    predicate: Predicate, what: str, timeout: float = 60.0, procs: Sequence[Alive] = ()
) -> None:
    """Poll until ``predicate()`` holds; fail after ``timeout`` s, or once a process died."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        for proc in procs:
            proc.check_alive()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def stream_holds(client: aioredis.Redis, stream: str, count: int) -> Predicate:
    """True once ``stream`` holds exactly ``count`` entries."""

    async def holds() -> bool:
        return await client.xlen(stream) == count

    return holds


def nothing_pending(client: aioredis.Redis, jobs: str, group: str = "rebuild") -> Predicate:
    """True once every job the group read was acknowledged."""

    async def settled() -> bool:
        return (await client.xpending(jobs, group))["pending"] == 0

    return settled


async def results_of(client: aioredis.Redis, results: str) -> list[dict[str, Any]]:
    """Every result on the stream, decoded, in order, with its stream fields beside it."""
    decoded = []
    for result_id, fields in await client.xrange(results):
        record = decode_result(result_id, fields)
        record["_fields"] = {key.decode(): value for key, value in fields.items()}
        decoded.append(record)
    return decoded


def main(argv: list[str] | None = None) -> int:
    """``tokcap worker`` with a ``SlowRetireWorker``; its other flags are the real CLI's."""
    parser = argparse.ArgumentParser(prog="slow rebuild worker")
    worker_cli.add_arguments(parser)
    parser.add_argument("--delay-after-publish-ms", type=int, required=True)
    args = parser.parse_args(argv)
    delay_s = args.delay_after_publish_ms / 1000
    return worker_cli.run(args, lambda settings: SlowRetireWorker(settings, delay_s))


if __name__ == "__main__":
    sys.exit(main())
