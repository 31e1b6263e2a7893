"""The capture context of one in-flight call, carried in a contextvar.

The router opens a context for a tagged request; the dialect code below it calls
``capture_tokens(response)`` once the upstream answered. Untagged traffic has no context and
every function here is then a no-op. Nothing here raises into the model call: a response
without ids, an extraction error or a failed put marks the rollout incomplete instead.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from capture.errors import RolloutFrozenError
from capture.extract import entry_from_response
from capture.protocols import TokenSink
from capture.records import TokenEntry

log = logging.getLogger("tokcap.capture")


@dataclass
class CallCapture:
    """What one captured call knows about itself while it runs."""

    rollout_id: str
    sink: TokenSink
    model_call_id: str = field(default_factory=lambda: f"call-{uuid.uuid4().hex}")
    intent_recorded: bool = False
    entry: TokenEntry | None = None
    incomplete: bool = False
    voided: bool = False
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.entry is not None or self.incomplete or self.voided


_current: contextvars.ContextVar[CallCapture | None] = contextvars.ContextVar(
    "tokcap_call_capture", default=None
)


def current_call() -> CallCapture | None:
    """The capture of the call being served, or None for untagged traffic."""
    return _current.get()


@asynccontextmanager
async def capture_call(
    rollout_id: str, sink: TokenSink, model_call_id: str | None = None
) -> AsyncIterator[CallCapture]:
    """Open the capture context of one call; a fresh model_call_id unless one is given."""
    call = CallCapture(rollout_id=rollout_id, sink=sink)
    if model_call_id:
        call.model_call_id = model_call_id
    token = _current.set(call)
    try:
        yield call
    finally:
        _current.reset(token)


async def begin_call() -> None:
    """Record a durable intent, where the sink supports intents.

    The front end writes it while the engine works and awaits it before capture and before
    any reply, so every reply that reaches a harness is covered by an intent or an entry.
    """
    call = current_call()
    if call is None:
        return
    begin = getattr(call.sink, "begin_call", None)
    if not callable(begin):
        return
    try:
        await begin(call.rollout_id, call.model_call_id)
        call.intent_recorded = True
    except RolloutFrozenError as exc:
        # The call began after its rollout was frozen: it is not part of the snapshot, and
        # writing a loss now would only change a snapshot already handed to its consumer.
        _not_captured(call, f"call after freeze: {exc}")
    except Exception as exc:  # an intent that failed to record must not fail the call
        await mark_incomplete(f"begin_call failed: {exc}")


def _not_captured(call: CallCapture, reason: str) -> None:
    call.incomplete = True
    call.error = reason
    log.warning("rollout %s call %s not captured: %s", call.rollout_id, call.model_call_id, reason)


async def mark_incomplete(reason: str) -> None:
    """Durably note that this call's tokens are lost; logs if even that fails."""
    call = current_call()
    if call is None or call.incomplete:
        return
    call.incomplete = True
    call.error = reason
    log.warning("rollout %s call %s incomplete: %s", call.rollout_id, call.model_call_id, reason)
    try:
        await call.sink.mark_incomplete(call.rollout_id, call.model_call_id)
    except Exception:
        log.exception(
            "could not mark rollout %s incomplete; its snapshot may miss call %s",
            call.rollout_id,
            call.model_call_id,
        )


async def capture_tokens(response: Mapping[str, Any], **extra: Any) -> TokenEntry | None:
    """Build this call's entry from a served response and put it; never raises."""
    call = current_call()
    if call is None or call.done:
        return call.entry if call else None
    try:
        entry = entry_from_response(
            response,
            rollout_id=call.rollout_id,
            model_call_id=call.model_call_id,
            **extra,
        )
    except Exception as exc:
        await mark_incomplete(f"no usable token ids: {exc}")
        return None
    try:
        await call.sink.put(entry)
    except RolloutFrozenError as exc:
        if call.intent_recorded:
            # The frozen snapshot already counts this call's pending intent as lost.
            _not_captured(call, f"put after freeze: {exc}")
        else:
            await mark_incomplete(f"put failed: {type(exc).__name__}: {exc}")
        return None
    except Exception as exc:
        await mark_incomplete(f"put failed: {type(exc).__name__}: {exc}")
        return None
    call.entry = entry
    return entry


async def void_call() -> None:
    """Resolve the intent of a call that returned nothing to the harness (not a loss)."""
    call = current_call()
    if call is None or call.done:
        return
    call.voided = True
    void = getattr(call.sink, "void_call", None)
    if call.intent_recorded and callable(void):
        try:
            await void(call.rollout_id, call.model_call_id)
        except Exception as exc:
            call.voided = False
            await mark_incomplete(f"void_call failed: {exc}")
