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


def test_the_memo_reuses_a_packed_prefix_only_when_it_is_one() -> None:
    memo = ChainMemo()
    first = packed(make_entry(range(20), model_call_id="a"))
    encode_entry(first, B, memo)
    sequence = [*range(20), 5, 6]
    assert len(memo.prefix("r-1", PackedIds.of([*sequence, 9]), B)) == 2
    # One id changed inside the remembered prefix, in the prompt's part or the generation's.
    for at in (3, 21):
        changed = list(sequence)
        changed[at] = 999
        assert memo.prefix("r-1", PackedIds.of(changed), B) == ()
        call = packed(make_entry(changed, model_call_id="b"))
        assert encode_entry(call, B, memo).chain == encode_entry(call, B).chain
    # Shorter than the prefix, or a list after packed calls: nothing is reused, all is right.
    assert memo.prefix("r-1", PackedIds.of(sequence[:10]), B) == ()
    assert memo.prefix("r-1", [*sequence, 9], B) == ()
    grown = make_entry([*sequence, 1, 2, 3], model_call_id="c")
    assert encode_entry(grown, B, memo).digest == encode_entry(grown, B).digest
    assert memo.prefix("r-1", PackedIds.of(sequence), B) == ()  # the list call replaced it


def test_pack_ids_takes_packed_ids_as_they_are() -> None:
    ids = PackedIds.of(IDS)
    assert pack_ids(ids) is ids.data and pack_ids(IDS) == ids.data
