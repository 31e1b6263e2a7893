"""The capture context of one call, on the real file store.

Capture never fails the model call: a response without ids, an extraction error or a failed
put marks the rollout incomplete through the sink instead.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from capture.context import (
    begin_call,
    capture_call,
    capture_tokens,
    current_call,
    mark_unreceived,
    resolve_unserved,
    void_call,
)
from capture.errors import RolloutFrozenError
from capture.filestore.store import FileTokenStore
from capture.records import ACKED_BEFORE_FIELD, TokenEntry


def served(prompt, generation, text="ok"):
    """A Responses-shaped served response carrying the ids on its message item."""
    return {
        "model": "policy",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
                "prompt_token_ids": list(prompt),
                "generation_token_ids": list(generation),
                "generation_log_probs": [-0.5] * len(generation),
            }
        ],
    }


@pytest.fixture
async def store(tmp_path):
    store = FileTokenStore(tmp_path / "captures")
    yield store
    await store.close()


class FailingPutSink:
    """A sink whose put always fails (say, a full disk); lost calls reach the real store."""

    def __init__(self, store: FileTokenStore) -> None:
        self.store = store
        self.puts = 0

    async def put(self, entry):
        self.puts += 1
        raise OSError(28, "No space left on device")

    async def mark_incomplete(self, rollout_id, model_call_id=""):
        await self.store.mark_incomplete(rollout_id, model_call_id)

    async def close(self):
        return None


class BrokenSink:
    """A sink that fails at everything, including marking a loss."""

    async def put(self, entry):
        raise ConnectionError("store unreachable")

    async def mark_incomplete(self, rollout_id, model_call_id=""):
        raise ConnectionError("store unreachable")

    async def begin_call(self, rollout_id, model_call_id):
        raise ConnectionError("store unreachable")

    async def void_call(self, rollout_id, model_call_id):
        raise ConnectionError("store unreachable")

    async def close(self):
        return None


class NoIntentSink:
    """A sink without the optional intent extension, forwarding to the real store."""

    def __init__(self, store: FileTokenStore) -> None:
        self.store = store

    async def put(self, entry):
        await self.store.put(entry)

    async def mark_incomplete(self, rollout_id, model_call_id=""):
        await self.store.mark_incomplete(rollout_id, model_call_id)

    async def close(self):
        return None


async def test_untagged_traffic_does_nothing(store):
    assert current_call() is None
    assert await capture_tokens(served([1, 2], [3])) is None
    await begin_call()
    await void_call()
    assert await store.rollouts() == []


async def test_capture_puts_the_entry(store):
    async with capture_call("7-0", store, model_call_id="call-1") as call:
        assert current_call() is call
        entry = await capture_tokens(served([1, 2, 3], [4, 5], text="hello"))
    assert current_call() is None
    assert entry is not None and call.entry is entry and call.done
    assert entry.rollout_id == "7-0" and entry.model_call_id == "call-1"
    snapshot = await store.freeze("7-0")
    assert not snapshot.incomplete
    assert [e.model_call_id for e in snapshot.entries] == ["call-1"]
    stored = snapshot.entries[0]
    assert stored.prompt_token_ids == [1, 2, 3] and stored.generation_token_ids == [4, 5]
    assert stored.output_items[0]["content"][0]["text"] == "hello"


async def test_fresh_call_ids_and_extra_fields(store):
    async with capture_call("7-1", store) as first:
        await capture_tokens(served([1], [2]), dialect="messages")
    async with capture_call("7-1", store) as second:
        await capture_tokens(served([1, 2, 9], [3]))
    assert first.model_call_id != second.model_call_id
    assert first.model_call_id.startswith("call-")
    snapshot = await store.freeze("7-1")
    assert len(snapshot.entries) == 2
    by_id = {e.model_call_id: e for e in snapshot.entries}
    first_extra = dict(by_id[first.model_call_id].model_extra or {})
    worker = first_extra.pop(ACKED_BEFORE_FIELD)["worker"]
    assert first_extra == {"dialect": "messages"}
    # Each put is stamped with the rollout's puts this process stored before it.
    assert by_id[second.model_call_id].model_extra[ACKED_BEFORE_FIELD] == {
        "worker": worker,
        "count": 1,
    }


async def test_second_capture_in_one_call_is_a_no_op(store):
    async with capture_call("7-2", store, model_call_id="c") as call:
        first = await capture_tokens(served([1], [2]))
        again = await capture_tokens(served([1], [99]))
    assert again is first is call.entry
    snapshot = await store.freeze("7-2")
    assert [e.generation_token_ids for e in snapshot.entries] == [[2]]


async def test_response_without_ids_marks_incomplete(store):
    async with capture_call("8-0", store) as call:
        result = await capture_tokens({"output": [{"type": "message", "content": []}]})
    assert result is None
    assert call.incomplete and "no usable token ids" in call.error
    snapshot = await store.freeze("8-0")
    assert snapshot.incomplete and snapshot.entries == ()


async def test_extraction_error_marks_incomplete(store):
    response = served([1], [2])
    response["output"].append(dict(response["output"][0]))  # two carriers
    async with capture_call("8-1", store) as call:
        assert await capture_tokens(response) is None
    assert call.incomplete
    assert (await store.freeze("8-1")).incomplete


async def test_failed_put_is_retried_then_marks_incomplete_and_never_raises(store):
    sink = FailingPutSink(store)
    async with capture_call("8-2", sink, model_call_id="c", timeout_s=0.4) as call:
        assert await capture_tokens(served([1], [2])) is None
    assert sink.puts >= 2  # retried for the put phase, then once per loss attempt
    assert call.incomplete and not call.unrecorded and "OSError" in call.error
    snapshot = await store.freeze("8-2")
    assert snapshot.incomplete and snapshot.entries == ()


async def test_only_puts_the_sink_acknowledged_count_toward_the_next_stamp(store):
    """A put that failed is no call the store lost: the next entry does not count it."""
    async with capture_call("8-9", FailingPutSink(store), timeout_s=0.2):
        assert await capture_tokens(served([1], [2])) is None
    async with capture_call("8-9", store):
        kept = await capture_tokens(served([1, 2, 9], [3]))
    assert kept is not None and kept.model_extra[ACKED_BEFORE_FIELD]["count"] == 0


async def test_a_sink_that_cannot_record_even_the_loss_leaves_the_call_unrecorded():
    sink = BrokenSink()
    started = time.monotonic()
    async with capture_call("8-3", sink, timeout_s=0.3) as call:
        await begin_call()
        assert await capture_tokens(served([1], [2])) is None
        await void_call()  # done already: nothing more to try
    assert time.monotonic() - started < 2.0
    assert call.unrecorded and not call.incomplete and not call.intent_recorded
    assert call.entry is None and not call.voided


class FlakySink:
    """The real store behind a connection that drops the first ``failures`` writes."""

    def __init__(self, store: FileTokenStore, failures: int, stall_s: float = 0.0) -> None:
        self.store = store
        self.failures = failures
        self.stall_s = stall_s
        self.calls = 0

    async def _outage(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            if self.stall_s:
                await asyncio.sleep(self.stall_s)  # a stopped server: no answer at all
            raise ConnectionError("connection reset by peer")

    async def put(self, entry):
        await self._outage()
        await self.store.put(entry)

    async def mark_incomplete(self, rollout_id, model_call_id=""):
        await self._outage()
        await self.store.mark_incomplete(rollout_id, model_call_id)

    async def mark_unreceived(self, rollout_id, model_call_id):
        await self._outage()
        await self.store.mark_unreceived(rollout_id, model_call_id)

    async def close(self):
        return None


async def test_a_put_that_fails_a_few_times_is_retried_until_it_lands(store):
    sink = FlakySink(store, failures=3)
    async with capture_call("8-5", sink, timeout_s=5) as call:
        entry = await capture_tokens(served([1], [2]))
    assert entry is not None and call.entry is entry and not call.incomplete
    snapshot = await store.freeze("8-5")
    assert not snapshot.incomplete and len(snapshot.entries) == 1


async def test_a_store_back_after_the_put_phase_still_gets_the_entry_not_a_loss(store):
    """Out for 70% of the window: past PUT_SHARE, each loss attempt tries the put first."""

    class OutUntil(FlakySink):
        async def _outage(self) -> None:
            self.calls += 1
            if time.monotonic() < back_at:
                raise ConnectionError("connection refused")

    back_at = time.monotonic() + 0.7
    async with capture_call("8-10", OutUntil(store, failures=0), timeout_s=1.0) as call:
        entry = await capture_tokens(served([1], [2]))
    assert time.monotonic() > back_at, "the put phase alone did not outlast the outage"
    assert entry is not None and call.entry is entry
    assert not call.incomplete and not call.unrecorded
    snapshot = await store.freeze("8-10")
    assert not snapshot.incomplete and len(snapshot.entries) == 1


async def test_a_stalled_sink_is_cut_at_the_deadline(store):
    sink = FlakySink(store, failures=100, stall_s=30)
    started = time.monotonic()
    async with capture_call("8-6", sink, timeout_s=0.5) as call:
        assert await capture_tokens(served([1], [2])) is None
    assert time.monotonic() - started < 2.0
    assert call.unrecorded


async def test_a_failed_intent_loses_nothing_when_the_entry_lands(store):
    class IntentFails(FlakySink):
        async def begin_call(self, rollout_id, model_call_id):
            raise ConnectionError("store unreachable")

    async with capture_call("8-7", IntentFails(store, failures=0)) as call:
        await begin_call()
        assert not call.intent_recorded and not call.incomplete
        assert await capture_tokens(served([1], [2])) is not None
    snapshot = await store.freeze("8-7")
    assert not snapshot.incomplete and len(snapshot.entries) == 1


async def test_an_unreceived_reply_is_noted_and_after_freeze_is_a_loss(store):
    async with capture_call("8-8", store, model_call_id="c") as call:
        await begin_call()
        await capture_tokens(served([1], [2]))
        await mark_unreceived("the client disconnected")
    snapshot = await store.freeze("8-8")
    assert snapshot.unreceived == ("c",) and not snapshot.incomplete
    async with capture_call("8-8", store, model_call_id="c") as call:
        await mark_unreceived("the client disconnected")
    assert call.incomplete and "after the rollout was frozen" in call.error
    assert (await store.freeze("8-8")).incomplete


async def test_an_unserved_call_is_noted_in_the_background_once_the_sink_is_back(store):
    sink = FlakySink(store, failures=4)
    async with capture_call("8-9", sink, model_call_id="c"):
        resolve_unserved("answered 503")
    for _ in range(200):
        if (await store.inspect("8-9"))["unreceived"]:
            break
        await asyncio.sleep(0.02)
    assert (await store.freeze("8-9")).unreceived == ("c",)
    assert sink.calls == 5


async def test_put_after_freeze_marks_incomplete(store):
    await store.freeze("8-4")
    async with capture_call("8-4", store) as call:
        assert await capture_tokens(served([1], [2])) is None
    assert call.incomplete and "RolloutFrozenError" in call.error
    info = await store.inspect("8-4")
    assert info["incomplete"] is True and info["calls"] == 0


async def test_intent_then_entry_is_complete(store):
    async with capture_call("9-0", store, model_call_id="c") as call:
        await begin_call()
        assert call.intent_recorded
        assert (await store.inspect("9-0"))["pending_intents"] == 1
        await capture_tokens(served([1], [2]))
    snapshot = await store.freeze("9-0")
    assert not snapshot.incomplete and len(snapshot.entries) == 1


async def test_intent_without_entry_makes_the_snapshot_incomplete(store):
    async with capture_call("9-1", store, model_call_id="lost") as call:
        await begin_call()
        # The server died before the reply: nothing captured, nothing voided.
    assert call.intent_recorded and not call.done
    snapshot = await store.freeze("9-1")
    assert snapshot.incomplete and snapshot.entries == ()


async def test_void_call_resolves_the_intent(store):
    async with capture_call("9-2", store, model_call_id="cancelled") as call:
        await begin_call()
        await void_call()
    assert call.voided and not call.incomplete
    snapshot = await store.freeze("9-2")
    assert not snapshot.incomplete and snapshot.entries == ()
    assert (await store.inspect("9-2"))["pending_intents"] == 0


async def test_void_after_capture_changes_nothing(store):
    async with capture_call("9-3", store) as call:
        await begin_call()
        await capture_tokens(served([1], [2]))
        await void_call()
    assert not call.voided
    snapshot = await store.freeze("9-3")
    assert not snapshot.incomplete and len(snapshot.entries) == 1


async def test_a_call_after_freeze_is_not_captured_and_changes_no_snapshot(store):
    await store.put(
        TokenEntry(
            rollout_id="9-4",
            model_call_id="a",
            prompt_token_ids=[1],
            generation_token_ids=[2],
            generation_log_probs=[-0.1],
        )
    )
    snapshot = await store.freeze("9-4")
    async with capture_call("9-4", store) as call:
        await begin_call()  # a background call that came after the harness finished
        assert await capture_tokens(served([1, 2, 3], [4])) is None
    assert call.incomplete and not call.intent_recorded and "after freeze" in call.error
    with pytest.raises(RolloutFrozenError):
        await store.begin_call("9-4", "direct")
    # The snapshot handed to the consumer is still the one it may retire.
    assert await store.drop("9-4", snapshot_id=snapshot.snapshot_id, version=snapshot.version)


async def test_put_after_freeze_of_a_call_with_an_intent_leaves_the_version(store):
    async with capture_call("9-6", store) as call:
        await begin_call()
        snapshot = await store.freeze("9-6")  # the freeze lands while the engine works
        assert await capture_tokens(served([1], [2])) is None
    assert call.incomplete and "after freeze" in call.error
    assert snapshot.incomplete  # the pending intent already masks the rollout
    again = await store.freeze("9-6")
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)


async def test_sink_without_intents(store):
    sink = NoIntentSink(store)
    async with capture_call("9-5", sink) as call:
        await begin_call()
        assert not call.intent_recorded
        await void_call()
    assert call.voided and not call.incomplete
    assert (await store.inspect("9-5"))["state"] == "absent"


async def test_concurrent_calls_keep_their_own_context(store):
    async def one(rollout_id: str, token: int) -> str:
        async with capture_call(rollout_id, store) as call:
            await asyncio.sleep(0)
            await capture_tokens(served([token], [token + 1]))
            assert current_call() is call
            return call.model_call_id

    ids = await asyncio.gather(*(one(f"10-{i}", i) for i in range(6)))
    assert len(set(ids)) == 6
    for i in range(6):
        snapshot = await store.freeze(f"10-{i}")
        assert [e.prompt_token_ids for e in snapshot.entries] == [[i]]
        assert snapshot.entries[0].model_call_id == ids[i]
