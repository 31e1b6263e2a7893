"""Content-addressed blocks: how one call's token sequence is cut, named, stored and read back.

A call's sequence (prompt + generation) is cut into blocks of B tokens. Each block is named by
a chained digest (blake2b-128 of its parent's digest and its packed ids, as in paged prefix
caching), so the same prefix always yields the same names and a rollout stores each block
once. The next call's prompt starts with this call's sequence, so a generation is stored once,
in blocks the next prompt shares.

A stored block carries its parent link, so an entry needs only its last block's name (the
tip) and the block count. A sequence's last block is usually partial; when a later call fills
it up, the longer block is stored as an *extension*: the earlier block's name plus the extra
ids. A store keeps a *tail* per parent (the partial block a later call may extend) and passes
what it holds to ``plan_writes``, which decides what new bytes must be stored.

Stored block bytes: ``b"w" + parent + ids`` (whole) or ``b"x" + parent + base + extra ids``
(extension), with 16-byte digests; a tail value is the partial block's digest and byte length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

DIGEST_BYTES = 16  # blake2b-128: collisions are not a practical concern within one rollout
ROOT = bytes(DIGEST_BYTES)  # the parent of a sequence's first block
ROOT_NAME = ROOT.hex()
ID_BYTES = 4  # uint32 ids
_WHOLE, _EXTENSION = b"w", b"x"
_HEAD = 1 + DIGEST_BYTES  # kind byte and parent digest


def chain_digest(parent: bytes, data: bytes) -> bytes:
    """A block's digest: blake2b-128 of its parent's digest and its packed ids."""
    return hashlib.blake2b(parent + data, digest_size=DIGEST_BYTES).digest()


class Block(NamedTuple):
    """One block of a sequence: its name, its parent's digest, its packed ids."""

    name: str
    parent: bytes
    data: bytes


def cut(packed: bytes, block_size: int, parent: bytes = ROOT) -> list[Block]:
    """Cut packed uint32 ids into chained blocks of ``block_size`` ids, the first one a child
    of ``parent`` (the root, or the last whole block of a prefix cut before)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    return cut_bytes(packed, ID_BYTES * block_size, parent)


def routes_root(row_bytes: int) -> bytes:
    """The parent of a routes chain's first block: apart from the ids' root, so the two
    chains of one rollout never share a tail, and apart per row width."""
    return chain_digest(ROOT, b"routed_experts" + row_bytes.to_bytes(4, "little"))


def cut_bytes(packed: bytes, step: int, parent: bytes = ROOT) -> list[Block]:
    """Cut bytes into chained blocks of ``step`` bytes (see ``cut``)."""
    blocks = []
    blake2b = hashlib.blake2b
    for start in range(0, len(packed), step):
        data = packed[start : start + step]
        hasher = blake2b(parent, digest_size=DIGEST_BYTES)  # = chain_digest, without a copy
        hasher.update(data)
        digest = hasher.digest()
        blocks.append(Block(digest.hex(), parent, data))
        parent = digest
    return blocks


def whole_block(block: Block) -> bytes:
    return _WHOLE + block.parent + block.data


def tail_value(block: Block) -> bytes:
    """What a tail holds: the partial block's digest and its length in bytes."""
    return bytes.fromhex(block.name) + len(block.data).to_bytes(4, "little")


def _extends(tail: bytes | None, block: Block) -> bytes | None:
    """The extra ids if ``block`` starts with the partial block ``tail`` names, else None.

    Names are chained digests, so hashing the parent with our own leading bytes proves the
    prefix without reading the earlier block.
    """
    if not tail:
        return None
    base, length = tail[:DIGEST_BYTES], int.from_bytes(tail[DIGEST_BYTES:], "little")
    if not 0 < length < len(block.data) or chain_digest(block.parent, block.data[:length]) != base:
        return None
    return _EXTENSION + block.parent + base + block.data[length:]


@dataclass(frozen=True)
class Writes:
    """What a store must add for one entry: new blocks, and the tails they set (by parent)."""

    blocks: list[tuple[str, bytes]]
    tails: list[tuple[str, bytes]]


def plan_writes(
    blocks: Sequence[Block], full: int, held: Container[str], tails: Mapping[str, bytes]
) -> Writes:
    """The bytes to store for a sequence's blocks, given what the store already holds.

    ``held`` answers whether a block name is stored; ``tails`` maps a parent's name to the
    tail stored under it (a store that knows only some tails passes those). A block not held
    is stored as an extension of its parent's tail when it starts with it, else whole; a
    partial block (fewer than ``full`` bytes) becomes its parent's tail.

    ``held`` is closed under parents: a store holds a block only with every block before it
    in its chain, since each put stores all the blocks its chain lacks. So the blocks to add
    are those after the last held one, found from the tip: a put costs the blocks it adds,
    not a lookup per block of a long context.
    """
    first = len(blocks)
    while first and blocks[first - 1].name not in held:
        first -= 1
    new: list[tuple[str, bytes]] = []
    new_tails: list[tuple[str, bytes]] = []
    for block in blocks[first:]:
        parent = block.parent.hex()
        new.append((block.name, _extends(tails.get(parent), block) or whole_block(block)))
        if len(block.data) < full:
            new_tails.append((parent, tail_value(block)))
    return Writes(new, new_tails)


def parent_of(stored: bytes) -> str:
    """The parent name a stored block links to (``ROOT_NAME`` for a sequence's first)."""
    return stored[1:_HEAD].hex()


def cached_parent(name: str, blocks: Mapping[str, bytes], cache: dict[Any, Any]) -> str:
    """A stored block's parent name, read once per snapshot (``cache``)."""
    parent = cache.get(("parent", name))
    if parent is None:
        stored = blocks.get(name)
        if stored is None:
            raise ValueError(f"prompt block {name} of a stored entry is missing")
        parent = cache["parent", name] = parent_of(stored)
    return parent


def chain_names(
    tip: str,
    count: int,
    blocks: Mapping[str, bytes],
    cache: dict[Any, Any] | None = None,
    root: str = ROOT_NAME,
) -> list[str]:
    """The names of the chain ending in ``tip``, first block first, through parent links
    (``cache`` keeps each block's parent name for the other entries of a snapshot)."""
    cache = {} if cache is None else cache
    names: list[str] = []
    name = tip
    while len(names) < count:
        names.append(name)
        name = cached_parent(name, blocks, cache)
    if count and name != root:
        raise ValueError(f"block chain ending in {tip} is longer than its {count} blocks")
    return names[::-1]


def block_ids(name: str, blocks: Mapping[str, bytes], cache: dict[Any, Any]) -> bytes | memoryview:
    """A block's packed ids (or routes), following extensions iteratively; ``cache`` keeps
    resolved ones. A whole block is a view of its stored bytes, not a copy: a long
    rollout's blocks are read once, and its routes are most of its bytes."""
    pending = [name]
    while pending:
        current = pending[-1]
        if current in cache:
            pending.pop()
            continue
        stored = blocks.get(current)
        if stored is None:
            raise ValueError(f"prompt block {current} of a stored entry is missing")
        if stored[:1] == _WHOLE:
            cache[current] = memoryview(stored)[_HEAD:]
            pending.pop()
            continue
        base = stored[_HEAD : _HEAD + DIGEST_BYTES].hex()
        if base not in cache:
            pending.append(base)
            continue
        cache[current] = b"".join((cache[base], memoryview(stored)[_HEAD + DIGEST_BYTES :]))
        pending.pop()
    return cache[name]
