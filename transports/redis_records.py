"""What the fields of a rollout hash hold, and how they are read back as entries.

Memory must grow with a rollout's final context, not with turns x context, and Redis pays
per field and per allocation, so the stored form is tighter than the codec's body:

- A call's whole sequence (prompt + generation) is cut into blocks chained as the shared
  codec chains prompt blocks; the next call's prompt starts with this sequence, so the
  generation is stored once, in blocks the next call shares.
- A block field holds a kind byte, its parent's 16-byte digest, and its ids. Names are
  chained hashes, so an entry keeps only its last block name (the tip) and the count.
- A sequence's last block is usually partial; when the next call fills it up, the new block
  is stored as an *extension*: the earlier block's name plus the extra ids. A ``t:`` field
  per parent names the partial block to extend.
- The entry field keeps the codec's other fields and the packed log-probs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack

from capture.codec import EncodedEntry, pack_floats, pack_ids, unpack_floats, unpack_ids
from capture.errors import SchemaVersionError
from capture.records import SCHEMA_VERSION, TokenCaptureSnapshot, TokenEntry
from transports import redis_keys as k

ROOT = bytes(16)  # the parent of a sequence's first block
_WHOLE, _EXTENSION = b"w", b"x"
_STORED_FORMAT = 1


@dataclass(frozen=True)
class StoredEntry:
    """One entry ready for the hash: its entry field and its sequence's blocks."""

    body: bytes
    blocks: tuple[tuple[str, bytes, bytes], ...]  # (name, parent digest, packed ids)


def chain_digest(parent: bytes, data: bytes) -> bytes:
    """A block's name: the codec's chained hash of its parent's digest and its packed ids."""
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def _sequence_blocks(entry: TokenEntry, encoded: EncodedEntry, block_size: int) -> list:
    """Blocks of prompt + generation, reusing the codec's whole prompt blocks (``encoded``
    must use ``block_size``): the same chain, so only the tail is hashed again."""
    whole = [(n, d) for n, d in encoded.blocks if len(d) == 4 * block_size]
    rest = [*entry.prompt_token_ids[len(whole) * block_size :], *entry.generation_token_ids]
    named = list(whole)
    parent = bytes.fromhex(whole[-1][0]) if whole else b""
    for start in range(0, len(rest), block_size):
        data = pack_ids(rest[start : start + block_size])
        parent = chain_digest(parent, data)
        named.append((parent.hex(), data))
    return named


def stored_entry(entry: TokenEntry, encoded: EncodedEntry, block_size: int) -> StoredEntry:
    body = msgpack.unpackb(encoded.body, raw=False)
    named = _sequence_blocks(entry, encoded, block_size)
    parents = [ROOT, *(bytes.fromhex(name) for name, _ in named)]
    stored = {
        "format": _STORED_FORMAT,
        "fields": body["fields"],
        "prompt_len": len(entry.prompt_token_ids),
        "generated": len(entry.generation_token_ids),
        "tip": named[-1][0] if named else "",
        "n_blocks": len(named),
        "log_probs": pack_floats(entry.generation_log_probs),
    }
    blocks = tuple((name, parents[i], data) for i, (name, data) in enumerate(named))
    return StoredEntry(msgpack.packb(stored, use_bin_type=True), blocks)


def whole_block(parent: bytes, data: bytes) -> bytes:
    return _WHOLE + parent + data


def extension_block(parent: bytes, base: str, extra: bytes) -> bytes:
    return _EXTENSION + parent + bytes.fromhex(base) + extra


def tail_value(name: str, data: bytes) -> bytes:
    """What a ``t:`` field holds: the partial block's name and its length in bytes."""
    return bytes.fromhex(name) + len(data).to_bytes(4, "little")


def extends(tail: bytes | None, parent: bytes, data: bytes) -> tuple[str, bytes] | None:
    """(base name, extra bytes) if ``data`` starts with the partial block ``tail`` names.

    Names are chained digests, so hashing the parent with our own leading bytes proves the
    prefix without downloading the earlier block.
    """
    if not tail:
        return None
    base, length = tail[:16], int.from_bytes(tail[16:20], "little")
    if not 0 < length < len(data):
        return None
    if chain_digest(parent, data[:length]) != base:
        return None
    return base.hex(), data[length:]


def _resolve(name: str, raw: dict[str, bytes], done: dict[Any, Any]) -> None:
    """Fill ``done[name] = (parent, data)``, following extensions iteratively."""
    pending = [name]
    while pending:
        current = pending[-1]
        if current in done:
            pending.pop()
            continue
        value = raw.get(current)
        if value is None:
            raise ValueError(f"block {current} of a stored entry is missing")
        parent = value[1:17]
        if value[:1] == _WHOLE:
            done[current] = (parent, value[17:])
            pending.pop()
            continue
        base = value[17:33].hex()
        if base not in done:
            pending.append(base)
            continue
        done[current] = (parent, done[base][1] + value[33:])
        pending.pop()


def _sequence(tip: str, length: int, raw: dict[str, bytes], done: dict[str, Any]) -> list[int]:
    """The ids of a block chain. Each block is unpacked once per snapshot and its id objects
    are shared by every entry that contains it, which is most of the cost of a freeze."""
    names: list[str] = []
    name = tip
    while name and len(names) < length:
        _resolve(name, raw, done)
        names.append(name)
        parent = done[name][0]
        name = "" if parent == ROOT else parent.hex()
    if len(names) != length:
        raise ValueError(f"block chain ending in {tip} has {len(names)} of {length} blocks")
    ids: list[int] = []
    for name in reversed(names):
        unpacked = done.get(("ids", name))
        if unpacked is None:
            unpacked = done["ids", name] = unpack_ids(done[name][1])
        ids.extend(unpacked)
    return ids


def decode_stored(body: bytes, raw: dict[str, bytes], done: dict[str, Any]) -> TokenEntry:
    """An entry from its field and the rollout's block fields (``done`` caches resolved ones)."""
    data = msgpack.unpackb(body, raw=False)
    if data.get("format", 0) > _STORED_FORMAT:
        raise ValueError(f"stored entry format {data['format']} is newer than this tokcap")
    sequence = _sequence(data["tip"], data["n_blocks"], raw, done)
    prompt_len = data["prompt_len"]
    if len(sequence) != prompt_len + data["generated"]:
        raise ValueError(f"stored sequence has {len(sequence)} ids, the entry says "
                         f"{prompt_len} + {data['generated']}")
    fields = data["fields"]
    if fields.get("schema_version", 1) > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"entry has schema_version {fields['schema_version']}, but this tokcap reads up "
            f"to schema_version {SCHEMA_VERSION}; upgrade tokcap to read it"
        )
    # Validated when it was put; constructing skips a second pass over every id.
    return TokenEntry.model_construct(
        **fields,
        prompt_token_ids=sequence[:prompt_len],
        generation_token_ids=sequence[prompt_len:],
        generation_log_probs=unpack_floats(data["log_probs"]),
    )


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
    done: dict[str, Any] = {}
    entries = tuple(decode_stored(bodies[call_id], blocks, done) for call_id in sorted(bodies))
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
        generated += data["generated"]
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

