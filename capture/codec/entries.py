"""The one entry codec every store shares: a msgpack body and content-addressed blocks.

Successive calls of a rollout re-send the whole history, so each prompt starts with the
previous call's prompt and generation. An entry's sequence (prompt + generation) is cut into
chained blocks (see ``capture.codec.blocks``); the same prefix always yields the same names, so each
block is stored once per rollout and storage grows with the final context, not with
turns x context. The body keeps the entry's other fields, its log-probs, and the name and
count of its blocks; ``EncodedEntry.plan`` tells a store which bytes it must add.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from capture.codec.blocks import (
    DIGEST_BYTES,
    ID_BYTES,
    ROOT,
    ROOT_NAME,
    Block,
    Writes,
    block_ids,
    cached_parent,
    cut,
    plan_writes,
    whole_block,
)
from capture.codec.packed import (
    ID_WIDTH,
    PackedIds,
    ids_array,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)
from capture.codec.route_blocks import (
    ChainedRoutes,
    cut_routes,
    routes_digest,
    routes_from_blocks,
)
from capture.codec.views import IdView
from capture.records import SCHEMA_VERSION, TokenEntry
from capture.routes import Routes

# 250 ids: a whole stored block (kind byte, 16-byte parent digest, 1,000 bytes of ids, and
# Redis's 6-byte string header) fits jemalloc's 1 KiB size class, where 256 would take 1,280.
DEFAULT_BLOCK_SIZE = 250
CODEC_VERSION = 3
# A body without routes is still codec 2, so a reader before routes reads it; one with
# routes is codec 3, which such a reader refuses rather than dropping the routes.
CODEC_WITHOUT_ROUTES = 2
# A packed-id prompt's remembered prefix: its own bytes, then the generation's.
_Parts = tuple[memoryview, memoryview]
# (block size, prefix, its whole blocks, the bytes it holds): what ChainMemo keeps per rollout.
_Known = tuple[int, list[int] | _Parts, tuple[Block, ...], int]
# The memo's bounds: 160 MiB keep 1,000 rollouts of 16k packed ids (each holds its prefix and
# its blocks' copy of the ids, 8 bytes an id, and about 256 bytes a block beside).
MEMO_BYTES = 160 << 20
MEMO_ROLLOUTS = 4096
LIST_ID_BYTES = 36  # an id kept in a list: its pointer and its int
BLOCK_BYTES = 256  # a kept Block beside its ids: the tuple, its name and parent digest
# Fields the body and blocks store in packed form instead of as msgpack lists.
_PACKED = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})
# Set at capture; a retried put of the same call may carry another timestamp.
_NOT_PAYLOAD = ("created_at",)


@dataclass(frozen=True)
class EncodedEntry:
    """An entry ready to store: its body, its sequence's blocks, its payload digest."""

    model_call_id: str
    body: bytes
    chain: tuple[Block, ...]
    digest: str
    block_size: int = DEFAULT_BLOCK_SIZE
    routes: tuple[Block, ...] = ()  # the routed experts' blocks (capture.codec.route_blocks)
    route_row_bytes: int = 0
    # Blocks the rollout must hold already: the tip of a stored routes prefix the routes
    # continue (``ChainedRoutes``); a store that lacks one refuses the put.
    requires: tuple[str, ...] = ()

    @property
    def every_block(self) -> tuple[Block, ...]:
        """The ids' blocks, then the routes' (each chain first block first)."""
        return self.chain + self.routes

    @property
    def blocks(self) -> tuple[tuple[str, bytes], ...]:
        """Every block in its whole stored form."""
        return tuple((block.name, whole_block(block)) for block in self.every_block)

    @property
    def block_names(self) -> list[str]:
        return [block.name for block in self.every_block]

    def plan(self, held: Container[str], tails: Mapping[str, bytes]) -> Writes:
        """The blocks and tails a store must add, given the block names and tails it holds:
        planned per chain, since each is closed under its own parents."""
        writes = plan_writes(self.chain, ID_BYTES * self.block_size, held, tails)
        if not self.routes:
            return writes
        full = self.route_row_bytes * self.block_size
        more = plan_writes(self.routes, full, held, tails)
        return Writes(writes.blocks + more.blocks, writes.tails + more.tails)


def _canonical_rest(rest: Mapping[str, Any]) -> bytes:
    kept = {k: v for k, v in rest.items() if k not in _NOT_PAYLOAD}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=repr).encode()


class ChainMemo:
    """The last whole-block prefix encoded per rollout, for a writer to encode the next call
    of a rollout incrementally.

    A call's prompt almost always starts with the previous call's sequence, so comparing the
    ids replaces packing and hashing the whole context again: one C-level list comparison
    for a list; for ``PackedIds``, whose prefix is remembered as the packed bytes the calls
    brought, a few ``memcmp`` (and no copy) that find every whole block the two share, so a
    prompt that re-renders the last reply still reuses the blocks before it. Bounded by
    the bytes it keeps (``MEMO_BYTES``) and by rollouts: the least recently used are
    forgotten first. A writer with 1,000 rollouts in flight keeps them all (a miss costs
    0.5 ms a put at 16k tokens, a hit 0.05 ms).
    """

    def __init__(self, max_rollouts: int = MEMO_ROLLOUTS, max_bytes: int = MEMO_BYTES) -> None:
        self.max_rollouts = max_rollouts
        self.max_bytes = max_bytes
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._bytes = 0  # what the kept prefixes hold
        self._lock = threading.Lock()  # stores encode in worker threads

    def prefix(self, rollout_id: str, ids: Sequence[int], block_size: int) -> tuple[Block, ...]:
        """The remembered whole blocks ``ids`` starts with (empty when it does not)."""
        return self.match(rollout_id, ids, block_size)[0]

    def match(
        self, rollout_id: str, ids: Sequence[int], block_size: int
    ) -> tuple[tuple[Block, ...], list[int] | None]:
        """The remembered whole blocks ``ids`` starts with (for a list all of them or none),
        and for a list a copy of the ids they cover: the slice the comparison needs anyway,
        which ``remember`` then extends instead of copying the whole context a second time."""
        with self._lock:
            known = self._known.get(rollout_id)
        if known is None or known[0] != block_size:
            return (), None
        _, prefix, blocks, _ = known
        if isinstance(ids, PackedIds) or isinstance(prefix, tuple):
            if not (isinstance(ids, PackedIds) and isinstance(prefix, tuple)):
                return (), None
            return blocks[: ids.shared_blocks(prefix, block_size * ID_WIDTH)], None
        if len(ids) < len(prefix):
            return (), None
        head = ids[: len(prefix)]
        head = head if isinstance(head, list) else list(head)
        if head != prefix:
            return (), None
        return blocks, head

    def remember(
        self,
        rollout_id: str,
        sequence: tuple[Sequence[int], bytes],
        chain: list[Block],
        block_size: int,
        head: list[int] | None = None,
    ) -> None:
        """Keep the whole-block prefix of ``sequence`` (prompt, packed generation): a
        ``PackedIds`` prompt's immutable bytes by reference, a list's ids as a list of our
        own (the caller's may change later). ``head``, a copy of the prompt's first ids that
        ``match`` made, is extended: a call costs the ids it adds, not a second copy."""
        prompt, generation = sequence
        whole = (len(prompt) + len(generation) // ID_WIDTH) // block_size
        size = whole * block_size
        prefix: list[int] | _Parts
        if isinstance(prompt, PackedIds):
            first = memoryview(prompt.data)[: size * ID_WIDTH]
            prefix = (first, memoryview(generation)[: size * ID_WIDTH - len(first)])
        else:
            prefix = head if head is not None and len(head) <= size else []
            if len(prefix) < size:
                prefix += prompt[len(prefix) : size]
                prefix += unpack_ids(generation[: (size - len(prefix)) * ID_WIDTH])
        blocks = tuple(chain[:whole])
        known = (block_size, prefix, blocks, _held_bytes(prefix, blocks))
        with self._lock:
            self._drop(rollout_id)
            self._known[rollout_id] = known
            self._bytes += known[3]
            while self._known and (
                len(self._known) > self.max_rollouts or self._bytes > self.max_bytes
            ):
                self._drop(next(iter(self._known)))

    def forget(self, rollout_id: str) -> None:
        with self._lock:
            self._drop(rollout_id)

    def _drop(self, rollout_id: str) -> None:
        """Forget one rollout; the lock is held."""
        known = self._known.pop(rollout_id, None)
        if known is not None:
            self._bytes -= known[3]


def _held_bytes(prefix: list[int] | _Parts, blocks: tuple[Block, ...]) -> int:
    """What a kept rollout holds: its prefix (packed bytes, or a list's pointer and int per
    id) and its blocks, each with its own copy of its ids."""
    held = sum(len(block.data) + BLOCK_BYTES for block in blocks)
    if isinstance(prefix, tuple):
        return held + sum(part.nbytes for part in prefix)
    return held + len(prefix) * LIST_ID_BYTES


def _packed_from(ids: Sequence[int], start: int) -> bytes:
    """The packed ids from ``start`` on: a slice of ``PackedIds``'s bytes, else one pack of
    a list slice (array's fast path; two packs and a join beat packing a chained iterator)."""
    if isinstance(ids, PackedIds):
        return ids.data[start * ID_WIDTH :] if start else ids.data
    return pack_ids(ids[start:] if start else ids)


def encode_entry(
    entry: Any, block_size: int = DEFAULT_BLOCK_SIZE, memo: ChainMemo | None = None
) -> EncodedEntry:
    """Encode an entry (or anything with its fields) into body, blocks and digest.

    With a ``memo``, the blocks of the prefix this writer encoded last time for the rollout
    are reused instead of packed and hashed again; the result is the same either way.
    """
    entry = TokenEntry.coerce(entry)
    chain, generation_bytes = _sequence_chain(entry, block_size, memo)
    log_probs = pack_floats(entry.generation_log_probs)
    routed = entry.routed_experts
    routed = routed if isinstance(routed, (Routes, ChainedRoutes)) else None
    # Extras kept; the id lists are not copied, and routes go into blocks of their own.
    fields = entry.model_dump(exclude=_PACKED | ({"routed_experts"} if routed else set()))
    prompt = entry.prompt_token_ids
    data = {
        "codec": CODEC_VERSION if routed is not None else CODEC_WITHOUT_ROUTES,
        "fields": fields,
        "prompt_len": len(prompt),
        "generated": len(entry.generation_token_ids),
        "tip": chain[-1].name if chain else "",
        "n_blocks": len(chain),
        "log_probs": log_probs,
    }
    routes: list[Block] = []
    requires: tuple[str, ...] = ()
    if routed is not None:
        routes, data["routes"], requires = cut_routes(routed, block_size)
    body = msgpack.packb(data, use_bin_type=True)
    hasher = hashlib.blake2b(len(prompt).to_bytes(8, "little"), digest_size=DIGEST_BYTES)
    hasher.update(_sequence_digest(prompt, generation_bytes, chain, block_size))
    hasher.update(log_probs)
    hasher.update(_canonical_rest(fields))
    if routed is not None:
        hasher.update(routes_digest(routed, data["routes"]["tip"], block_size, DEFAULT_BLOCK_SIZE))
    row_bytes = routed.row_bytes if routed is not None else 0
    return EncodedEntry(
        entry.model_call_id,
        body,
        tuple(chain),
        hasher.hexdigest(),
        block_size,
        tuple(routes),
        row_bytes,
        requires,
    )


def _sequence_chain(
    entry: TokenEntry, block_size: int, memo: ChainMemo | None
) -> tuple[list[Block], bytes]:
    """The chained blocks of the entry's prompt + generation, and the packed generation;
    the whole blocks a ``memo`` remembers for the rollout are reused, then it learns these."""
    prompt, generation = entry.prompt_token_ids, entry.generation_token_ids
    reused, head = (
        memo.match(entry.rollout_id, prompt, block_size) if memo is not None else ((), None)
    )
    start = len(reused) * block_size
    generation_bytes = pack_ids(generation)
    rest = _packed_from(prompt, start) + generation_bytes
    chain = [*reused, *cut(rest, block_size, bytes.fromhex(reused[-1].name) if reused else ROOT)]
    if memo is not None:
        memo.remember(entry.rollout_id, (prompt, generation_bytes), chain, block_size, head)
    return chain, generation_bytes


def _sequence_digest(
    prompt: Sequence[int], generation_bytes: bytes, chain: list[Block], block_size: int
) -> bytes:
    """The sequence's part of a payload digest: its chain tip at the default block size.

    Not the store's block size, so writers with any block size agree; at the default size
    (the usual case) the ids are hashed once, for the chain, and not a second time here.
    """
    if block_size == DEFAULT_BLOCK_SIZE:
        canonical = chain
    else:
        canonical = cut(pack_ids(prompt) + generation_bytes, DEFAULT_BLOCK_SIZE)
    return canonical[-1].name.encode() if canonical else b"-"


def read_body(body: bytes) -> dict[str, Any]:
    """A stored body's fields (``prompt_len``, ``generated``, ``tip``...), version-checked."""
    data = msgpack.unpackb(body, raw=False)
    if data.get("codec", 0) > CODEC_VERSION:
        raise ValueError(
            f"entry body has codec {data['codec']}, this tokcap reads up to {CODEC_VERSION}"
        )
    return data


def decode_entries(
    bodies: Iterable[bytes],
    blocks: Mapping[str, bytes],
    *,
    trusted: bool = False,
    shared: bool = False,
) -> list[TokenEntry]:
    """Decode every entry of one snapshot, sharing the work between them; input order kept.

    Shorter chains are decoded first, so each entry continues the sequence its parent call
    already assembled: a chain's calls share one id list (see ``_assemble``). With
    ``shared`` (and ``trusted``) the entries' ids are views of it (see ``decode_entry``).
    """
    bodies = list(bodies)
    order = sorted(range(len(bodies)), key=lambda i: read_body(bodies[i])["n_blocks"])
    cache: dict[Any, Any] = {}
    decoded: dict[int, TokenEntry] = {}
    for index in order:
        decoded[index] = decode_entry(
            bodies[index], blocks, cache=cache, trusted=trusted, shared=shared
        )
    return [decoded[index] for index in range(len(bodies))]


def _place(sequence: array[int], at: int, ids: array[int]) -> array[int]:
    """``sequence`` with ``ids`` at ``at``: the same array when what it holds there agrees
    (it is extended past its end), else a new one (a branch: the prefix is copied once)."""
    held = len(sequence) - at
    if held <= 0:
        sequence.extend(ids)
        return sequence
    overlap = min(held, len(ids))
    if sequence[at : at + overlap] == ids[:overlap]:
        if len(ids) > overlap:
            sequence.extend(ids[overlap:])
        return sequence
    branch = sequence[:at]
    branch.extend(ids)
    return branch


def _assemble(
    tip: str, count: int, blocks: Mapping[str, bytes], cache: dict[Any, Any]
) -> tuple[array[int], int]:
    """An array whose first ``length`` ids are the chain ending in ``tip``, and ``length``.

    Every block assembled is recorded with the list and the length it ends at, so the walk
    back from a tip stops at the longest prefix an earlier entry of this snapshot already
    assembled, and continues that same array: a chain's calls share one sequence, and each
    entry costs the blocks it adds, not its whole prompt. Ids stay packed (``array("I")``)
    until a reader asks for ints.
    """
    names: list[str] = []
    name = tip
    sequence = array("I")
    length = 0
    while len(names) < count:
        known = cache.get(("seq", name))
        if known is not None:
            sequence, length, depth = known
            if depth + len(names) != count:
                raise ValueError(f"block chain ending in {tip} does not have {count} blocks")
            break
        names.append(name)
        name = cached_parent(name, blocks, cache)
    else:
        if count and name != ROOT_NAME:
            raise ValueError(f"block chain ending in {tip} is longer than its {count} blocks")
    depth = count - len(names)
    for name in reversed(names):
        ids = ids_array(block_ids(name, blocks, cache))
        sequence = _place(sequence, length, ids)
        length += len(ids)
        depth += 1
        cache["seq", name] = (sequence, length, depth)
    return sequence, length


def decode_entry(
    body: bytes,
    blocks: Mapping[str, bytes],
    *,
    cache: dict[Any, Any] | None = None,
    trusted: bool = False,
    shared: bool = False,
) -> TokenEntry:
    """Rebuild an entry from its body and a lookup of the rollout's stored blocks.

    Entries of one rollout share most of their blocks: a ``cache`` shared across one snapshot
    resolves each block once, and entries of one chain share one sequence of ids (``_assemble``).
    ``trusted`` skips re-validation for bodies this codec wrote after validating them, which
    dominates freeze time on long rollouts. ``shared`` (with ``trusted``) hands the id
    fields as ``IdView``s of the sequence the entry's chain shares instead of lists of their
    own: a long rollout's prompts then cost one sequence per chain, not one per call, and the
    builder links calls by identity. Readers that promise plain lists leave it off.
    """
    data = read_body(body)
    cache = {} if cache is None else cache
    sequence, length = _assemble(data["tip"], data["n_blocks"], blocks, cache)
    prompt_len, generated = data["prompt_len"], data["generated"]
    if length != prompt_len + generated:
        raise ValueError(
            f"stored sequence has {length} ids but the entry says {prompt_len} + {generated}"
        )
    prompt, generation = IdView(sequence, 0, prompt_len), IdView(sequence, prompt_len, length)
    fields = {**data["fields"], "generation_log_probs": unpack_floats(data["log_probs"])}
    if "routes" in data:
        fields["routed_experts"] = routes_from_blocks(data["routes"], blocks, cache)
    if not (trusted and shared):
        fields.update(prompt_token_ids=prompt.tolist(), generation_token_ids=generation.tolist())
    else:
        fields.update(prompt_token_ids=prompt, generation_token_ids=generation)
    if trusted and fields.get("schema_version", 1) <= SCHEMA_VERSION:
        return TokenEntry.model_construct(**fields)
    return TokenEntry.model_validate(fields)
