"""Why a rollout is incomplete, in one wording for both stores, snapshots and ``inspect``.

A reason about one call reads ``call <id>: <what happened>``; a loss marked on the rollout
as a whole names ``(rollout)`` instead of a call id. The Redis store keeps only the part
after the colon per call, the file store keeps whole reasons in its log; both read back the
same text: marked losses (in the store's own order), then pending intents, then retirement.
"""

from __future__ import annotations

from collections.abc import Iterable

ROLLOUT = "(rollout)"  # stands for the call id when the rollout as a whole was marked

# What happened to a call.
MARKED_INCOMPLETE = "marked incomplete"  # mark_incomplete: the caller lost it
CONFLICTING_PAYLOAD = "conflicting payload"  # put twice with different payloads
INTENT_WITHOUT_ENTRY = "intent without entry"  # begun, never put, voided or unreceived

RETIRED = "rollout retired: its entries were dropped"  # it can no longer be rebuilt


def call_reason(model_call_id: str, what: str) -> str:
    """``call <id>: <what>``, or ``call (rollout): <what>`` for the rollout as a whole."""
    return f"call {model_call_id or ROLLOUT}: {what}"


def incomplete_reasons(lost: Iterable[str], pending: Iterable[str], retired: bool) -> list[str]:
    """A snapshot's reasons: the marked losses, each pending intent, then retirement."""
    reasons = list(lost)
    reasons += [call_reason(call_id, INTENT_WITHOUT_ENTRY) for call_id in pending]
    if retired:
        reasons.append(RETIRED)
    return reasons
