"""How a put decides: the rollout's state and the blocks it lacks, read under WATCH.

A put sends only the blocks the hash does not hold yet. In the WATCH round trip it asks
about each block it does not know to be held (HEXISTS downloads nothing) and for the tail
the first of them may extend. What this process wrote before is remembered per rollout
together with the hash's epoch, a random field set by the first put and gone with the hash:
a memory of a hash that was deleted and made anew is noticed by its epoch and dropped.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capture.codec.entries import EncodedEntry
from capture.errors import ConflictingEntryError, RolloutFrozenError
from capture.reasons import CONFLICTING_PAYLOAD
from transports.redis import keys as k
from transports.redis.durability import Durability
from transports.redis.plans import Command, Plan, mark_lost, next_version


@dataclass(frozen=True)
class Known:
    """Block names a rollout's hash holds, as long as its epoch is still ``epoch``."""

    epoch: bytes
    names: frozenset[str]


class KnownBlocks:
    """What this process knows of the last ``size`` rollouts it wrote; oldest out first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._known: OrderedDict[str, Known] = OrderedDict()

    def get(self, rollout_id: str) -> Known | None:
        return self._known.get(rollout_id)

    def forget(self, rollout_id: str) -> None:
        self._known.pop(rollout_id, None)

    def remember(self, rollout_id: str, known: Known) -> None:
        self._known[rollout_id] = known
        self._known.move_to_end(rollout_id)
        if len(self._known) > self._size:
            self._known.popitem(last=False)


@dataclass(frozen=True)
class PutState:
    """What the WATCH round trip of a put answered."""

    version: bytes | None
    frozen: bool
    digest: bytes | None  # of the payload stored for this call, if any
    epoch: bytes | None
    tail: bytes | None  # the tail stored under the asked parent
    held: frozenset[str]  # the asked blocks the hash holds

    @classmethod
    def read(cls, asked: tuple[str, ...], replies: list[Any]) -> PutState:
        (version, frozen, digest, epoch, tail), present = replies[0], replies[1:]
        held = frozenset(name for name, there in zip(asked, present, strict=True) if there)
        return cls(version, frozen == b"1", digest, epoch, tail, held)


@dataclass(frozen=True)
class Put:
    """One put as an operation (``transports.redis.plans.Operation``).

    Its result is the new ``Known`` of the rollout, or None when what this process knew
    turned out stale: nothing was decided, and the put must ask again without it.
    """

    rollout_id: str
    entry: EncodedEntry
    known: Known | None
    asked: tuple[str, ...]  # blocks not known to be held
    tail_parent: str  # the block whose tail the first asked block may extend
    durability: Callable[[], Durability]  # the latest proof, read when deciding

    @classmethod
    def of(
        cls,
        rollout_id: str,
        entry: EncodedEntry,
        known: Known | None,
        durability: Callable[[], Durability],
    ) -> Put:
        held = known.names if known else frozenset()
        asked = tuple(name for name in entry.block_names if name not in held)
        return cls(rollout_id, entry, known, asked, entry.tail_parent(held), durability)

    def reads(self, key: str) -> list[Command]:
        call_id = self.entry.model_call_id
        state = (
            "HMGET",
            key,
            k.VERSION,
            k.FROZEN,
            k.field(k.DIGEST, call_id),
            k.EPOCH,
            k.field(k.TAIL, self.tail_parent),
        )
        return [state, *(("HEXISTS", key, k.field(k.BLOCK, name)) for name in self.asked)]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        state = PutState.read(self.asked, replies)
        if state.frozen:
            return Plan(
                error=RolloutFrozenError(
                    f"rollout {self.rollout_id} is frozen; "
                    f"call {self.entry.model_call_id} came too late"
                )
            )
        if self.known and state.epoch != self.known.epoch:
            return Plan(result=None)  # the hash was deleted and made anew since we wrote
        epoch = state.epoch or uuid.uuid4().hex.encode()
        names = frozenset(self.entry.block_names) | (self.known.names if self.known else set())
        known = Known(epoch, names)
        digest = self.entry.digest.encode()
        if state.digest == digest:
            # The same payload again. Its first write may have lost its connection before
            # the durability wait answered, so where a wait proves durability, rewrite one
            # unchanged field: waiting for that later write covers the earlier one.
            touch = [("HSET", key, k.EPOCH, epoch)] if self.durability().wait else []
            return Plan(writes=touch, result=known)
        if state.digest is not None:
            return self._conflict(key, state)
        return Plan(writes=[self._store(key, state, epoch)], result=known)

    def _conflict(self, key: str, state: PutState) -> Plan:
        call_id = self.entry.model_call_id
        return Plan(
            writes=[mark_lost(key, call_id, CONFLICTING_PAYLOAD, state.version)],
            error=ConflictingEntryError(
                f"rollout {self.rollout_id}: call {call_id} was already stored with "
                "a different payload; the rollout is now marked incomplete"
            ),
        )

    def _store(self, key: str, state: PutState, epoch: bytes) -> Command:
        """The entry, and only the blocks and tails the hash lacks (the codec decides)."""
        held = state.held | (self.known.names if self.known else set())
        writes = self.entry.plan(held, {self.tail_parent: state.tail} if state.tail else {})
        fields: list[Any] = [
            k.VERSION,
            next_version(state.version),
            k.field(k.ENTRY, self.entry.model_call_id),
            self.entry.body,
            k.field(k.DIGEST, self.entry.model_call_id),
            self.entry.digest.encode(),
            k.EPOCH,
            epoch,
        ]
        for name, stored in writes.blocks:
            fields += [k.field(k.BLOCK, name), stored]
        for parent, value in writes.tails:
            fields += [k.field(k.TAIL, parent), value]
        return ("HSET", key, *fields)
