"""A Redis that evicts, or fills up, while rollouts run (issue 26), judged by the engine.

Forty streamed Anthropic-SDK tool loops (6-9 calls) run through the front end while the
operator's mistake strikes: an ``allkeys-lru`` policy with a tiny ``maxmemory`` switched on
mid-run (connections already proven keep writing, and Redis deletes whole rollout hashes),
or ``noeviction`` with memory full, once every loop has stored two calls. The operator then sets the server right, and every
rollout is rebuilt and checked against the engine's ground truth
(``tests.support.fault_loops``): none may be unmasked with an answered call missing. The
same on one master of a Redis Cluster. Every server is the test's own, stopped by PID.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from tests.e2e.test_fault_suite import assert_no_critical, new_rollouts, redis_run
from tests.support.fault_loops import Engine, Outcome
from transports.redis.keys import rollout_key

pytestmark = pytest.mark.slow
LOOPS = 40
TURNS = (6, 7, 8, 9)
MISSING = "calls missing"
# Each tool result adds a few thousand tokens, so the rollouts' growth, not the server's
# buffers, decides when a tight maxmemory is reached.
TOOL_OUTPUT_CHARS = 12_000


async def _memory(client: aioredis.Redis) -> dict[str, Any]:
    return await client.info("memory")


class Pause:
    """Every loop waits before its call ``at`` until the fault struck (at most ``limit_s``),
    so each rollout has calls stored, and more to make, when it strikes."""

    def __init__(self, loops: int, at: int = 2, limit_s: float = 60.0) -> None:
        self.loops, self.at, self.limit_s = loops, at, limit_s
        self.waiting = 0
        self.struck = asyncio.Event()

    async def before_turn(self, rollout: Any, turn: int) -> None:
        if turn == self.at:
            self.waiting += 1
            await asyncio.wait_for(self.struck.wait(), self.limit_s)

    async def all_waiting(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while self.waiting < self.loops and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def squeeze(url: str, policy: str, pause: Pause, headroom: int) -> dict[str, Any]:
    """Once every loop waits, set ``policy`` and a maxmemory ``headroom`` bytes above what
    the server uses now, then let the loops go on; the memory used when it struck."""
    client = aioredis.Redis.from_url(url)
    try:
        await pause.all_waiting()
        used = int((await _memory(client))["used_memory"])
        await client.config_set("maxmemory", str(used + headroom))
        await client.config_set("maxmemory-policy", policy)
        return {"used_at_squeeze": used}
    finally:
        pause.struck.set()
        await client.aclose()


async def set_right(url: str) -> dict[str, Any]:
    """The operator's fix: noeviction, no memory limit; the eviction count so far."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "0")
        return await client.info("stats")
    finally:
        await client.aclose()


def missing_starts(outcome: Outcome) -> int:
    return outcome.mask_reasons.get(MISSING, 0)


async def run_squeezed(
    engine: Engine,
    server: Any,
    prefix: str,
    policy: str,
    headroom: int,
    *,
    node_url: str | None = None,
    cluster: bool = False,
) -> tuple[Outcome, dict[str, Any]]:
    """The loops on ``server`` (a cluster's, with ``cluster``) while ``policy`` strikes the
    node at ``node_url`` (the server itself by default); that node's stats after the fix."""
    node_url = node_url or server.url
    stats: dict[str, Any] = {}
    pause = Pause(LOOPS)

    async def fix_after_loops() -> None:
        stats.update(await set_right(node_url))

    outcome = await redis_run(
        f"{policy} switched on mid-run" + (" on one cluster master" if cluster else ""),
        engine,
        server,
        prefix,
        new_rollouts(policy.split("-")[0], LOOPS, turns=TURNS),
        squeeze(node_url, policy, pause, headroom),
        cluster=cluster,
        before_rebuild=fix_after_loops,
        before_turn=pause.before_turn,
        tool_output_chars=TOOL_OUTPUT_CHARS,
        max_retries=0,  # a loop answered 503 gives up at once: the run stays short
    )
    return outcome, stats


async def test_allkeys_lru_switched_on_mid_run_masks_every_rollout_it_cut(
    engine: Engine, redis_server_factory, redis_prefix
):
    server = redis_server_factory()
    outcome, stats = await run_squeezed(
        engine, server, redis_prefix, "allkeys-lru", headroom=512 * 1024
    )
    assert int(stats["evicted_keys"]) > 0, "the fault was felt: Redis evicted rollouts"
    assert_no_critical(outcome)
    # Without the check, rollouts whose hash was recreated came back unmasked and short
    # (issue 26's table: 10 of 40); here the builder finds where their calls went missing.
    assert missing_starts(outcome) > 0, outcome.mask_reasons


async def test_noeviction_full_memory_fails_closed(
    engine: Engine, redis_server_factory, redis_prefix
):
    server = redis_server_factory()
    outcome, stats = await run_squeezed(
        engine, server, redis_prefix, "noeviction", headroom=512 * 1024
    )
    assert int(stats["evicted_keys"]) == 0
    assert_no_critical(outcome)
    # A full Redis refused writes: calls were answered with the overloaded error (a 503, or
    # the error event of a stream relayed before the capture), and their loops gave up.
    assert outcome.failed_loops > 0


async def test_allkeys_lru_on_one_cluster_master(engine: Engine, redis_cluster_factory):
    """The same mistake on one master of three: its rollouts are cut, none delivered short."""
    cluster = redis_cluster_factory()
    squeezed = cluster.masters()[0]
    outcome, stats = await run_squeezed(
        engine,
        cluster,
        "evict",
        "allkeys-lru",
        headroom=512 * 1024,
        node_url=squeezed.url,
        cluster=True,
    )
    assert int(stats["evicted_keys"]) > 0
    assert_no_critical(outcome)
    assert outcome.masked > 0, "the rollouts of that master lost calls, and are masked"
    with redis.RedisCluster.from_url(cluster.url) as client:
        homes = {
            rollout_id: client.get_node_from_key(rollout_key("evict", rollout_id)).port
            for rollout_id in outcome.masked_rollouts
        }
    assert set(homes.values()) == {squeezed.port}, "only the squeezed master's are masked"
