"""Routed experts: their wire forms, their checks, and their blocks shared by prefix."""

from __future__ import annotations

import base64
import copy
import io
import json
import pickle

import numpy
import pytest

from capture.build.builder import run_builder
from capture.build.projection import project_call
from capture.codec.entries import decode_entries, encode_entry, read_body
from capture.codec.views import json_default
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry
from capture.routes import (
    Routes,
    routes_differ,
    routes_from_flat,
    routes_from_npy,
    routes_problem,
)
from capture.samples import training_samples
from tests.support.routes import EXPERTS, LAYERS, TOP_K, rollout, routes_for
from transports.rebuild.results import decode_result, encode_result


def test_the_wire_forms_read_back_to_the_same_routes() -> None:
    array = routes_for(list(range(30)))
    routes = Routes.from_array(array)
    assert routes.shape == (29, LAYERS, TOP_K)
    wire = json.loads(json.dumps(routes, default=json_default))
    decoded = numpy.frombuffer(base64.b64decode(wire["data"]), wire["dtype"]).reshape(wire["shape"])
    assert (decoded == array).all() and Routes.coerce(wire) == routes
    npy = io.BytesIO()
    numpy.save(npy, array.astype(numpy.uint8))  # vLLM sends uint8 below 256 experts
    assert routes_from_npy(base64.b64encode(npy.getvalue()).decode()) == routes
    flat = base64.b64encode(array.astype("<i4").tobytes()).decode()  # SGLang's int32
    assert routes_from_flat(flat, LAYERS, TOP_K) == routes
    with pytest.raises(ValueError, match="do not fill rows"):
        routes_from_flat(flat, LAYERS, 3)
    with pytest.raises(ValueError, match="not base64"):
        routes_from_npy("%%%")
    with pytest.raises(ValueError, match="got 2-D"):
        Routes.from_array([[1, 2]])
    with pytest.raises(ValueError, match="expert indices"):
        Routes.from_array(-numpy.ones((1, 1, 1), dtype=int))


def test_routes_must_cover_every_position_the_model_read_and_name_real_experts() -> None:
    routes = Routes.from_array(routes_for(list(range(30))))
    assert routes_problem(routes, 20, 10, EXPERTS) is None
    assert "29 rows for 20 prompt and 11 generated" in routes_problem(routes, 20, 11)
    assert "names expert" in routes_problem(routes, 20, 10, num_experts=8)


def test_an_entry_keeps_its_routes_through_the_codec() -> None:
    entries = rollout(3)
    encoded = [encode_entry(entry, block_size=16) for entry in entries]
    stored: dict[str, bytes] = {}
    for item in encoded:
        for name, data in item.plan(stored.keys(), {}).blocks:
            stored[name] = data
    decoded = decode_entries([item.body for item in encoded], stored, trusted=True, shared=True)
    for entry, back in zip(entries, decoded, strict=True):
        assert back.routed_experts == entry.routed_experts
        assert (back.routed_experts.to_numpy() == entry.routed_experts.to_numpy()).all()
    # Routes enter the payload digest: the same call with other routes is another payload.
    shifted = Routes.from_array(routes_for(entries[0].full_sequence) + 1)
    other = entries[0].model_copy(update={"routed_experts": shifted})
    assert encode_entry(other).digest != encode_entry(entries[0]).digest
    assert encode_entry(entries[0]).digest == encode_entry(entries[0], block_size=16).digest


def stored_bytes(entries: list[TokenEntry]) -> int:
    """What a store holds of the entries' blocks, put one after another."""
    stored: dict[str, bytes] = {}
    tails: dict[str, bytes] = {}
    for entry in entries:
        writes = encode_entry(entry).plan(stored.keys(), tails)
        stored.update(writes.blocks)
        tails.update(writes.tails)
    return sum(len(data) for data in stored.values())


def test_a_rollouts_routes_are_stored_about_once() -> None:
    """Each call's routes repeat the previous call's: stored, they grow with the final
    context, not with turns x context."""
    entries = rollout(30)
    without = [entry.model_copy(update={"routed_experts": None}) for entry in entries]
    routes_stored = stored_bytes(entries) - stored_bytes(without)
    last = entries[-1].routed_experts
    final = last.rows * last.row_bytes
    assert final <= routes_stored < 1.5 * final
    every_call = sum(e.routed_experts.rows * last.row_bytes for e in entries)
    assert every_call > 10 * final  # what storing each call's routes whole would take


async def test_the_file_store_delivers_each_calls_routes(tmp_path) -> None:
    store = FileTokenStore(tmp_path / "captures")
    entries = rollout(4)
    for entry in entries:
        await store.put(entry)
    snapshot = await store.freeze("r")
    await store.close()
    got = {entry.model_call_id: entry.routed_experts for entry in snapshot.entries}
    assert got == {entry.model_call_id: entry.routed_experts for entry in entries}
    assert not snapshot.incomplete


def test_the_results_stream_carries_routes_once_and_gives_them_back_exactly() -> None:
    """A rebuilt record's carriers each hold their call's routes; on the stream each
    stores only the rows after the previous carrier's, and decoding restores them."""
    entries = rollout(20)
    encoded = [encode_entry(entry) for entry in entries]
    stored: dict[str, bytes] = {}
    for item in encoded:
        stored.update(item.plan(stored.keys(), {}).blocks)
    decoded = decode_entries([item.body for item in encoded], stored, trusted=True, shared=True)
    output = [item for entry in decoded for item in project_call(entry)]
    record = {"_ng_rollout_id": "r", "response": {"output": output}}
    fields = encode_result(record, rollout_id="r", version=1)
    back = decode_result("1-0", fields)
    carriers = [i for i in back["response"]["output"] if "generation_token_ids" in i]
    assert [c["routed_experts"] for c in carriers] == [e.routed_experts for e in entries]
    last = entries[-1].routed_experts
    every_call = sum(e.routed_experts.rows for e in entries) * last.row_bytes
    assert len(fields["record"]) < last.rows * last.row_bytes + 12 * len(entries[-1].full_sequence)
    assert len(fields["record"]) < every_call / 5
    # Routes that do not continue the previous carrier's are sent whole, and come back.
    changed = Routes.from_array(entries[5].routed_experts.to_numpy() + 1)
    output[[i for i, o in enumerate(output) if "routed_experts" in o][5]]["routed_experts"] = (
        changed
    )
    back = decode_result("1-1", encode_result(record, rollout_id="r", version=2))
    carriers = [i for i in back["response"]["output"] if "generation_token_ids" in i]
    assert carriers[5]["routed_experts"] == changed
    assert carriers[6]["routed_experts"] == entries[6].routed_experts


async def test_a_rollout_with_routes_for_some_calls_only_is_masked(tmp_path) -> None:
    """Routes turned on while a rollout ran: no sample may replay routes that are missing
    for part of it."""
    store = FileTokenStore(tmp_path / "captures")
    entries = rollout(3)
    entries[0] = entries[0].model_copy(update={"routed_experts": None})
    for entry in entries:
        await store.put(entry)
    last = entries[-1].output_items or [{"type": "message", "role": "assistant", "content": []}]
    record = {"_ng_rollout_id": "r", "response": {"output": last}}
    built = await finalize_rollout_token_capture(record, store)
    await store.close()
    assert (
        built.masked and "routed experts captured for some calls only" in built.summary.mask_reasons
    )
    assert training_samples(record) == []


def test_decoded_routes_pickle_and_copy_as_their_rows() -> None:
    """A decoded rollout's routes are views of its blocks; a record that holds them still
    pickles and deep-copies (a trainer may ship it to another process)."""
    entries = rollout(4)
    encoded = [encode_entry(entry, block_size=16) for entry in entries]
    stored: dict[str, bytes] = {}
    for item in encoded:
        stored.update(item.plan(stored.keys(), {}).blocks)
    decoded = decode_entries([item.body for item in encoded], stored, trusted=True, shared=True)
    routes = decoded[-1].routed_experts
    assert any(isinstance(part, memoryview) for part in routes.parts)
    assert pickle.loads(pickle.dumps(routes)) == routes == copy.deepcopy(routes)
    assert pickle.loads(pickle.dumps(decoded[-1])).routed_experts == entries[-1].routed_experts
    with pytest.raises(TypeError):
        hash(routes)  # equal to arrays, which do not hash alike


def test_a_body_names_codec_3_only_when_it_holds_routes() -> None:
    """A reader from before routes reads a routeless body, and refuses one with routes
    instead of delivering it without them."""
    with_routes = rollout(1)[0]
    without = with_routes.model_copy(update={"routed_experts": None})
    assert read_body(encode_entry(with_routes).body)["codec"] == 3
    assert read_body(encode_entry(without).body)["codec"] == 2


def test_unreadable_npy_routes_are_a_value_error() -> None:
    for raw in (b"", b"PK\x03\x04 not a zip", b"\x93NUMPY garbage"):
        with pytest.raises(ValueError, match="not a .npy"):
            routes_from_npy(base64.b64encode(raw).decode())


def test_a_sample_has_no_routes_where_calls_disagree_on_their_prefix() -> None:
    """Each carrier keeps its call's own routes; one row per position would replay an
    earlier call's prefix as it was not routed, so the sample has none, and the metrics
    count the call."""
    entries = rollout(3)
    changed = entries[0].routed_experts.to_numpy().copy()
    changed[0, 0, 0] = (changed[0, 0, 0] + 1) % EXPERTS
    entries[0] = entries[0].model_copy(update={"routed_experts": Routes.from_array(changed)})
    build = run_builder(entries)
    record = {"_ng_rollout_id": "r", "response": {"output": list(build.output)}}
    [sample] = training_samples(record | {"_ng_token_capture": {}})
    assert sample.routed_experts is None
    assert routes_differ(e.routed_experts for e in entries) == 1
    assert routes_differ(e.routed_experts for e in rollout(3)) == 0


def test_segments_carry_their_routes_once_on_the_results_stream() -> None:
    entries = rollout(12)
    segment = {"role": "sub-agent", "output": [i for e in entries for i in project_call(e)]}
    record = {"_ng_rollout_id": "r", "response": {"output": []}, "_ng_token_segments": [segment]}
    fields = encode_result(record, rollout_id="r", version=1)
    last = entries[-1].routed_experts
    assert len(fields["record"]) < last.rows * last.row_bytes + 12 * len(entries[-1].full_sequence)
    back = decode_result("1-0", fields)
    carriers = [i for i in back["_ng_token_segments"][0]["output"] if "routed_experts" in i]
    assert all(isinstance(item["routed_experts"], Routes) for item in carriers)
    assert [item["routed_experts"] for item in carriers] == [e.routed_experts for e in entries]
