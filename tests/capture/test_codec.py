"""The shared entry codec: exact round trips, shared prompt blocks, the payload digest."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.codec.entries import (
    CODEC_VERSION,
    DEFAULT_BLOCK_SIZE,
    ChainMemo,
    decode_entries,
    decode_entry,
    encode_entry,
    pack_ids,
    unpack_ids,
)
from capture.codec.packed import PackedIds
from capture.records import TokenEntry
from tests.support.codec import body_block_names, entry_digest, prompt_blocks
from tests.support.rollouts import growing_rollout

B = 8  # a small block size keeps the arithmetic readable


def make_entry(prompt, generation=(5, 6), log_probs=(-0.5, -0.75), **fields):
    return TokenEntry(
        rollout_id="r-1",
        model_call_id=fields.pop("model_call_id", "call-1"),
        model="policy",
        prompt_token_ids=list(prompt),
        generation_token_ids=list(generation),
        generation_log_probs=list(log_probs),
        output_items=fields.pop(
            "output_items",
            [{"type": "message", "content": [{"type": "output_text", "text": "ok"}]}],
        ),
        token_item_index=0,
        **fields,
    )


def round_trip(entry, block_size=B):
    encoded = encode_entry(entry, block_size)
    return decode_entry(encoded.body, dict(encoded.blocks))


def test_round_trip_exact_with_floats_and_extras():
    log_probs = [-0.1, -1e-300, 5e-324 * -1, -math.inf, -123.456789012345678, 0.0]
    entry = make_entry(
        range(2 * B + 3),
        generation=[0, 1, 2**32 - 1, 151_000, 7, 8],
        log_probs=log_probs,
        routed_experts=[[1, 2], [3, 4]],
        harness="claude-code",
        usage={"input_tokens": 19, "cache": None},
    )
    decoded = round_trip(entry)
    assert decoded == entry
    assert decoded.generation_log_probs == log_probs  # bit-exact, -inf included
    assert decoded.model_extra == {
        "harness": "claude-code",
        "usage": {"input_tokens": 19, "cache": None},
    }
    assert decoded.created_at == entry.created_at


def test_round_trip_empty_prompt_and_generation():
    entry = make_entry([], generation=[], log_probs=[])
    encoded = encode_entry(entry, B)
    assert encoded.blocks == ()
    assert decode_entry(encoded.body, {}) == entry


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    generated=st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.floats(allow_nan=False, width=64)), max_size=20
    ),
    block_size=st.integers(1, 16),
)
def test_round_trip_property(prompt, generated, block_size):
    entry = make_entry(prompt, [g for g, _ in generated], [p for _, p in generated])
    assert round_trip(entry, block_size) == entry


def test_blocks_hold_block_size_tokens():
    prompt = list(range(100, 100 + 2 * B + 5))
    blocks = prompt_blocks(prompt, B)
    assert [len(unpack_ids(payload)) for _, payload in blocks] == [B, B, 5]
    assert [t for _, payload in blocks for t in unpack_ids(payload)] == prompt
    assert len({name for name, _ in blocks}) == 3
    assert (
        prompt_blocks(list(range(2 * B)), B)[-1][0]
        != prompt_blocks(list(range(2 * B + 1)), B)[-1][0]
    )


def test_default_block_size():
    prompt = list(range(DEFAULT_BLOCK_SIZE + 1))
    assert len(encode_entry(make_entry(prompt)).blocks) == 2


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        prompt_blocks([1, 2], 0)


def test_shared_prefixes_give_identical_block_names():
    history = list(range(1, 3 * B + 1))  # three full blocks
    first = encode_entry(make_entry(history[: 2 * B + 2], model_call_id="call-1"), B)
    second = encode_entry(make_entry(history + [900, 901], model_call_id="call-2"), B)
    assert first.block_names[:2] == second.block_names[:2]
    assert first.block_names[2] != second.block_names[2]  # a partial block differs from a full one
    # One rollout-wide block table decodes both entries; a body names only its tip, and the
    # blocks' parent links give the rest of its chain.
    table = dict(first.blocks) | dict(second.blocks)
    assert body_block_names(first.body, table) == first.block_names
    assert body_block_names(second.body, table) == second.block_names
    assert len(table) == 2 + 1 + 2
    assert decode_entry(second.body, table).prompt_token_ids == history + [900, 901]


def test_same_tokens_after_different_prefix_have_different_names():
    # Chained hashes: a block's name depends on everything before it, not only its own tokens.
    tail = list(range(50, 50 + B))
    a = prompt_blocks([1] * B + tail, B)
    b = prompt_blocks([2] * B + tail, B)
    assert a[1][1] == b[1][1] and a[1][0] != b[1][0]


def test_digest_ignores_created_at():
    entry = make_entry(range(20))
    later = entry.model_copy(update={"created_at": entry.created_at + 60})
    assert entry_digest(entry, B) == entry_digest(later, B)
    assert encode_entry(entry, B).body != encode_entry(later, B).body  # the body keeps it


def test_digest_same_for_entry_and_its_mapping():
    entry = make_entry(range(20))
    assert entry_digest(entry, B) == entry_digest(entry.model_dump(), B)


@pytest.mark.parametrize(
    "change",
    [
        {"prompt_token_ids": [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11]},  # inside the first block
        {"prompt_token_ids": list(range(11))},  # one token shorter
        {"prompt_token_ids": list(range(12)) + [0]},  # one token longer
        {"generation_token_ids": [5, 7]},
        {"generation_log_probs": [-0.5, -0.7500000000000001]},
        {
            "output_items": [
                {"type": "message", "content": [{"type": "output_text", "text": "ok!"}]}
            ]
        },
        {"model": "other-policy"},
        {"routed_experts": [[1]]},
        {"note": "an extra field"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_digest_changes_with_any_payload_change(change):
    base = make_entry(range(12))
    changed = TokenEntry.model_validate({**base.model_dump(), **change})
    assert entry_digest(base, B) != entry_digest(changed, B)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_ids_out_of_uint32_range_rejected(bad):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        pack_ids([1, bad])
    with pytest.raises(ValueError):
        encode_entry(make_entry([1, 2, bad]), B)
    with pytest.raises(ValueError):
        encode_entry(make_entry([1, 2], generation=[bad], log_probs=[-1.0]), B)


def test_missing_block_is_reported():
    encoded = encode_entry(make_entry(range(3 * B)), B)
    blocks = dict(encoded.blocks)
    del blocks[encoded.block_names[1]]
    with pytest.raises(ValueError, match=f"prompt block {encoded.block_names[1]}"):
        decode_entry(encoded.body, blocks)


def test_newer_codec_refused():
    encoded = encode_entry(make_entry(range(5)), B)
    body = msgpack.unpackb(encoded.body, raw=False)
    body["codec"] = CODEC_VERSION + 1
    with pytest.raises(ValueError, match=f"codec {CODEC_VERSION + 1}"):
        decode_entry(msgpack.packb(body, use_bin_type=True), dict(encoded.blocks))


# -- the stored form: one chain over prompt + generation, extensions, any block size -------


def store_all(entries, block_size=B):
    """Put entries as a store does (codec plans, store keeps blocks and tails); all blocks."""
    blocks, tails, written = {}, {}, []
    for entry in entries:
        writes = encode_entry(entry, block_size).plan(blocks.keys(), tails)
        blocks.update(writes.blocks)
        tails.update(writes.tails)
        written.append(writes)
    return blocks, written


@pytest.mark.parametrize("entry_fields", [{}, {"note": "extra"}])
def test_digest_independent_of_block_size(entry_fields):
    entry = make_entry(range(100, 100 + 3 * B + 3), **entry_fields)
    digests = {entry_digest(entry, size) for size in (1, 3, B, 64, DEFAULT_BLOCK_SIZE, 1000)}
    assert len(digests) == 1
    # The split between prompt and generation is part of the payload.
    moved = make_entry(
        range(100, 100 + 3 * B + 4), generation=[6], log_probs=[-0.75], **entry_fields
    )
    assert entry_digest(moved, 5) != entry_digest(entry, 5)


def test_generation_shared_with_next_prompt_is_stored_once():
    generation = list(range(500, 500 + 2 * B))
    first = make_entry(range(2 * B), generation=generation, log_probs=[-1.0] * len(generation))
    child = make_entry([*range(2 * B), *generation, 7, 8, 9], model_call_id="call-2")
    blocks, (_, child_writes) = store_all([first, child])
    # The child's prompt starts with the first call's whole sequence (4 full blocks):
    # only its own tail (3 prompt ids + 2 generated) is new.
    assert len(child_writes.blocks) == 1
    stored_ids = sum(len(unpack_ids(data[17:])) for data in blocks.values())
    assert stored_ids == len(child.full_sequence)
    cache = {}
    entries = [decode_entry(encode_entry(e, B).body, blocks, cache=cache) for e in (first, child)]
    assert entries == [first, child]


def test_partial_block_extension_round_trips():
    history = list(range(10, 10 + B + 3))  # a full block, then a partial one
    calls = [make_entry(history[: B + 1], generation=[1], log_probs=[-0.5], model_call_id="call-1")]
    calls.append(
        make_entry(
            [*calls[0].full_sequence, 2], generation=[3], log_probs=[-0.5], model_call_id="call-2"
        )
    )
    calls.append(
        make_entry(
            [*calls[1].full_sequence, *range(40, 40 + B)],
            generation=[4],
            log_probs=[-0.5],
            model_call_id="call-3",
        )
    )
    blocks, written = store_all(calls)
    # call-2 fills the partial block call-1 left: only the new ids are stored, after a
    # kind byte, the parent digest and the extended block's digest.
    ((name, stored),) = written[1].blocks
    assert stored[:1] == b"x" and len(stored) == 33 + 2 * 4
    assert written[1].tails[0][0] == written[0].tails[0][0]  # the same parent's tail moves on
    cache = {}
    assert [decode_entry(encode_entry(c, B).body, blocks, cache=cache) for c in calls] == calls
    total_ids = (
        sum(len(data) - 17 - (16 if data[:1] == b"x" else 0) for data in blocks.values()) // 4
    )
    assert total_ids == len(calls[-1].full_sequence)


def test_extension_needs_the_same_prefix():
    first = make_entry(range(B + 2), generation=[], log_probs=[])
    other = make_entry([*range(B), 99, 98, 97], generation=[], log_probs=[], model_call_id="c-2")
    blocks, written = store_all([first, other])
    assert [data[:1] for _, data in written[1].blocks] == [b"w"]  # not a prefix: stored whole
    assert decode_entry(encode_entry(other, B).body, blocks) == other


@settings(max_examples=40, deadline=None)
@given(
    family=st.lists(
        st.tuples(
            st.integers(0, 8),
            st.lists(st.integers(0, 2), max_size=7),
            st.lists(st.integers(0, 2), max_size=3),
        ),
        min_size=1,
        max_size=8,
    ),
    block_size=st.integers(1, 5),
)
def test_branching_family_round_trips(family, block_size):
    """Calls branch off any earlier call's sequence (retries, subagents, compaction) or
    start afresh; every one decodes exactly from the blocks the codec had stored."""
    entries = []
    for index, (parent, extra, generation) in enumerate(family):
        base = entries[parent % len(entries)].full_sequence if entries and parent else []
        entries.append(
            make_entry(
                [*base, *extra],
                generation=generation,
                log_probs=[-0.25] * len(generation),
                model_call_id=f"call-{index}",
            )
        )
    blocks, _ = store_all(entries, block_size)
    cache = {}
    for entry in entries:
        assert (
            decode_entry(encode_entry(entry, block_size).body, blocks, cache=cache, trusted=True)
            == entry
        )


def growing_calls(turns: int, start: int = 3) -> list[TokenEntry]:
    """Calls whose prompts extend the previous call's sequence by a tool output each turn."""
    calls, prompt = [], list(range(100, 100 + start))
    for turn in range(turns):
        generation = [1000 + 10 * turn + i for i in range(turn % 4 + 1)]
        calls.append(
            make_entry(
                prompt,
                generation,
                [-0.1 * (i + 1) for i in range(len(generation))],
                model_call_id=f"call-{turn:02d}",
            )
        )
        prompt = prompt + generation + [7] * (turn % 3 + 2)
    return calls


def test_incremental_encoding_equals_encoding_from_scratch() -> None:
    memo = ChainMemo()
    for call in growing_calls(40):
        fresh, reused = encode_entry(call, B), encode_entry(call, B, memo)
        assert (reused.body, reused.digest, reused.chain) == (fresh.body, fresh.digest, fresh.chain)


def test_incremental_encoding_reuses_only_a_true_prefix() -> None:
    memo = ChainMemo()
    first = make_entry(range(20), model_call_id="a")
    encode_entry(first, B, memo)
    # Same length, one id changed inside the remembered prefix: nothing may be reused.
    changed = make_entry([*range(3), 999, *range(4, 20), 5, 6, 7], model_call_id="b")
    assert encode_entry(changed, B, memo).chain == encode_entry(changed, B).chain
    # Another block size never reuses blocks cut at this one.
    grown = make_entry([*range(20), 5, 6, 1, 2, 3], model_call_id="c")
    assert encode_entry(grown, 4, memo).digest == encode_entry(grown, 4).digest
    assert encode_entry(grown, 4, memo).chain == encode_entry(grown, 4).chain


def test_chain_memo_is_bounded_least_recent_first() -> None:
    memo = ChainMemo(max_rollouts=2)
    for rollout in ("r-a", "r-b", "r-c"):
        call = make_entry(range(3 * B)).model_copy(update={"rollout_id": rollout})
        encode_entry(call, B, memo)
    assert memo.prefix("r-a", list(range(3 * B)) + [5, 6], B) == ()
    assert len(memo.prefix("r-c", list(range(3 * B)) + [5, 6], B)) == 3


def test_snapshot_decoding_shares_prefixes_and_keeps_order() -> None:
    calls = growing_calls(30)
    memo, table, bodies = ChainMemo(), {}, []
    for call in calls:
        encoded = encode_entry(call, B, memo)
        table.update(encoded.blocks)
        bodies.append(encoded.body)
    shuffled = bodies[::-1][::2] + bodies[::-1][1::2]
    expected = [decode_entry(body, table) for body in shuffled]
    assert decode_entries(shuffled, table, trusted=True) == expected
    assert [e.model_call_id for e in expected] == [
        decode_entry(b, table).model_call_id for b in shuffled
    ]


def test_decoding_switches_no_process_wide_collector_setting(monkeypatch):
    """gc is process-wide: a decode in a serving process must not pause or freeze it."""
    import gc

    from capture.codec.entries import decode_entries

    touched: list[str] = []
    for name in ("disable", "freeze", "unfreeze"):
        monkeypatch.setattr(gc, name, lambda name=name: touched.append(name))
    entries = growing_rollout("r", 5, system_tokens=300, generated_per_turn=20)
    encoded = [encode_entry(entry, 64) for entry in entries]
    blocks = dict(block for item in encoded for block in item.blocks)
    decode_entries([item.body for item in encoded], blocks, trusted=True)
    assert touched == []


def test_chain_memo_keeps_a_thousand_rollouts_of_16k_packed_ids_within_its_bytes() -> None:
    """A writer with 1,000 rollouts in flight re-encodes only what each call adds: the
    memo is bounded by the bytes it keeps, not by a few dozen rollouts."""
    prompt, size = PackedIds(pack_ids(range(16_000))), DEFAULT_BLOCK_SIZE

    def entry(n: int) -> TokenEntry:
        return make_entry([]).model_copy(
            update={"rollout_id": f"r-{n}", "prompt_token_ids": prompt}
        )

    memo = ChainMemo()
    for n in range(1_000):
        encode_entry(entry(n), size, memo)
    assert len(memo.prefix("r-0", prompt, size)) == 16_000 // size
    one = ChainMemo()
    encode_entry(entry(0), size, one)
    small = ChainMemo(max_bytes=3 * one._bytes)  # what three such rollouts hold
    for n in range(5):
        encode_entry(entry(n), size, small)
    kept = [len(small.prefix(f"r-{n}", prompt, size)) > 0 for n in range(5)]
    assert kept == [False, False, True, True, True]
