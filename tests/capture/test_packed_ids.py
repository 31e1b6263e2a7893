"""PackedIds: a prompt kept as the uint32 bytes the front end's id check packed.

It must read exactly like the list it stands for, and encoding an entry that carries it must
give the same body, blocks and digest as the list would, with or without the chain memo.
"""

from __future__ import annotations

import copy
import json
import pickle

import msgpack
import numpy
import orjson
import pytest

from capture import IdView, json_default
from capture.codec.entries import ChainMemo, decode_entry, encode_entry
from capture.codec.packed import PackedIds, pack_ids
from tests.capture.test_codec import B, growing_calls, make_entry

IDS = [0, 7, 151_668, 2**32 - 1, 42]


def test_packed_ids_read_like_their_list() -> None:
    packed = PackedIds.of(IDS)
    assert len(packed) == len(IDS) and packed.tolist() == IDS and list(packed) == IDS
    assert [packed[i] for i in range(-5, 5)] == [IDS[i] for i in range(-5, 5)]
    assert packed[1:3] == IDS[1:3] and packed[::-2] == IDS[::-2] and packed[9:] == []
    with pytest.raises(IndexError):
        packed[5]
    assert packed == IDS and IDS == packed and packed == PackedIds.of(IDS)
    assert packed == IdView(IDS, 0, 5) and packed != IDS[:4] and packed != [*IDS[:4], 43]
    assert packed + [1] == [*IDS, 1] and [1] + packed == [1, *IDS]
    assert copy.deepcopy(packed) == IDS and type(pickle.loads(pickle.dumps(packed))) is list
    assert numpy.asarray(packed).tolist() == IDS


def test_packed_ids_serialize_as_lists() -> None:
    record = {"prompt_token_ids": PackedIds.of(IDS)}
    assert json.loads(json.dumps(record, default=json_default)) == {"prompt_token_ids": IDS}
    assert orjson.loads(orjson.dumps(record, default=json_default))["prompt_token_ids"] == IDS
    packed = msgpack.packb(record, default=json_default)
    assert msgpack.unpackb(packed)["prompt_token_ids"] == IDS
    entry = make_entry(IDS).model_copy(update={"prompt_token_ids": PackedIds.of(IDS)})
    assert entry.model_dump()["prompt_token_ids"] == IDS
    assert json.loads(entry.model_dump_json())["prompt_token_ids"] == IDS


def test_packed_ids_refuse_bytes_that_are_not_whole_ids() -> None:
    with pytest.raises(ValueError, match="whole number"):
        PackedIds(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="2\\*\\*32"):
        PackedIds.of([2**32])


def packed(entry):
    return entry.model_copy(update={"prompt_token_ids": PackedIds.of(entry.prompt_token_ids)})


@pytest.mark.parametrize("block_size", [B, 3, 250])
def test_a_packed_prompt_encodes_as_its_list_does(block_size: int) -> None:
    memo, list_memo = ChainMemo(), ChainMemo()
    for call in growing_calls(40):
        expected = encode_entry(call, block_size, list_memo)
        for encoded in (
            encode_entry(packed(call), block_size, memo),
            encode_entry(packed(call), block_size),
        ):
            assert (encoded.body, encoded.digest, encoded.chain) == (
                expected.body,
                expected.digest,
                expected.chain,
            )
            assert decode_entry(encoded.body, dict(encoded.blocks)) == call


def remembering(prompt: list[int]) -> ChainMemo:
    """A memo that encoded one packed call of ``prompt``, generation (5, 6)."""
    memo = ChainMemo()
    encode_entry(packed(make_entry(prompt, model_call_id="a")), B, memo)
    return memo


@pytest.mark.parametrize(
    ("prompt", "at", "shared"),
    [
        # 20 prompt ids + 2 generated: its first 2 whole blocks (16 ids) are remembered.
        (20, 3, 0),
        (20, 8, 1),
        (20, 15, 1),
        (20, 16, 2),
        (20, 21, 2),
        # 14 + 2: the remembered blocks end in the generation's ids.
        (14, 7, 0),
        (14, 14, 1),
        (14, 15, 1),
    ],
)
def test_the_memo_reuses_the_whole_blocks_a_packed_prompt_shares(
    prompt: int, at: int, shared: int
) -> None:
    sequence = [*range(prompt), 5, 6]
    assert len(remembering(list(range(prompt))).prefix("r-1", PackedIds.of(sequence), B)) == 2
    changed = list(sequence)
    changed[at] = 999  # one id changed: the blocks before its own are reused, no later one
    memo = remembering(list(range(prompt)))
    assert len(memo.prefix("r-1", PackedIds.of(changed), B)) == shared
    call = packed(make_entry(changed, model_call_id="b"))
    assert encode_entry(call, B, memo).chain == encode_entry(call, B).chain


def test_the_memo_reuses_no_more_than_a_packed_prompt_holds() -> None:
    sequence = [*range(20), 5, 6]
    memo = remembering(list(range(20)))
    # Shorter than the prefix: only its own whole blocks; a list after packed calls: none.
    assert len(memo.prefix("r-1", PackedIds.of(sequence[:10]), B)) == 1
    assert memo.prefix("r-1", PackedIds.of(sequence[:7]), B) == ()
    assert memo.prefix("r-1", [*sequence, 9], B) == ()
    grown = make_entry([*sequence, 1, 2, 3], model_call_id="c")
    assert encode_entry(grown, B, memo).digest == encode_entry(grown, B).digest
    assert memo.prefix("r-1", PackedIds.of(sequence), B) == ()  # the list call replaced it


def test_pack_ids_takes_packed_ids_as_they_are() -> None:
    ids = PackedIds.of(IDS)
    assert pack_ids(ids) is ids.data and pack_ids(IDS) == ids.data
