"""A chat reply's prompt ids read off its bytes (``api.engine.reply_ids``): packed where
that is certain to give what parsing gives, and the plain parse everywhere else."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from api.engine import vllm
from api.engine.reply_ids import FAST_FROM_BYTES, SpanMemo, loads_with_ids
from capture.codec.packed import PackedIds, pack_ids
from tests.api.test_engine_adapters import fixture

KEY = "prompt_token_ids"


# Ids enough for the fast read to apply (``FAST_FROM_BYTES``) after the ones a test is about.
LONG = ",".join(["151643"] * (FAST_FROM_BYTES // 6))


def with_prompt(text: str, rest: str = LONG) -> bytes:
    """A recorded vLLM chat reply whose prompt list is ``text`` then ``rest``, as they stand
    in the bytes."""
    reply = fixture("vllm-0.10.2-chat.json")
    reply[KEY] = ["HOLE"]
    listed = ",".join(part for part in (text, rest) if part)
    return orjson.dumps(reply).replace(b'["HOLE"]', b"[" + listed.encode() + b"]")


def test_a_long_prompt_reads_packed_and_the_rest_as_parsed() -> None:
    raw = with_prompt("")
    read, parsed = loads_with_ids(raw, KEY), orjson.loads(raw)
    assert isinstance(read[KEY], PackedIds)
    assert read[KEY].tolist() == parsed[KEY]
    assert {**read, KEY: None} == {**parsed, KEY: None}


def test_a_short_prompt_is_parsed_as_it_is() -> None:
    raw = orjson.dumps(fixture("vllm-0.10.2-chat.json"))
    assert type(loads_with_ids(raw, KEY)[KEY]) is list
    raw = with_prompt("1,2", rest=",".join(["1"] * (FAST_FROM_BYTES // 2 - 10)))
    assert len(raw) > FAST_FROM_BYTES and type(loads_with_ids(raw, KEY)[KEY]) is list
    assert loads_with_ids(with_prompt("", rest="") + b" " * FAST_FROM_BYTES, KEY)[KEY] == []


def test_random_prompts_read_exactly() -> None:
    rng = random.Random(7)
    for length in (6_000, 16_000, 40_000):
        ids = [
            rng.choice([0, 1, 9, 10, 151_668, 2**32 - 1, rng.randrange(2**17)])
            for _ in range(length)
        ]
        read = loads_with_ids(with_prompt(",".join(map(str, ids)), rest=""), KEY)
        assert isinstance(read[KEY], PackedIds) and read[KEY].data == pack_ids(ids)


@pytest.mark.parametrize(
    "text",
    ["1,true,3", "1,-2,3", "1,2.0,3", "1,2e3,3", "1, 2,3", "1,2,3 ", "4294967296"]
    + ["99999999999999999999999", '1,"2"', "1,null"],
    ids=["bool", "negative", "float", "exponent", "space", "trailing space", "beyond uint32"]
    + ["beyond int64", "string", "null"],
)
def test_anything_but_plain_integers_is_parsed_as_it_is(text: str) -> None:
    raw = with_prompt(text)
    assert loads_with_ids(raw, KEY) == orjson.loads(raw)
    assert not isinstance(loads_with_ids(raw, KEY)[KEY], PackedIds)


@pytest.mark.parametrize("text", ["1,,2", ",1", "1,", "1;2", "01,2", "1,02", "1,00"])
def test_a_list_that_is_not_json_is_refused_as_before(text: str) -> None:
    with pytest.raises(ValueError):
        loads_with_ids(with_prompt(text), KEY)


def test_the_field_twice_or_not_at_the_top_is_parsed_as_it_is() -> None:
    reply: dict[str, Any] = orjson.loads(with_prompt(""))
    long = reply.pop(KEY)
    nested = {"engine_extra": {KEY: [7, 8, 9, *long]}, **reply, KEY: []}
    raw = orjson.dumps(nested)  # the first, and only non-empty, list is not the reply's own
    assert loads_with_ids(raw, KEY) == nested
    inner = {**reply, "kv_transfer_params": {KEY: long}}
    assert loads_with_ids(orjson.dumps(inner), KEY) == inner  # once, and nested
    # A generated text naming the field: JSON escapes its quotes, so it never matches.
    reply = orjson.loads(with_prompt(""))
    reply["choices"][0]["message"]["content"] = '"prompt_token_ids":[1,2]'
    read = loads_with_ids(orjson.dumps(reply), KEY)
    assert isinstance(read[KEY], PackedIds) and read["choices"] == reply["choices"]


def test_a_packed_read_checks_as_the_parsed_list_does() -> None:
    reply = fixture("vllm-0.10.2-chat.json")
    reply[KEY] = [*reply[KEY], *orjson.loads(f"[{LONG}]")]
    reply["usage"]["prompt_tokens"] = len(reply[KEY])
    read = loads_with_ids(orjson.dumps(reply), KEY)
    assert isinstance(read[KEY], PackedIds)
    packed, parsed = vllm.read_chat(read), vllm.read_chat(reply)
    assert packed.ids_problem is None and packed.prompt_packed == parsed.prompt_packed
    largest = max(reply[KEY])
    packed, parsed = (vllm.read_chat(r, vocab_size=largest) for r in (read, reply))
    assert packed.ids_problem == parsed.ids_problem
    assert packed.ids_problem is not None and "vocabulary size" in packed.ids_problem


# -- a rollout's next prompt: the ids its last one shares are taken, not parsed ----------------


def prompt_reply(ids: list[int]) -> bytes:
    return with_prompt(",".join(map(str, ids)), rest="")


def variants(rng: random.Random, old: list[int]) -> dict[str, list[int]]:
    """Next prompts as a rollout makes them, and as it might not."""
    more = [rng.randrange(151_000) for _ in range(300)]
    cut = rng.randrange(len(old) * 2 // 3, len(old) - 1)
    last = old[-1]
    return {
        "same": old,
        "extended": old + more,
        "last number goes on": old[:-1] + [last * 10 + 7 if last < 10**8 else 1] + more,
        "diverges": old[:cut] + [old[cut] + 1] + more,
        "shorter": old[:cut],
        "first differs": [old[0] + 1] + old[1:],
        "all new": more * 12,
    }


def test_a_rollouts_next_prompt_reads_exactly_whatever_it_shares() -> None:
    rng = random.Random(11)
    for _ in range(20):
        old = [rng.choice([0, 1, 10, 151_643, rng.randrange(151_000)]) for _ in range(9_000)]
        for name, new in variants(rng, old).items():
            memo = SpanMemo()
            loads_with_ids(prompt_reply(old), KEY, memo, "r")
            read = loads_with_ids(prompt_reply(new), KEY, memo, "r")
            assert isinstance(read[KEY], PackedIds) and read[KEY].data == pack_ids(new), name


def test_the_shared_ids_come_from_the_memo_and_the_rest_is_checked() -> None:
    old = [151_643] * 4_000
    memo = SpanMemo()
    loads_with_ids(prompt_reply(old), KEY, memo, "r")
    span, packed = memo.get("r")
    memo.keep("r", span, pack_ids([7] * 4_000))  # what the memo says the bytes held
    read = loads_with_ids(prompt_reply(old + [5]), KEY, memo, "r")
    assert read[KEY].tolist() == [7] * 4_000 + [5]
    raw = prompt_reply(old).replace(b"151643]", b"1.5]")  # a bad id after the shared ones
    assert loads_with_ids(raw, KEY, memo, "r") == orjson.loads(raw)
    assert loads_with_ids(prompt_reply(old), KEY, memo, "other")[KEY].data == packed


def test_the_memo_keeps_to_its_budget_least_recently_used_first_out() -> None:
    memo = SpanMemo(budget=100)
    memo.keep("a", b"1" * 30, b"x" * 20)
    memo.keep("b", b"2" * 30, b"y" * 20)
    assert memo.held == 100 and memo.get("a") is not None
    memo.keep("c", b"3" * 10, b"z" * 10)
    assert memo.get("a") is None and memo.get("b") is not None and memo.held == 70
    memo.keep("b", b"2" * 5, b"y" * 4)
    assert memo.held == 29
    memo.keep("d", b"4" * 200, b"w" * 4)  # more than the budget alone: nothing is kept
    assert memo.held == 0 and memo.get("c") is None and memo.get("d") is None
