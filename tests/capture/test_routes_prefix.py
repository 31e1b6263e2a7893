"""Routes that continue a stored prefix (``ChainedRoutes``), on every store.

The front end names the prefix a rollout already stored and hands only the new rows; what a
store keeps must be exactly what whole routes would have left: the same blocks, the same
payload digest, the same routes read back. A prefix the rollout does not hold fails the put
for good, and the capture step turns that into a lost call.
"""

from __future__ import annotations

from typing import Any

import pytest

from capture.codec.entries import DEFAULT_BLOCK_SIZE, encode_entry
from capture.codec.route_blocks import ChainedRoutes, reusable_prefix
from capture.errors import RoutesPrefixError
from capture.protocols import chained_routes_block_size
from capture.records import TokenEntry
from capture.routes import RouteChain, Routes
from tests.support.routes import rollout

BLOCK = 16  # small blocks, so a short rollout spans many


def chained(entries: list[TokenEntry], block_size: int) -> list[TokenEntry]:
    """The rollout's entries as the front end hands them: each call's routes continue the
    previous call's stored chain over the ids they share, whole blocks only."""
    out: list[TokenEntry] = []
    chain: RouteChain | None = None
    previous: list[int] = []
    for entry in entries:
        whole = entry.routed_experts
        prompt = list(entry.prompt_token_ids)
        common = len(previous) if prompt[: len(previous)] == previous else 0
        prefix = reusable_prefix(chain, common, len(prompt) - 1)
        rest = whole.rows_from(len(prefix) * block_size)
        routes = ChainedRoutes(rest, block_size, prefix)
        chain = routes.chain
        previous = prompt + list(entry.generation_token_ids)
        out.append(entry.model_copy(update={"routed_experts": routes}))
    return out


def test_chained_routes_encode_to_the_blocks_and_digest_of_whole_routes() -> None:
    for block_size in (BLOCK, DEFAULT_BLOCK_SIZE):
        entries = rollout(8, per_turn=60)
        for whole, part in zip(entries, chained(entries, block_size), strict=True):
            a, b = encode_entry(whole, block_size), encode_entry(part, block_size)
            # At another size than the default, a prefix's tip names its size instead.
            prefixed = bool(part.routed_experts.prefix)
            assert (a.digest == b.digest) is (block_size == DEFAULT_BLOCK_SIZE or not prefixed)
            assert a.body == b.body
            stored = {block.name: block.data for block in a.routes}
            assert all(stored[block.name] == block.data for block in b.routes)
            assert b.requires == part.routed_experts.prefix[-1:]
    # Later calls hash only the rows after their prefix.
    last = chained(entries, BLOCK)[-1].routed_experts
    assert last.prefix and last.rest.rows < last.rows


def test_a_prefix_ends_at_a_whole_block_of_the_ids_both_calls_share() -> None:
    chain = RouteChain(tuple(f"{n:032x}" for n in range(5)), 10, 45)
    assert len(reusable_prefix(chain, 1000, 1000)) == 4  # the fifth block is partial
    assert len(reusable_prefix(chain, 29, 1000)) == 2
    assert len(reusable_prefix(chain, 1000, 9)) == 0
    assert reusable_prefix(None, 1000, 1000) == ()


def test_our_stores_say_they_take_chained_routes() -> None:
    class Other:
        block_size = 16

    assert chained_routes_block_size(Other()) is None


async def test_a_rollout_of_chained_routes_reads_back_as_whole_routes(store: Any) -> None:
    assert chained_routes_block_size(store) == store.block_size
    entries = rollout(10, per_turn=50, rollout_id="chained")
    parts = chained(entries, store.block_size)
    for entry in parts:
        await store.put(entry)
    snapshot = await store.freeze("chained")
    assert not snapshot.incomplete
    got = {entry.model_call_id: entry.routed_experts for entry in snapshot.entries}
    for entry, part in zip(entries, parts, strict=True):
        routes = got[entry.model_call_id]
        assert routes == entry.routed_experts
        # Read back, they name the same blocks: a front end that finds the call in the
        # store continues them as one that served it does.
        assert routes.chain == part.routed_experts.chain


async def test_the_same_call_put_whole_then_chained_is_one_payload(store: Any) -> None:
    entries = rollout(3, per_turn=40, rollout_id="same")
    parts = chained(entries, store.block_size)
    for entry in entries:
        await store.put(entry)
    for entry in parts:
        await store.put(entry)  # the same payload: a no-op, not a conflict
    snapshot = await store.freeze("same")
    assert not snapshot.incomplete and len(snapshot.entries) == 3


async def test_routes_that_continue_a_prefix_the_rollout_lacks_are_refused(store: Any) -> None:
    entries = chained(rollout(4, per_turn=200, rollout_id="src"), store.block_size)
    assert entries[2].routed_experts.prefix  # it continues one
    await store.put(entries[0])
    moved = [entry.model_copy(update={"rollout_id": "elsewhere"}) for entry in entries]
    # Another rollout never holds this prefix: its put fails, nothing is stored.
    await store.put(moved[0].model_copy(update={"model_call_id": "first"}))
    with pytest.raises(RoutesPrefixError, match="does not hold"):
        await store.put(entries[2].model_copy(update={"rollout_id": "elsewhere"}))
    snapshot = await store.freeze("elsewhere")
    assert [entry.model_call_id for entry in snapshot.entries] == ["first"]


async def test_a_chained_entry_at_another_block_size_is_refused(store: Any) -> None:
    entries = chained(rollout(3, per_turn=200, rollout_id="sizes"), store.block_size + 1)
    assert entries[1].routed_experts.prefix
    await store.put(entries[0])  # no prefix: cut again at the store's size
    with pytest.raises(RoutesPrefixError, match="this store cuts"):
        await store.put(entries[1])


def test_chained_routes_keep_their_shape() -> None:
    rest = Routes((bytes(4 * 2 * 2 * 3),), 3, 4, 2)
    routes = ChainedRoutes(rest, 4, ("ab" * 16, "cd" * 16))
    assert routes.shape == (11, 4, 2) and routes.chain.rows == 11
    assert routes.chain.names[:2] == ("ab" * 16, "cd" * 16)
