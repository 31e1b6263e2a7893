"""The prompt a reply's check packed reaches tokcap's stores packed, and other sinks as a list.

Every engine adapter's prompt check packs the ids (little-endian uint32) on its way to
checking them; the entry of a captured call carries those bytes as ``PackedIds`` to a sink
that says it reads them, so the put proves prefix reuse with one memcmp.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from api.call.capture import call_entry, output_items
from api.engine import sglang, vllm
from api.engine.checks import checked_ids, sent_prompt_check
from capture.codec.packed import PackedIds, pack_ids
from capture.context import CallCapture
from capture.filestore.store import FileTokenStore
from tests.api.test_engine_adapters import PROMPT, fixture


def test_every_adapter_packs_the_prompt_it_checked() -> None:
    chat = fixture("vllm-0.10.2-chat.json")
    assert vllm.read_chat(chat).prompt_packed == pack_ids(chat["prompt_token_ids"])
    chat = fixture("sglang-0.5.23-chat.json")
    prompt = chat["choices"][0]["prompt_token_ids"]
    assert sglang.read_chat(chat).prompt_packed == pack_ids(prompt)
    tokens = vllm.read_tokens(fixture("vllm-0.10.2-completions-tokens.json"), PROMPT)
    assert tokens.prompt_packed == pack_ids(PROMPT)
    generate = sglang.read_tokens(fixture("sglang-0.5.23-generate.json"), PROMPT)
    assert generate.prompt_packed == pack_ids(PROMPT)


def test_unusable_ids_leave_nothing_packed() -> None:
    assert vllm.read_chat(fixture("vllm-0.10.2-chat-placeholder.json")).prompt_packed is None
    chat = fixture("vllm-0.10.2-chat.json")
    chat["prompt_token_ids"][2] = -1
    generation = vllm.read_chat(chat)
    assert "prompt id 2 is -1" in generation.ids_problem and generation.prompt_packed is None
    assert (
        vllm.read_tokens(fixture("vllm-0.10.2-completions-tokens.json"), PROMPT[1:]).prompt_packed
        is None
    )


def test_a_sent_prompt_that_does_not_pack_is_a_problem_not_an_error() -> None:
    for ids in ([1.0, 2], [1, None], [2**32]):
        packed, problem = sent_prompt_check(ids, {})
        assert packed is None and "do not pack" in problem
    assert sent_prompt_check([1, 2], {}) == (pack_ids([1, 2]), None)


@pytest.mark.parametrize(
    ("ids", "vocab", "problem"),
    [
        ([1, 2, 3], None, None),
        ([], 0, None),
        ([1, 2**32], None, "id 1 is 4294967296, beyond any vocabulary"),
        ([1, True], None, "id 1 is True"),
        ([5, 10], 10, "id 1 is 10, not below the vocabulary size 10"),
    ],
)
def test_checked_ids_pack_only_tokens(ids: list[Any], vocab: int | None, problem: str | None):
    packed, found = checked_ids("prompt", ids, vocab)
    if problem is None:
        assert found is None and packed == pack_ids(ids)
    else:
        assert packed is None and problem in found


class ListSink:
    """A sink that does not say it reads packed ids."""

    async def put(self, entry: Any) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...


async def test_the_entry_carries_packed_ids_only_to_a_sink_that_reads_them(tmp_path: Path):
    reply = fixture("vllm-0.10.2-chat.json")
    generation = vllm.read_chat(copy.deepcopy(reply))
    items = output_items(generation)
    store = FileTokenStore(tmp_path)
    try:
        to_store = call_entry(generation, items, CallCapture("r-1", store, "call-1"))
        to_other = call_entry(generation, items, CallCapture("r-1", ListSink(), "call-1"))
        assert isinstance(to_store.prompt_token_ids, PackedIds)
        assert type(to_other.prompt_token_ids) is list
        assert to_store.prompt_token_ids == to_other.prompt_token_ids == reply["prompt_token_ids"]
        await store.begin_call("r-1", "call-1")
        await store.put(to_store)
        snapshot = await store.freeze("r-1")
        assert snapshot.entries[0].prompt_token_ids == reply["prompt_token_ids"]
        assert snapshot.entries[0].model_dump() == to_other.model_dump() | {
            "created_at": snapshot.entries[0].created_at
        }
    finally:
        await store.close()
