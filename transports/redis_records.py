"""What the fields of a rollout hash hold, and how they are read back as entries.

An entry field holds the shared codec's body with its list of prompt block names replaced by
the last name (the tip) and the count: block names are chained hashes, so each block's parent
link recovers the list, and a rollout's memory grows with its final context rather than with
turns x context. A block field holds its parent's 16-byte digest followed by the packed ids.
"""

from __future__ import annotations

from typing import Any

import msgpack

from capture.codec import EncodedEntry, decode_entry
from capture.records import TokenCaptureSnapshot, TokenEntry
from transports import redis_keys as k

_ROOT = bytes(16)  # the parent of a prompt's first block


def stored_body(encoded: EncodedEntry) -> bytes:
    """The entry's codec body, with the block list reduced to its tip and length."""
    body = msgpack.unpackb(encoded.body, raw=False)
    names = body["prompt_blocks"]
    body["prompt_blocks"] = []
    body["tip"] = names[-1] if names else ""
    body["n_blocks"] = len(names)
    return msgpack.packb(body, use_bin_type=True)


def stored_blocks(encoded: EncodedEntry) -> list[tuple[str, bytes]]:
    """(name, parent digest + packed ids) for every prompt block of the entry."""
    parents = [_ROOT, *(bytes.fromhex(name) for name in encoded.block_names)]
    return [(name, parents[i] + data) for i, (name, data) in enumerate(encoded.blocks)]


def _chain(tip: str, length: int, blocks: dict[str, bytes]) -> list[str]:
    names: list[str] = []
    name = tip
    while name and len(names) < length:
        names.append(name)
        stored = blocks.get(name)
        if stored is None:
            break
        parent = stored[:16]
        name = "" if parent == _ROOT else parent.hex()
    if len(names) != length:
        raise ValueError(f"prompt block chain ending in {tip} has {len(names)} of {length} blocks")
    return names[::-1]


def decode_stored(body: bytes, blocks: dict[str, bytes]) -> TokenEntry:
    """An entry from its stored body and the rollout's stored blocks."""
    data = msgpack.unpackb(body, raw=False)
    data["prompt_blocks"] = _chain(data.pop("tip"), data.pop("n_blocks"), blocks)
    ids = {name: blocks[name][16:] for name in data["prompt_blocks"]}
    return decode_entry(msgpack.packb(data, use_bin_type=True), ids)


def split(fields: dict[bytes, bytes]) -> dict[str, dict[str, bytes]]:
    """The hash's per-call and per-block fields, by kind, keyed by call id or block name."""
    kinds: dict[str, dict[str, bytes]] = {kind: {} for kind in (k.ENTRY, k.INTENT, k.MARK, k.BLOCK)}
    for name, value in fields.items():
        kind, rest = k.split_field(name)
        if kind in kinds:
            kinds[kind][rest] = value
    return kinds


def _flag(fields: dict[bytes, bytes], name: str) -> bool:
    return fields.get(name.encode()) == b"1"


def snapshot_of(
    rollout_id: str, fields: dict[bytes, bytes], version: int, snapshot_id: str
) -> TokenCaptureSnapshot:
    kinds = split(fields)
    bodies, blocks = kinds[k.ENTRY], kinds[k.BLOCK]
    entries = tuple(decode_stored(bodies[call_id], blocks) for call_id in sorted(bodies))
    reasons = [f"call {call_id or '(rollout)'}: {reason.decode()}"
               for call_id, reason in sorted(kinds[k.MARK].items())]
    pending = sorted(call_id for call_id, value in kinds[k.INTENT].items()
                     if value == k.INTENT_OPEN and call_id not in bodies)
    reasons += [f"call {call_id}: intent without entry" for call_id in pending]
    retired = _flag(fields, k.RETIRED)
    if retired:  # its entries are gone, so it can no longer be rebuilt
        reasons.append("rollout retired: its entries were dropped")
    return TokenCaptureSnapshot(
        rollout_id=rollout_id,
        entries=entries,
        incomplete=_flag(fields, k.INCOMPLETE) or bool(pending) or retired,
        snapshot_id=snapshot_id,
        version=version,
        incomplete_reasons=tuple(reasons),
    )


def summary_of(rollout_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    kinds = split(fields)
    bodies = kinds[k.ENTRY]
    pending = [c for c, v in kinds[k.INTENT].items() if v == k.INTENT_OPEN and c not in bodies]
    prompt_max, generated = 0, 0
    for body in bodies.values():
        data = msgpack.unpackb(body, raw=False)
        prompt_max = max(prompt_max, data["prompt_len"])
        generated += len(data["generation"]) // 4
    retired = _flag(fields, k.RETIRED)
    if not fields:
        state = "absent"
    elif retired:
        state = "retired"
    elif _flag(fields, k.FROZEN):
        state = "frozen"
    else:
        state = "open"
    snapshot_id = fields.get(k.SNAPSHOT_ID.encode())
    return {
        "rollout_id": rollout_id,
        "state": state,
        "calls": len(bodies),
        "pending_intents": len(pending),
        "incomplete": _flag(fields, k.INCOMPLETE),  # marked lost; pending intents aside
        "version": int(fields.get(k.VERSION.encode()) or 0),
        "snapshot_id": snapshot_id.decode() if snapshot_id else "",
        "prompt_tokens_max": prompt_max,
        "generated_tokens": generated,
        "tombstone": retired,
    }
