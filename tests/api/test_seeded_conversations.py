"""Conversations seeded with turns the policy never sampled, and captures lost mid-run.

A harness may open with assistant turns nobody sampled (few-shot examples, a session
resumed from elsewhere): the rollout is delivered, those turns in its prompt. A rollout
whose stored calls are deleted while its harness runs is masked ("calls missing"), found by
the entries' own stamps (``capture.acked``), not by the harness's history. Both through the
official Anthropic SDK, the real front end and engine, on the file store and on a real Redis.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest

from capture.delivery import finalize_rollout_token_capture
from tests.api.test_frontend_redis import redis_settings
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    both_servers,
    engine_server,
    finalize,
    freeze,
    front_end,
    run,
    sdk_tool_loop,
)
from transports.redis import RedisTokenStore

FEW_SHOT = [
    {"role": "user", "content": "run echo example"},
    {"role": "assistant", "content": "I would call Bash with `echo example`; it prints example."},
]


def tool_loop(
    base: str, seed: list[dict[str, Any]], before_call: Callable[[int], None] | None = None
) -> int:
    """An SDK tool loop opened by ``seed`` (then the task); returns the number of calls."""
    sdk = anthropic.Anthropic(base_url=base, api_key="dummy", max_retries=0)
    messages: list[dict[str, Any]] = [*seed, {"role": "user", "content": "run echo hello"}]
    return sdk_tool_loop(sdk, messages, before_call=before_call, max_tokens=16000)[0]


@pytest.mark.parametrize("delivery", ["chain", "segments"])
def test_a_few_shot_conversation_is_delivered_whole(tmp_path: Path, delivery: str) -> None:
    with both_servers(tmp_path / "store") as servers:
        calls = tool_loop(servers.base(f"seeded-{delivery}"), FEW_SHOT)
        truth = servers.ground_truth()
    assert calls >= 2  # the scripted policy (Bash, Bash, answer) counts the seeded turn
    snapshot = freeze(servers.store_dir, f"seeded-{delivery}")
    assert_entries_equal_ground_truth(snapshot, truth)
    record, build = finalize(servers.store_dir, f"seeded-{delivery}", [], delivery=delivery)
    assert_one_contiguous_chain(build, record, calls)
    assert build.metrics["seeded_roots"] == 1 and build.metrics["mask_reasons"] == []


async def _finalized(url: str, prefix: str, rollout_id: str) -> Any:
    store = RedisTokenStore(url=url, key_prefix=prefix)
    try:
        record = {"_ng_rollout_id": rollout_id, "response": {"output": []}}
        return record, await finalize_rollout_token_capture(record, store)
    finally:
        await store.close()


async def _delete(url: str, prefix: str, rollout_id: str) -> None:
    store = RedisTokenStore(url=url, key_prefix=prefix)
    try:
        await store.delete(rollout_id)
    finally:
        await store.close()


def test_a_capture_deleted_mid_run_is_masked(redis_url: str, redis_prefix: str) -> None:
    """The operator deletes a running rollout after two calls: the third call's entry says
    two were stored before it, none is there. The same loop left alone is delivered."""

    def delete_before_third(n: int) -> None:
        if n == 2:
            run(_delete(redis_url, redis_prefix, "cut-mid-run"))

    with (
        engine_server() as engine,
        front_end(redis_settings(engine, redis_url, redis_prefix)) as front,
    ):
        base = f"{front}/ng-rollout/{{}}/training-token-capture"
        assert tool_loop(base.format("whole-run"), []) == 3
        assert tool_loop(base.format("cut-mid-run"), [], delete_before_third) == 3
    _, whole = run(_finalized(redis_url, redis_prefix, "whole-run"))
    assert not whole.masked, whole.metrics["mask_reasons"]
    _, cut = run(_finalized(redis_url, redis_prefix, "cut-mid-run"))
    assert cut.masked and cut.metrics["n_calls"] == 1
    (reason,) = cut.metrics["mask_reasons"]
    assert re.match(
        r"calls missing: front-end process \w+ had 2 of this rollout's calls stored before "
        r"one it stored later, and 0 of them are in the capture",
        reason,
    ), reason
