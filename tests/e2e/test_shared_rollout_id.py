"""Two harness runs under one rollout id (issue 26): never delivered as one rollout.

Two Anthropic-SDK tool loops with different tasks (same system prompt and tools, each its
own first message and final answer) run at once under one ``_ng_rollout_id``, as when a
training loop restarts its numbering; the collector submits the first run's record. With
``delivery: chain`` the first run's own calls are delivered, exactly as the engine sampled
them; with ``delivery: segments`` the record is masked, naming the likely cause, and the
other run's calls are never delivered as a segment. The front end counts the collision and
logs it once. File store and Redis, streamed and not; judged by the engine's ground truth.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from tests.support.fault_loops import (
    Engine,
    Rollout,
    Tally,
    final_record,
    harness_client,
    tool_loop,
    violation,
)
from tests.support.frontend import front_end
from transports.redis import RedisTokenStore

SHARED = "task7-rollout3"
TASKS = (
    "Task A: list the directories under /srv one by one and count the files.",
    "Task B: list the directories under /var/log one by one and find the largest.",
)


def capture_config(kind: str, tmp_path: Path, redis_url: str, prefix: str) -> Any:
    if kind == "file":
        return TokenIdCaptureConfig(enabled=True, dir=str(tmp_path / "captures"))
    return TokenIdCaptureConfig(
        enabled=True,
        sink="transports.redis:RedisTokenSink",
        sink_kwargs={"url": redis_url, "key_prefix": prefix},
    )


def open_source(kind: str, tmp_path: Path, redis_url: str, prefix: str) -> Any:
    if kind == "file":
        return FileTokenStore(tmp_path / "captures")
    return RedisTokenStore(url=redis_url, key_prefix=prefix)


async def run_both(front: str, stream: bool) -> list[Rollout]:
    """Both runs, turn by turn in step, so each turn's two calls are in flight together."""
    runs = [Rollout(SHARED, turns, task=task) for turns, task in zip((6, 7), TASKS, strict=True)]
    at_turn: dict[int, asyncio.Barrier] = {}

    async def in_step(rollout: Rollout, turn: int) -> None:
        if turn < min(r.turns for r in runs) - 1:
            await at_turn.setdefault(turn, asyncio.Barrier(len(runs))).wait()

    async with harness_client(Tally()) as http:
        return list(
            await asyncio.gather(
                *(tool_loop(front, r, http, before_turn=in_step, stream=stream) for r in runs)
            )
        )


def collisions(front: str) -> float:
    scraped = httpx.get(front + "/metrics", timeout=30).text
    for line in scraped.splitlines():
        if line.startswith("tokcap_rollout_id_collisions_total "):
            return float(line.split()[1])
    raise AssertionError("no tokcap_rollout_id_collisions_total in /metrics")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_two_runs_under_one_rollout_id(
    engine: Engine, kind: str, stream: bool, tmp_path: Path, redis_url, redis_prefix, caplog
) -> None:
    capture = capture_config(kind, tmp_path, redis_url, redis_prefix)
    with caplog.at_level(logging.WARNING, logger="tokcap.frontend"):
        with front_end(ServerSettings(upstream=engine.url, capture=capture)) as front:
            ours, theirs = await run_both(front, stream)
            counted = collisions(front)
    assert ours.error is None and theirs.error is None
    assert counted == 1, "the collision is counted once for the rollout"
    warned = [r for r in caplog.records if "two harness runs share" in r.getMessage()]
    assert len(warned) == 1 and SHARED in warned[0].getMessage()

    truth = engine.truth()
    source = open_source(kind, tmp_path, redis_url, redis_prefix)
    try:
        chain = final_record(ours)
        await finalize_rollout_token_capture(chain, source, delivery="chain")
        segments = final_record(ours)
        await finalize_rollout_token_capture(segments, source, delivery="segments")
    finally:
        await source.close()

    # Chain: the first run's own calls, exactly as sampled; the other run's are reported.
    assert violation(ours, chain, truth) is None
    assert chain["mask_sample"] is False
    metrics = chain["_ng_token_capture"]
    assert metrics["unexplained_roots"] == 1 and metrics["delivered_fraction"] < 1.0
    # Segments: masked, with the cause named; nothing of the other run is delivered.
    assert violation(ours, segments, truth) is None
    assert segments["mask_sample"] is True and "_ng_token_segments" not in segments
    reasons = segments["_ng_token_capture"]["mask_reasons"]
    assert any("two harness runs share this rollout id" in reason for reason in reasons)
