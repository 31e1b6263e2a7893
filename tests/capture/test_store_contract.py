"""The store contract (sink and source), written once and run against every store kind.

Nothing here knows how a store keeps its data: only the async sink/source API is used.
"""

from __future__ import annotations

import asyncio

import pytest

from capture.errors import ConflictingEntryError, InvalidRolloutIdError, RolloutFrozenError
from capture.protocols import IntentSink, LineageSource, ReceiptSink, TokenSink, TokenSource

INSPECT_KEYS = {
    "rollout_id",
    "state",
    "calls",
    "pending_intents",
    "unreceived",
    "incomplete",
    "version",
    "snapshot_id",
    "prompt_tokens_max",
    "generated_tokens",
    "tombstone",
}


async def test_store_satisfies_the_protocols(store):
    assert isinstance(store, TokenSink)
    assert isinstance(store, TokenSource)
    assert isinstance(store, IntentSink)
    assert isinstance(store, ReceiptSink)


async def test_entries_round_trip_exactly_sorted_by_call_id(store, make_entry):
    shared = list(range(1000, 1600))  # longer than a block, so prompts share stored blocks
    entries = [
        make_entry(
            "rt",
            "c-2",
            prompt=shared + [5, 6],
            generation=[11, 12],
            log_probs=[-0.1, -1e-30],
            custom_field={"nested": [1, "x"]},
        ),
        make_entry("rt", "c-1", prompt=shared, generation=[3], log_probs=[-2.5]),
        make_entry("rt", "c-3", prompt=[], generation=[4, 4], routed_experts=[[1, 2], [3, 4]]),
        make_entry("rt", "c-0", prompt=shared + [5, 6, 11, 12, 9] * 60, generation=[]),
    ]
    for entry in entries:
        await store.put(entry)
    snapshot = await store.freeze("rt")
    assert snapshot.rollout_id == "rt"
    assert [e.model_call_id for e in snapshot.entries] == ["c-0", "c-1", "c-2", "c-3"]
    by_id = {e.model_call_id: e for e in entries}
    for got in snapshot.entries:
        want = by_id[got.model_call_id]
        assert got.model_dump() == want.model_dump()
    assert snapshot.entries[2].custom_field == {"nested": [1, "x"]}
    assert snapshot.entries[2].generation_log_probs == [-0.1, -1e-30]
    assert snapshot.incomplete is False
    assert snapshot.snapshot_id


async def test_put_accepts_a_mapping(store, make_entry):
    entry = make_entry("mapped", "c-1")
    await store.put(entry.model_dump())
    snapshot = await store.freeze("mapped")
    assert [e.model_dump() for e in snapshot.entries] == [entry.model_dump()]


async def test_same_call_same_payload_is_a_no_op(store, make_entry):
    entry = make_entry("idem", "c-1")
    await store.put(entry)
    version = (await store.inspect("idem"))["version"]
    retry = entry.model_copy(update={"created_at": entry.created_at + 5})
    await store.put(retry)
    await store.put(entry)
    assert (await store.inspect("idem"))["version"] == version
    snapshot = await store.freeze("idem")
    assert len(snapshot.entries) == 1
    assert snapshot.entries[0].created_at == entry.created_at
    assert snapshot.incomplete is False


async def test_conflicting_payload_fails_closed_and_marks_incomplete(store, make_entry):
    first = make_entry("conflict", "c-1", generation=[1, 2])
    await store.put(first)
    with pytest.raises(ConflictingEntryError):
        await store.put(make_entry("conflict", "c-1", generation=[1, 3]))
    assert (await store.inspect("conflict"))["incomplete"] is True
    snapshot = await store.freeze("conflict")
    assert snapshot.incomplete is True
    assert [e.model_dump() for e in snapshot.entries] == [first.model_dump()]


async def test_writes_after_freeze_fail(store, make_entry):
    await store.put(make_entry("frozen", "c-1"))
    snapshot = await store.freeze("frozen")
    with pytest.raises(RolloutFrozenError):
        await store.put(make_entry("frozen", "c-2"))
    with pytest.raises(RolloutFrozenError):  # even a retry of a stored call
        await store.put(snapshot.entries[0])
    with pytest.raises(RolloutFrozenError):
        await store.begin_call("frozen", "c-3")
    again = await store.freeze("frozen")
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)
    assert len(again.entries) == 1


async def test_freeze_is_idempotent_while_nothing_changes(store, make_entry):
    await store.put(make_entry("idem-freeze", "c-1"))
    first = await store.freeze("idem-freeze")
    second = await store.freeze("idem-freeze")
    assert first.snapshot_id and first.snapshot_id == second.snapshot_id
    assert first.version == second.version
    assert first.entries == second.entries


async def test_intent_without_entry_makes_the_snapshot_incomplete(store, make_entry):
    await store.begin_call("intent", "c-1")
    await store.put(make_entry("intent", "c-2"))
    await store.begin_call("intent", "c-2")  # an intent for a stored call is already resolved
    assert (await store.inspect("intent"))["pending_intents"] == 1
    snapshot = await store.freeze("intent")
    assert snapshot.incomplete is True
    assert [e.model_call_id for e in snapshot.entries] == ["c-2"]


async def test_every_store_gives_its_reasons_in_the_same_words(store, make_entry):
    await store.put(make_entry("why", "c-1", generation=[1, 2]))
    with pytest.raises(ConflictingEntryError):
        await store.put(make_entry("why", "c-1", generation=[1, 3]))
    await store.mark_incomplete("why", "c-2")
    await store.mark_incomplete("why")
    await store.begin_call("why", "c-3")
    snapshot = await store.freeze("why")
    # The order of marked losses is the store's own; the words are shared.
    assert sorted(snapshot.incomplete_reasons) == [
        "call (rollout): marked incomplete",
        "call c-1: conflicting payload",
        "call c-2: marked incomplete",
        "call c-3: intent without entry",
    ]
    await store.drop("why", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    retired = await store.freeze("why")
    assert retired.incomplete_reasons[-1] == "rollout retired: its entries were dropped"


async def test_intent_resolved_by_its_entry_or_by_void(store, make_entry):
    await store.begin_call("resolved", "c-1")
    await store.put(make_entry("resolved", "c-1"))
    await store.begin_call("resolved", "c-2")
    await store.void_call("resolved", "c-2")
    await store.void_call("resolved", "never-begun")  # nothing to resolve: harmless
    info = await store.inspect("resolved")
    assert info["pending_intents"] == 0
    snapshot = await store.freeze("resolved")
    assert snapshot.incomplete is False
    assert [e.model_call_id for e in snapshot.entries] == ["c-1"]


async def test_mark_incomplete_on_an_open_rollout(store, make_entry):
    await store.put(make_entry("lost", "c-1"))
    await store.mark_incomplete("lost", "c-2")
    snapshot = await store.freeze("lost")
    assert snapshot.incomplete is True
    assert len(snapshot.entries) == 1


async def test_mark_incomplete_after_freeze_advances_the_version(store, make_entry):
    await store.put(make_entry("late-loss", "c-1"))
    snapshot = await store.freeze("late-loss")
    assert snapshot.incomplete is False
    await store.mark_incomplete("late-loss", "c-2")
    assert (
        await store.drop("late-loss", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        is False
    )
    again = await store.freeze("late-loss")
    assert again.snapshot_id == snapshot.snapshot_id
    assert again.version > snapshot.version
    assert again.incomplete is True
    assert (
        await store.drop("late-loss", snapshot_id=again.snapshot_id, version=again.version) is True
    )


async def test_every_state_change_advances_the_version(store, make_entry):
    versions = [(await store.inspect("ver"))["version"]]
    await store.put(make_entry("ver", "c-1"))
    versions.append((await store.inspect("ver"))["version"])
    await store.begin_call("ver", "c-2")
    versions.append((await store.inspect("ver"))["version"])
    await store.void_call("ver", "c-2")
    versions.append((await store.inspect("ver"))["version"])
    await store.mark_incomplete("ver")
    versions.append((await store.inspect("ver"))["version"])
    snapshot = await store.freeze("ver")
    versions.append(snapshot.version)
    assert versions == sorted(set(versions)), versions


async def test_unknown_rollout_freezes_empty_and_blocks_writers(store, make_entry):
    snapshot = await store.freeze("never-written")
    assert snapshot.entries == ()
    assert snapshot.incomplete is False
    assert snapshot.snapshot_id
    with pytest.raises(RolloutFrozenError):
        await store.put(make_entry("never-written", "c-1"))
    assert (await store.inspect("never-written"))["state"] == "frozen"


async def test_drop_leaves_a_tombstone_that_blocks_late_writers(store, make_entry):
    await store.put(make_entry("dropped", "c-1"))
    snapshot = await store.freeze("dropped")
    assert (
        await store.drop("dropped", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        is True
    )
    info = await store.inspect("dropped")
    assert info["state"] == "retired" and info["tombstone"] is True
    assert info["calls"] == 0
    assert (info["snapshot_id"], info["version"]) == (snapshot.snapshot_id, snapshot.version)
    with pytest.raises(RolloutFrozenError):
        await store.put(make_entry("dropped", "c-2"))
    with pytest.raises(RolloutFrozenError):
        await store.begin_call("dropped", "c-3")
    # Dropping the same snapshot again is a success; its data is gone either way.
    assert (
        await store.drop("dropped", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        is True
    )
    after = await store.freeze("dropped")
    assert after.entries == ()
    assert after.snapshot_id == snapshot.snapshot_id
    assert after.incomplete is True  # a retired rollout can no longer be rebuilt


async def test_drop_of_another_snapshot_returns_false(store, make_entry):
    await store.put(make_entry("guarded", "c-1"))
    assert await store.drop("guarded", snapshot_id="0" * 32, version=1) is False  # not frozen
    snapshot = await store.freeze("guarded")
    assert (
        await store.drop("guarded", snapshot_id=snapshot.snapshot_id, version=snapshot.version + 1)
        is False
    )
    assert await store.drop("guarded", snapshot_id="f" * 32, version=snapshot.version) is False
    assert (
        await store.drop(
            "absent-rollout", snapshot_id=snapshot.snapshot_id, version=snapshot.version
        )
        is False
    )
    assert (await store.inspect("absent-rollout"))["state"] == "absent"
    again = await store.freeze("guarded")
    assert len(again.entries) == 1


async def test_delete_removes_everything(store, make_entry):
    await store.put(make_entry("deleted", "c-1"))
    snapshot = await store.freeze("deleted")
    await store.drop("deleted", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    await store.delete("deleted")
    await store.delete("deleted")  # idempotent
    info = await store.inspect("deleted")
    assert info["state"] == "absent" and info["tombstone"] is False
    entry = make_entry("deleted", "c-9")
    await store.put(entry)  # a fresh rollout under the same id
    fresh = await store.freeze("deleted")
    assert [e.model_call_id for e in fresh.entries] == ["c-9"]
    assert fresh.snapshot_id != snapshot.snapshot_id


async def test_sweep_tombstones_by_age(store, make_entry):
    for rollout_id in ("sweep-a", "sweep-b"):
        await store.put(make_entry(rollout_id, "c-1"))
        snapshot = await store.freeze(rollout_id)
        await store.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    await store.put(make_entry("sweep-open", "c-1"))
    await store.freeze("sweep-frozen")
    assert await store.sweep_tombstones(older_than_s=3600) == 0
    assert await store.sweep_tombstones() == 0  # default retention is far longer
    assert await store.sweep_tombstones(older_than_s=0) == 2
    assert (await store.inspect("sweep-a"))["state"] == "absent"
    assert (await store.inspect("sweep-b"))["state"] == "absent"
    assert (await store.inspect("sweep-open"))["state"] == "open"
    assert (await store.inspect("sweep-frozen"))["state"] == "frozen"


async def test_inspect_summarizes_without_changing(store, make_entry):
    absent = await store.inspect("inspected")
    assert INSPECT_KEYS <= absent.keys()
    assert absent["state"] == "absent" and absent["version"] == 0 and absent["calls"] == 0
    await store.put(make_entry("inspected", "c-1", prompt=list(range(50)), generation=[1, 2]))
    await store.put(make_entry("inspected", "c-2", prompt=list(range(70)), generation=[3]))
    await store.begin_call("inspected", "c-3")
    info = await store.inspect("inspected")
    assert info["rollout_id"] == "inspected"
    assert info["state"] == "open"
    assert info["calls"] == 2
    assert info["pending_intents"] == 1
    assert info["incomplete"] is False
    assert info["prompt_tokens_max"] == 70
    assert info["generated_tokens"] == 3
    assert info["snapshot_id"] == "" and info["tombstone"] is False
    assert await store.inspect("inspected") == info
    snapshot = await store.freeze("inspected")
    frozen = await store.inspect("inspected")
    assert frozen["state"] == "frozen"
    assert (frozen["snapshot_id"], frozen["version"]) == (snapshot.snapshot_id, snapshot.version)


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", "", ".hidden", "-dash", "x\n", "a b"])
async def test_invalid_rollout_ids_are_rejected(store, make_entry, bad_id):
    with pytest.raises(InvalidRolloutIdError):
        await store.put(make_entry(bad_id, "c-1"))
    with pytest.raises(InvalidRolloutIdError):
        await store.mark_incomplete(bad_id, "c-1")
    with pytest.raises(InvalidRolloutIdError):
        await store.begin_call(bad_id, "c-1")
    with pytest.raises(InvalidRolloutIdError):
        await store.freeze(bad_id)
    with pytest.raises(InvalidRolloutIdError):
        await store.drop(bad_id, snapshot_id="x", version=1)
    with pytest.raises(InvalidRolloutIdError):
        await store.delete(bad_id)


async def test_puts_racing_a_freeze(store, make_entry):
    """Every put that returned is in the snapshot; every other one saw the freeze."""
    rollout_id = "race"
    entries = [
        make_entry(rollout_id, f"c-{i:03d}", prompt=list(range(i % 7 * 100))) for i in range(60)
    ]

    async def put(entry):
        await asyncio.sleep(0.001 * (int(entry.model_call_id[2:]) % 10))
        await store.put(entry)
        return entry.model_call_id

    async def freeze_midway():
        await asyncio.sleep(0.004)
        return await store.freeze(rollout_id)

    *outcomes, snapshot = await asyncio.gather(
        *(put(entry) for entry in entries), freeze_midway(), return_exceptions=True
    )
    assert not isinstance(snapshot, BaseException), snapshot
    acknowledged = {outcome for outcome in outcomes if isinstance(outcome, str)}
    refused = [outcome for outcome in outcomes if not isinstance(outcome, str)]
    assert all(isinstance(error, RolloutFrozenError) for error in refused), refused
    assert acknowledged == {entry.model_call_id for entry in snapshot.entries}
    assert len(acknowledged) + len(refused) == len(entries)
    assert (
        await store.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        is True
    )


async def test_losses_racing_a_freeze_are_never_missed(store, make_entry):
    """A mark_incomplete racing freeze is in the snapshot or makes its drop fail."""
    rollout_id = "race-loss"
    await store.put(make_entry(rollout_id, "c-0"))

    async def lose(i):
        await asyncio.sleep(0.001 * i)
        await store.mark_incomplete(rollout_id, f"lost-{i}")

    results = await asyncio.gather(*(lose(i) for i in range(6)), store.freeze(rollout_id))
    snapshot = results[-1]
    dropped = await store.drop(
        rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version
    )
    assert snapshot.incomplete or not dropped
    assert not dropped or (await store.inspect(rollout_id))["state"] == "retired"


async def test_close_is_idempotent(store):
    await store.close()
    await store.close()


async def test_void_after_freeze(store, make_entry):
    await store.begin_call("void-late", "c-1")
    await store.put(make_entry("void-late", "c-2"))
    snapshot = await store.freeze("void-late")
    with pytest.raises(RolloutFrozenError):  # the snapshot already counted it as lost
        await store.void_call("void-late", "c-1")
    again = await store.freeze("void-late")
    assert (again.version, again.incomplete) == (snapshot.version, True)


async def test_unreceived_resolves_the_intent_and_is_in_the_snapshot(store, make_entry):
    await store.begin_call("receipt", "c-1")
    await store.put(make_entry("receipt", "c-1"))
    await store.begin_call("receipt", "c-2")  # its reply never reached the harness
    await store.mark_unreceived("receipt", "c-2")
    await store.mark_unreceived("receipt", "c-1")  # an entry can be unreceived too
    await store.mark_unreceived("receipt", "c-1")  # idempotent
    info = await store.inspect("receipt")
    assert (info["pending_intents"], info["unreceived"]) == (0, 2)
    snapshot = await store.freeze("receipt")
    assert snapshot.incomplete is False
    assert snapshot.unreceived == ("c-1", "c-2")
    assert [e.model_call_id for e in snapshot.entries] == ["c-1"]


async def test_unreceived_before_the_put_still_covers_the_entry(store, make_entry):
    # The front end gave up waiting for a put that later landed: the mark came first.
    await store.mark_unreceived("late-put", "c-1")
    await store.put(make_entry("late-put", "c-1"))
    snapshot = await store.freeze("late-put")
    assert snapshot.unreceived == ("c-1",)
    assert [e.model_call_id for e in snapshot.entries] == ["c-1"]


async def test_unreceived_after_freeze_is_refused(store, make_entry):
    await store.put(make_entry("receipt-late", "c-1"))
    snapshot = await store.freeze("receipt-late")
    with pytest.raises(RolloutFrozenError):
        await store.mark_unreceived("receipt-late", "c-1")
    again = await store.freeze("receipt-late")
    assert (again.version, again.unreceived) == (snapshot.version, ())


async def test_a_running_rollouts_call_is_found_by_a_lineage_key(store, make_entry):
    """Faithful prompts continue a call any worker stored: the store finds it by its key."""
    assert isinstance(store, LineageSource)
    shared = list(range(2000, 2700))  # several blocks, shared with the second call
    first = make_entry(
        "ln",
        "c-1",
        prompt=shared,
        generation=[7, 8],
        log_probs=[-0.5, -0.25],
        lineage_keys=["k-one", "k-one-bare"],
    )
    second = make_entry(
        "ln",
        "c-2",
        prompt=shared + [7, 8, 9],
        generation=[10],
        log_probs=[-1.0],
        lineage_keys=["k-two"],
    )
    assert await store.find_call("ln", "k-one") is None  # nothing stored yet
    await store.put(first)
    await store.put(second)
    for key, want in (("k-one", first), ("k-one-bare", first), ("k-two", second)):
        found = await store.find_call("ln", key)
        assert found is not None and found.model_call_id == want.model_call_id
        assert found.prompt_token_ids == want.prompt_token_ids
        assert found.generation_token_ids == want.generation_token_ids
    assert await store.find_call("ln", "k-none") is None
    assert await store.find_call("unknown-rollout", "k-one") is None


async def test_peek_reads_the_stored_entries_without_freezing(store, make_entry):
    """``tokcap inspect`` lists a running rollout's calls: peek reads them, changes nothing."""
    assert await store.peek("peeked") == []  # an unknown rollout has no entries
    shared = list(range(3000, 3700))  # several blocks, shared with the second call
    second = make_entry("peeked", "c-2", prompt=shared + [7, 8, 9], generation=[10])
    first = make_entry("peeked", "c-1", prompt=shared, generation=[7, 8])
    for entry in (second, first):
        await store.put(entry)
    before = await store.inspect("peeked")
    peeked = await store.peek("peeked")
    assert [e.model_dump() for e in peeked] == [first.model_dump(), second.model_dump()]
    assert await store.inspect("peeked") == before  # still open, same version
    await store.put(make_entry("peeked", "c-3"))  # not frozen: a later put still succeeds
    snapshot = await store.freeze("peeked")
    assert [e.model_call_id for e in await store.peek("peeked")] == ["c-1", "c-2", "c-3"]
    assert await store.drop("peeked", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    assert await store.peek("peeked") == []  # retired: its entries were dropped


async def test_a_store_is_an_async_context_manager_that_closes_itself(store, make_entry):
    async with store as same:
        assert same is store
        await store.put(make_entry("ctx", "c-1", prompt=[1, 2], generation=[3], log_probs=[-1.0]))
    with pytest.raises(Exception, match="closed"):
        await store.put(make_entry("ctx", "c-2", prompt=[1, 2], generation=[4], log_probs=[-1.0]))
