"""IdView: a decoded chain's calls share one id sequence, and still read like lists."""

from __future__ import annotations

import copy
import json
import pickle
from array import array

import numpy
import pytest

from capture.build.builder import run_builder
from capture.codec.entries import decode_entries, encode_entry
from capture.codec.views import IdView, as_list, json_default, shares_prefix
from tests.support.rollouts import growing_rollout


@pytest.mark.parametrize("kind", ["list", "array"])
def test_a_view_reads_like_the_list_of_its_range(kind: str):
    base = list(range(10)) if kind == "list" else array("I", range(10))
    view = IdView(base, 2, 7)
    want = list(base[2:7])
    assert len(view) == 5 and list(view) == want and view == want and want == view
    assert view[0] == 2 and view[-1] == 6 and view[1:3] == [3, 4] and view[::2] == want[::2]
    assert view[-2:] == [5, 6] and view[10:] == [] and type(view[:2]) is list
    assert view != [2, 3] and view != list(range(5)) and view.tolist() == want
    with pytest.raises(IndexError):
        view[5]
    with pytest.raises(ValueError):
        IdView(base, 3, 11)
    assert pickle.loads(pickle.dumps(view)) == want and copy.deepcopy(view) == want
    assert as_list(view) == want and type(as_list(view)) is list
    assert view + [99] == [*want, 99] and [0] + view == [0, *want]
    assert type(view + view) is list and view + view == want + want
    assert json.dumps({"ids": view}, default=json_default) == json.dumps({"ids": want})
    with pytest.raises(TypeError):
        json_default(object())
    assert (
        numpy.asarray(view).tolist() == want and numpy.asarray(view, dtype="int32").dtype == "int32"
    )
    assert type(view.tolist()) is list and type(view[1]) is int
    # A hashable key, equal for the same ids and different for others.
    assert hash(view.key()) == hash(IdView(base, 2, 7).key())
    assert view.key() == IdView(base, 2, 7).key() != IdView(base, 3, 8).key()
    if kind == "array":
        base.extend([10, 11])  # a numpy copy does not pin the base: it may still grow
        assert view == want


def test_views_of_one_chain_share_their_sequence_and_prove_prefixes():
    entries = growing_rollout("r", 6, system_tokens=300, generated_per_turn=20)
    encoded = [encode_entry(entry, 64) for entry in entries]
    blocks = dict(block for item in encoded for block in item.blocks)
    decoded = decode_entries([item.body for item in encoded], blocks, trusted=True, shared=True)
    for got, want in zip(decoded, entries, strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.generation_token_ids == want.generation_token_ids
        assert got.model_dump() == want.model_dump()
        assert type(got.model_dump()["prompt_token_ids"]) is list
    assert len({id(entry.prompt_token_ids.base) for entry in decoded}) == 1
    assert isinstance(decoded[0].prompt_token_ids.base, array)  # packed, no int per id
    first, second = decoded[0], decoded[1]
    assert shares_prefix(
        second.prompt_token_ids, first.prompt_token_ids, first.generation_token_ids
    )
    assert not shares_prefix(
        first.prompt_token_ids, second.prompt_token_ids, second.generation_token_ids
    )
    plain = decode_entries([item.body for item in encoded], blocks, trusted=True)
    assert all(type(entry.prompt_token_ids) is list for entry in plain)


def test_a_branch_gets_its_own_sequence_and_the_build_matches_plain_lists():
    trunk = growing_rollout("r", 4, system_tokens=300, generated_per_turn=20)
    branch = trunk[2].model_copy(
        update={"model_call_id": "branch", "generation_token_ids": [7] * 20, "created_at": 0.0}
    )
    entries = [*trunk, branch]
    encoded = [encode_entry(entry, 64) for entry in entries]
    blocks = dict(block for item in encoded for block in item.blocks)
    bodies = [item.body for item in encoded]
    shared = decode_entries(bodies, blocks, trusted=True, shared=True)
    assert [entry.full_sequence for entry in shared] == [e.full_sequence for e in entries]
    by_view, by_list = run_builder(shared), run_builder(entries)
    assert by_view.parents == by_list.parents and by_view.chains == by_list.chains
    assert by_view.output == by_list.output
    carriers = [item for item in by_view.output if "prompt_token_ids" in item]
    # The record shares the chain's sequence: views, not a list per call.
    assert all(type(item["prompt_token_ids"]) is IdView for item in carriers)
    assert len({id(item["prompt_token_ids"].base) for item in carriers}) == 1
    assert json.loads(json.dumps(by_view.output, default=json_default)) == json.loads(
        json.dumps(by_list.output)
    )
