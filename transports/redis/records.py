"""What the fields of a rollout hash hold, and how they are read back as entries.

Fields hold exactly the shared codec's form (``capture.codec.entries``): ``e:<call>`` the entry's
body, ``b:<name>`` a stored block (whole or extension, with its parent link), ``t:<parent>``
the tail a later call may extend. Reading them back is the codec's decode, with one block
cache per snapshot.
"""

from __future__ import annotations

from capture.codec.entries import decode_entries, read_body
from capture.inspection import Inspection, state_name
from capture.reasons import call_reason, incomplete_reasons
from capture.records import TokenCaptureSnapshot
from transports.redis import keys as k


def split(fields: dict[bytes, bytes]) -> dict[str, dict[str, bytes]]:
    """The hash's per-call and per-block fields, by kind, keyed by call id or block name."""
    names = (k.ENTRY, k.INTENT, k.MARK, k.BLOCK, k.UNRECEIVED)
    kinds: dict[str, dict[str, bytes]] = {kind: {} for kind in names}
    for name, value in fields.items():
        kind, rest = k.split_field(name)
        if kind in kinds:
            kinds[kind][rest] = value
    return kinds


def _flag(fields: dict[bytes, bytes], name: str) -> bool:
    return fields.get(name.encode()) == b"1"


def _pending(kinds: dict[str, dict[str, bytes]]) -> list[str]:
    """Calls with an open intent, no entry, and no note that the reply went unreceived."""
    settled = kinds[k.ENTRY].keys() | kinds[k.UNRECEIVED].keys()
    return sorted(
        call_id
        for call_id, value in kinds[k.INTENT].items()
        if value == k.INTENT_OPEN and call_id not in settled
    )


def snapshot_of(
    rollout_id: str, fields: dict[bytes, bytes], version: int, snapshot_id: str
) -> TokenCaptureSnapshot:
    kinds = split(fields)
    bodies, blocks = kinds[k.ENTRY], kinds[k.BLOCK]
    calls = sorted(bodies)
    # One shared id sequence per chain (views), as the file store's freeze: the rebuild and
    # its record then grow with the final context, not with turns x context.
    bodies_in_order = [bodies[c] for c in calls]
    entries = tuple(decode_entries(bodies_in_order, blocks, trusted=True, shared=True))
    lost = [call_reason(call_id, what.decode()) for call_id, what in sorted(kinds[k.MARK].items())]
    pending = _pending(kinds)
    retired = _flag(fields, k.RETIRED)  # its entries are gone, so it can no longer be rebuilt
    reasons = incomplete_reasons(lost, pending, retired)
    return TokenCaptureSnapshot(
        rollout_id=rollout_id,
        entries=entries,
        incomplete=_flag(fields, k.INCOMPLETE) or bool(pending) or retired,
        snapshot_id=snapshot_id,
        version=version,
        incomplete_reasons=tuple(reasons),
        unreceived=tuple(sorted(kinds[k.UNRECEIVED])),
    )


def summary_of(rollout_id: str, fields: dict[bytes, bytes]) -> Inspection:
    kinds = split(fields)
    bodies = kinds[k.ENTRY]
    prompt_max, generated = 0, 0
    for body in bodies.values():
        data = read_body(body)
        prompt_max = max(prompt_max, data["prompt_len"])
        generated += data["generated"]
    retired = _flag(fields, k.RETIRED)
    snapshot_id = fields.get(k.SNAPSHOT_ID.encode())
    return Inspection(
        rollout_id=rollout_id,
        state=state_name(exists=bool(fields), frozen=_flag(fields, k.FROZEN), retired=retired),
        calls=len(bodies),
        pending_intents=len(_pending(kinds)),
        unreceived=len(kinds[k.UNRECEIVED]),
        prompt_tokens_max=prompt_max,
        generated_tokens=generated,
        version=int(fields.get(k.VERSION.encode()) or 0),
        snapshot_id=snapshot_id.decode() if snapshot_id else "",
        incomplete=_flag(fields, k.INCOMPLETE),  # marked lost; pending intents aside
        tombstone=retired,
    )
