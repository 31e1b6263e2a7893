"""The capture context of one in-flight call, carried in a contextvar.

The router opens a context for a tagged request; the front end calls ``capture_tokens``
once the upstream answered. Untagged traffic has no context and every function here is then
a no-op. Nothing here raises into the model call.

A reply may reach the harness only over a durable record: the call's entry, or the loss of
it. So every write is retried with backoff (``capture.outage``) until the call's
``timeout_s`` runs out: the put alone for the first ``PUT_SHARE`` of it, then the loss mark,
each attempt of which tries the put once more first: a store that comes back inside the
window gets the entry, not a loss that would mask the rollout. When neither lands, the call
is ``unrecorded`` and the front end answers a retryable 503 instead of the reply; its note
that the reply went unreceived is then written in the background, once the sink answers
again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from capture.acked import ACKED
from capture.errors import ConflictingEntryError, RolloutFrozenError, RoutesPrefixError
from capture.extract import entry_from_response
from capture.outage import Backoff, OutageOutlasted, retry_through_outage
from capture.protocols import TokenSink
from capture.records import TokenEntry

log = logging.getLogger("tokcap.capture")

DEFAULT_CAPTURE_TIMEOUT_S = 10.0
# How long the background note of an unserved call keeps trying after the 503.
UNSERVED_RETRY_S = 120.0
# The share of a call's timeout in which only the put is tried; then the loss mark too.
PUT_SHARE = 0.5
# A failed write is tried again after 50 ms, doubling up to 1 s, until its deadline.
_BACKOFF = Backoff(first_s=0.05, most_s=1.0)
# Errors that say the write was decided, not that it failed to happen: never retried.
_DECIDED = (RolloutFrozenError, ConflictingEntryError, RoutesPrefixError)


@dataclass
class CallCapture:
    """What one captured call knows about itself while it runs."""

    rollout_id: str
    sink: TokenSink
    model_call_id: str = field(default_factory=lambda: f"call-{uuid.uuid4().hex}")
    timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S
    intent_recorded: bool = False
    entry: TokenEntry | None = None
    incomplete: bool = False  # its loss is durably recorded (or it came after freeze)
    voided: bool = False
    unrecorded: bool = False  # neither the entry nor its loss could be made durable
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.entry is not None or self.incomplete or self.voided or self.unrecorded


_current: contextvars.ContextVar[CallCapture | None] = contextvars.ContextVar(
    "tokcap_call_capture", default=None
)
# Background notes of unserved calls; kept referenced until they finish.
_background: set[asyncio.Task[None]] = set()


def current_call() -> CallCapture | None:
    """The capture of the call being served, or None for untagged traffic."""
    return _current.get()


@asynccontextmanager
async def capture_call(
    rollout_id: str,
    sink: TokenSink,
    model_call_id: str | None = None,
    *,
    timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S,
) -> AsyncIterator[CallCapture]:
    """Open the capture context of one call; a fresh model_call_id unless one is given."""
    call = CallCapture(rollout_id=rollout_id, sink=sink, timeout_s=timeout_s)
    if model_call_id:
        call.model_call_id = model_call_id
    token = _current.set(call)
    try:
        yield call
    finally:
        _current.reset(token)


async def retry_until(write: Callable[[], Awaitable[Any]], until: float) -> Exception | None:
    """Run ``write`` until it succeeds or the monotonic clock passes ``until`` (a retry
    loop: "durably" in tokcap means what the Redis store proves with WAIT or WAITAOF).

    Returns None on success, else the last error. Each attempt is cut at ``until``, so a
    stalled sink cannot hold the call longer. A frozen rollout or a conflicting payload is
    an answer, not an outage: raised at once. Any other error is an outage of the sink.
    """

    async def attempt() -> None:
        remaining = until - time.monotonic()
        # A deadline on this task, not wait_for's task of its own around the write (3.11).
        async with asyncio.timeout(max(remaining, 0.001)):
            await write()

    def pause_after(failures: int) -> float | None:
        remaining = until - time.monotonic()
        return min(_BACKOFF.after(failures), remaining) if remaining > 0 else None

    try:
        await retry_through_outage(
            attempt, is_outage=lambda exc: not isinstance(exc, _DECIDED), pause_after=pause_after
        )
    except OutageOutlasted as outlasted:
        return outlasted.last
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "the sink did not answer in time"
    return f"{type(exc).__name__}: {exc}"


async def begin_call() -> None:
    """Record a durable intent, where the sink supports intents.

    The front end writes it while the engine works. It lets a freeze that lands while the
    call is in flight count the call as lost. Failing to write it loses nothing: the reply
    still waits for the entry or a loss mark, so it is only noted.
    """
    call = current_call()
    if call is None:
        return
    begin = getattr(call.sink, "begin_call", None)
    if not callable(begin):
        return
    try:
        async with asyncio.timeout(call.timeout_s / 2):
            await begin(call.rollout_id, call.model_call_id)
        call.intent_recorded = True
    except RolloutFrozenError as exc:
        # The call began after its rollout was frozen: it is not part of the snapshot, and
        # writing a loss now would only change a snapshot already handed to its consumer.
        _not_captured(call, f"call after freeze: {exc}")
    except Exception as exc:
        log.warning(
            "rollout %s call %s: no intent recorded (%s); its entry or loss still covers it",
            call.rollout_id,
            call.model_call_id,
            _describe(exc),
        )


def _not_captured(call: CallCapture, reason: str) -> None:
    call.incomplete = True
    call.error = reason
    log.warning("rollout %s call %s not captured: %s", call.rollout_id, call.model_call_id, reason)


async def _record_loss(
    call: CallCapture, reason: str, until: float, entry: TokenEntry | None = None
) -> bool:
    """Durably note the loss of this call before ``until``; False when that failed.

    With ``entry`` (a put that failed for an outage), each attempt puts it again first: a
    store that comes back late in the window then gets the entry instead of a loss.
    """
    call.error = reason
    failed = await retry_until(lambda: _entry_else_loss(call, entry), until)
    if failed is None:
        if call.entry is None:
            call.incomplete = True
            log.warning(
                "rollout %s call %s incomplete: %s", call.rollout_id, call.model_call_id, reason
            )
        return True
    log.error(
        "rollout %s call %s: %s, and its loss could not be recorded either (%s)",
        call.rollout_id,
        call.model_call_id,
        reason,
        _describe(failed),
    )
    return False


async def _entry_else_loss(call: CallCapture, entry: TokenEntry | None) -> None:
    """One attempt of the last phase: the entry if the store takes it now, else the loss."""
    if entry is not None:
        try:
            await call.sink.put(entry)
            call.entry = entry
            return
        except Exception:  # still out, frozen meanwhile, or refused: record the loss
            pass
    await call.sink.mark_incomplete(call.rollout_id, call.model_call_id)


async def mark_incomplete(reason: str) -> None:
    """Durably note that this call's tokens are lost; unrecorded if even that fails."""
    call = current_call()
    if call is None or call.done:
        return
    if not await _record_loss(call, reason, time.monotonic() + call.timeout_s):
        call.unrecorded = True


async def _put(call: CallCapture, entry: TokenEntry, until: float) -> tuple[str | None, bool]:
    """Put the entry before ``until``: (None when stored, else why not; whether to retry)."""
    try:
        failed = await retry_until(lambda: call.sink.put(entry), until)
    except RolloutFrozenError as exc:
        if call.intent_recorded:
            # The frozen snapshot already counts this call's pending intent as lost.
            _not_captured(call, f"put after freeze: {exc}")
            return None, False
        return f"put failed: {type(exc).__name__}: {exc}", False
    except ConflictingEntryError as exc:
        return f"put failed: {exc}", False  # the store marked the loss in the same write
    except RoutesPrefixError as exc:
        return f"put failed: {exc}", False  # the same entry would fail again: mark the loss
    if failed is not None:
        return f"put failed: {_describe(failed)}", True
    call.entry = entry
    return None, False


async def capture_tokens(response: Mapping[str, Any], **extra: Any) -> TokenEntry | None:
    """Build this call's entry from a served response and put it; never raises.

    The Gym-compatible path: the token arrays ride on one output item of ``response``.
    """
    call = current_call()
    if call is None or call.done:
        return call.entry if call else None
    try:
        entry = entry_from_response(
            response, rollout_id=call.rollout_id, model_call_id=call.model_call_id, **extra
        )
    except Exception as exc:
        await mark_incomplete(f"no usable token ids: {exc}")
        return None
    return await capture_entry(entry)


async def capture_entry(entry: TokenEntry) -> TokenEntry | None:
    """Put this call's entry, built by the caller for the current call; never raises.

    The put is retried for ``PUT_SHARE`` of the call's timeout; for the rest, the loss mark
    (after one more put, when the store was out). The call is ``unrecorded`` when neither
    became durable. The entry goes out stamped with the rollout's puts acknowledged so far
    (``capture.acked``), so the rebuild sees calls lost from the store.
    """
    call = current_call()
    if call is None or call.done:
        return call.entry if call else None
    if (entry.rollout_id, entry.model_call_id) != (call.rollout_id, call.model_call_id):
        await mark_incomplete(f"the entry names call {entry.model_call_id}, not this call")
        return None
    entry = ACKED.stamp(call.sink, entry)
    started = time.monotonic()
    problem, out = await _put(call, entry, started + call.timeout_s * PUT_SHARE)
    if problem is not None:
        retry = entry if out else None
        if not await _record_loss(call, problem, started + call.timeout_s, retry):
            call.unrecorded = True
    if call.entry is not None:
        ACKED.acknowledged(call.sink, call.rollout_id)
    return call.entry


async def void_call() -> None:
    """Resolve the intent of a call that returned nothing to the harness (not a loss)."""
    call = current_call()
    if call is None or call.done:
        return
    call.voided = True
    void = getattr(call.sink, "void_call", None)
    if not (call.intent_recorded and callable(void)):
        return
    until = time.monotonic() + call.timeout_s
    try:
        failed = await retry_until(lambda: void(call.rollout_id, call.model_call_id), until)
    except RolloutFrozenError:
        return  # the snapshot already counted the pending intent as lost
    if failed is not None:
        # A pending intent masks the rollout, which is safe; nothing reached the harness.
        log.warning(
            "rollout %s call %s: could not void its intent (%s)",
            call.rollout_id,
            call.model_call_id,
            _describe(failed),
        )


async def _note_unreceived(call: CallCapture, reason: str, until: float) -> None:
    """Durably note that the harness never got this call's reply (see ``ReceiptSink``)."""
    mark = getattr(call.sink, "mark_unreceived", None)
    if not callable(mark):
        await _record_loss(call, f"{reason} (the sink cannot note receipts)", until)
        return
    try:
        failed = await retry_until(lambda: mark(call.rollout_id, call.model_call_id), until)
    except RolloutFrozenError:
        # The snapshot may already be handed off with this call in it: only a loss,
        # which is allowed after freeze and changes its version, can still say so.
        await _record_loss(call, f"{reason} after the rollout was frozen", until)
        return
    if failed is not None:
        log.error(
            "rollout %s call %s: %s, and noting it failed (%s)",
            call.rollout_id,
            call.model_call_id,
            reason,
            _describe(failed),
        )


async def mark_unreceived(reason: str) -> None:
    """The harness disconnected before this call's reply went out: note it, never raise."""
    call = current_call()
    if call is None or call.voided:
        return
    log.warning("rollout %s call %s: %s", call.rollout_id, call.model_call_id, reason)
    await _note_unreceived(call, reason, time.monotonic() + call.timeout_s)


def resolve_unserved(reason: str, call: CallCapture | None = None) -> None:
    """Note in the background that a call's reply never reached the harness.

    For a call answered 503, or a stream cut before its final event. Its intent may be
    pending and its put may still land (an attempt cut at the deadline can complete later);
    the note keeps either from masking the rollout or being delivered. ``call`` defaults to
    the current one.
    """
    call = call or current_call()
    if call is None:
        return
    log.warning("rollout %s call %s: %s", call.rollout_id, call.model_call_id, reason)
    until = time.monotonic() + UNSERVED_RETRY_S
    task = asyncio.ensure_future(_note_unreceived(call, reason, until))
    _background.add(task)
    task.add_done_callback(_background.discard)
