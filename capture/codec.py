"""The one entry codec every store shares: msgpack bodies and content-addressed prompt blocks.

Successive calls of a rollout re-send the whole history, so their prompts share long
prefixes. A prompt is cut into blocks of B tokens, each named by a chained hash (the digest of
the previous block's name and this block's tokens, as in paged prefix caching), so the same
prefix always yields the same names and each block is stored once per rollout. Storage then
grows with the final context, not with turns x context.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from capture.records import SCHEMA_VERSION, TokenEntry

DEFAULT_BLOCK_SIZE = 256
CODEC_VERSION = 1
_DIGEST_BYTES = 16  # blake2b-128: collisions are not a practical concern within one rollout
_LITTLE = sys.byteorder == "little"
# Fields the body stores in packed form instead of as msgpack lists.
_PACKED = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# Set at capture; a retried put of the same call may carry another timestamp.
_NOT_PAYLOAD = ("created_at",)


def _pack(values: Iterable[int | float], typecode: str) -> bytes:
    packed = array(typecode, values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes, typecode: str) -> list[Any]:
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if not _LITTLE:
        unpacked.byteswap()
    return unpacked.tolist()


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32."""
    try:
        return _pack(ids, "I")
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc


def unpack_ids(data: bytes) -> list[int]:
    return _unpack(data, "I")


def pack_floats(values: Iterable[float]) -> bytes:
    """Log-probs as little-endian float64: exact, so a round trip changes nothing."""
    return _pack(values, "d")


def unpack_floats(data: bytes) -> list[float]:
    return _unpack(data, "d")


def prompt_blocks(prompt_ids: list[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[tuple[str, bytes]]:
    """Cut a prompt into (chained digest, packed tokens) blocks of ``block_size`` tokens."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    blocks = []
    previous = b""
    for start in range(0, len(prompt_ids), block_size):
        payload = pack_ids(prompt_ids[start : start + block_size])
        digest = hashlib.blake2b(previous + payload, digest_size=_DIGEST_BYTES).digest()
        blocks.append((digest.hex(), payload))
        previous = digest
    return blocks


@dataclass(frozen=True)
class EncodedEntry:
    """An entry ready to store: its body, the prompt blocks it names, its payload digest."""

    model_call_id: str
    body: bytes
    blocks: tuple[tuple[str, bytes], ...]
    digest: str

    @property
    def block_names(self) -> list[str]:
        return [name for name, _ in self.blocks]


def _canonical_rest(fields: Mapping[str, Any]) -> bytes:
    rest = {k: v for k, v in fields.items() if k not in _PACKED and k not in _NOT_PAYLOAD}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), default=repr).encode()


def encode_entry(entry: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> EncodedEntry:
    """Encode an entry (or anything with its fields) into body, blocks and digest."""
    entry = TokenEntry.coerce(entry)
    fields = entry.model_dump()
    blocks = prompt_blocks(entry.prompt_token_ids, block_size)
    generation = pack_ids(entry.generation_token_ids)
    log_probs = pack_floats(entry.generation_log_probs)
    rest = {k: v for k, v in fields.items() if k not in _PACKED}
    body = msgpack.packb(
        {
            "codec": CODEC_VERSION,
            "fields": rest,
            "prompt_len": len(entry.prompt_token_ids),
            "prompt_blocks": [name for name, _ in blocks],
            "generation": generation,
            "log_probs": log_probs,
        },
        use_bin_type=True,
    )
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    hasher.update(blocks[-1][0].encode() if blocks else b"-")
    hasher.update(len(entry.prompt_token_ids).to_bytes(8, "little"))
    hasher.update(generation)
    hasher.update(log_probs)
    hasher.update(_canonical_rest(fields))
    return EncodedEntry(entry.model_call_id, body, tuple(blocks), hasher.hexdigest())


def entry_digest(entry: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The canonical payload digest used by the idempotency check."""
    return encode_entry(entry, block_size).digest


def body_block_names(body: bytes) -> list[str]:
    """The prompt block names a stored body refers to, without decoding the rest."""
    return list(msgpack.unpackb(body, raw=False)["prompt_blocks"])


def decode_entry(
    body: bytes,
    blocks: Mapping[str, bytes],
    *,
    cache: dict[str, list[int]] | None = None,
    trusted: bool = False,
) -> TokenEntry:
    """Rebuild an entry from its body and a lookup of the rollout's blocks.

    Entries of one rollout share most of their prompt blocks: a ``cache`` shared across one
    snapshot unpacks each block once. ``trusted`` skips re-validation for bodies this codec
    wrote after validating them, which dominates freeze time on long rollouts.
    """
    data = msgpack.unpackb(body, raw=False)
    if data.get("codec", 0) > CODEC_VERSION:
        raise ValueError(
            f"entry body has codec {data['codec']}, this tokcap reads up to {CODEC_VERSION}"
        )
    cache = {} if cache is None else cache
    prompt: list[int] = []
    for name in data["prompt_blocks"]:
        ids = cache.get(name)
        if ids is None:
            try:
                ids = cache[name] = unpack_ids(blocks[name])
            except KeyError:
                raise ValueError(f"prompt block {name} of a stored entry is missing") from None
        prompt.extend(ids)
    if len(prompt) != data["prompt_len"]:
        raise ValueError(
            f"stored prompt has {len(prompt)} tokens but the entry says {data['prompt_len']}"
        )
    fields = {
        **data["fields"],
        "prompt_token_ids": prompt,
        "generation_token_ids": unpack_ids(data["generation"]),
        "generation_log_probs": unpack_floats(data["log_probs"]),
    }
    if trusted and fields.get("schema_version", 1) <= SCHEMA_VERSION:
        return TokenEntry.model_construct(**fields)
    return TokenEntry.model_validate(fields)
