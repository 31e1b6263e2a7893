"""Text mode's splits on the real engines (issue 23): reported, and never delivered wrong.

In text mode the engine renders each prompt from the chat history with its own template. Qwen3's
template drops an earlier turn's thinking once a new user message follows, so the second
call's prompt no longer extends the first call's sampled ids: the rollout splits. The
rebuild must say so (two chains, a delivered fraction below one) and deliver only ids the
engine sampled; with ``delivery: segments`` the other chain comes as a segment of its own. The same
conversation through faithful prompts stays one chain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.real_engines.conftest import RealEngine
from tests.real_engines.log_probs import assert_captured_as_sampled
from tests.real_engines.test_engines import answer, base, proxy_for, settings
from tests.support.frontend import (
    assert_one_contiguous_chain,
    finalize,
    freeze,
    front_end,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]


def two_user_turns(url: str) -> list[Any]:
    """Two user messages, the first reply (thinking and text) sent back as the CLI sends it."""
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello 1"}]
    replies = []
    for follow_up in ("hello 2", None):
        reply = client.messages.create(model="m", max_tokens=100, messages=messages)
        replies.append(reply)
        if follow_up:
            content = [b.model_dump() for b in reply.content]
            messages += [{"role": "assistant", "content": content}]
            messages += [{"role": "user", "content": follow_up}]
    return replies


def carried_sequences(items: list[dict[str, Any]]) -> list[tuple[tuple[int, ...], ...]]:
    return [
        (tuple(item["prompt_token_ids"]), tuple(item["generation_token_ids"]))
        for item in items
        if "generation_token_ids" in item
    ]


def test_text_modes_split_is_reported_and_delivers_only_what_the_engine_sampled(
    engine: RealEngine, tmp_path: Path
) -> None:
    with proxy_for(engine) as proxy, front_end(settings(proxy.url, tmp_path)) as front:
        replies = two_user_turns(base(front, "split-1"))
    assert [b.type for b in replies[0].content if b.type != "text"] == ["thinking"]
    assert replies[1].content[-1].text.strip() == "Hello again from the tiny model."
    snapshot = freeze(tmp_path, "split-1")
    assert not snapshot.incomplete
    assert_captured_as_sampled(snapshot, proxy.sampled)
    first, second = sorted(proxy.sampled, key=lambda r: len(r["prompt_token_ids"]))
    sampled_first = first["prompt_token_ids"] + first["token_ids"]
    assert second["prompt_token_ids"][: len(sampled_first)] != sampled_first, (
        "the engine re-rendered"
    )

    record, build = finalize(tmp_path, "split-1", answer(replies[1]))
    assert not build.masked, build.metrics
    assert build.metrics["n_calls"] == 2 and build.metrics["chains"] == 2
    assert build.metrics["delivered_fraction"] < 1.0
    main = [(tuple(second["prompt_token_ids"]), tuple(second["token_ids"]))]
    assert carried_sequences(record["response"]["output"]) == main
    # With segments the call the split left out comes too, as a segment of its own.
    record, build = finalize(tmp_path, "split-1", answer(replies[1]), "segments")
    assert build.metrics["delivered_fraction"] == 1.0
    assert carried_sequences(record["response"]["output"]) == main
    segments = record["_ng_token_segments"]
    delivered = [seq for segment in segments for seq in carried_sequences(segment["output"])]
    assert delivered == [(tuple(first["prompt_token_ids"]), tuple(first["token_ids"]))]


def test_the_same_turns_through_faithful_prompts_are_one_chain(
    engine: RealEngine, tmp_path: Path
) -> None:
    with proxy_for(engine) as proxy:
        faithful = settings(
            proxy.url, tmp_path, prompts="faithful", renderer={"tokenizer": "qwen3"}
        )
        with front_end(faithful) as front:
            replies = two_user_turns(base(front, "split-2"))
    snapshot = freeze(tmp_path, "split-2")
    assert_captured_as_sampled(snapshot, proxy.sampled)
    record, build = finalize(tmp_path, "split-2", answer(replies[1]), "segments")
    assert_one_contiguous_chain(build, record, 2)
