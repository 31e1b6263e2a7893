"""What each state change of a rollout reads under WATCH, and what it decides from that.

An operation is two pure steps: ``reads(key)``, the commands sent with WATCH in one round
trip, and ``decide(key, replies)``, the Plan made of their replies (writes to commit, then a
result or an error). Nothing here talks to Redis; ``transports.redis.watch.attempt`` runs
one operation as a transaction and the store retries it when it loses the race. A put and
an intent are server-side scripts instead (``transports.redis.put``, ``.intent``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from capture.errors import RolloutFrozenError
from capture.reasons import MARKED_INCOMPLETE
from transports.redis import keys as k

Command = Sequence[Any]


@dataclass
class Plan:
    """What one transaction decided: writes to commit, then a result or an error to raise."""

    writes: list[Command] = field(default_factory=list)
    result: Any = None
    error: Exception | None = None


class Operation(Protocol):
    """One state change: what it reads under WATCH, and the Plan it makes of the replies."""

    def reads(self, key: str) -> Sequence[Command]: ...

    def decide(self, key: str, replies: list[Any]) -> Plan: ...


def as_int(value: bytes | None) -> int:
    return int(value) if value else 0


def pairs(reply: Any) -> dict[bytes, bytes]:
    """An HGETALL reply as a dict, whether redis-py parsed it or not."""
    if isinstance(reply, dict):
        return dict(reply)
    return dict(zip(reply[0::2], reply[1::2], strict=True))


def next_version(version: bytes | None) -> int:
    """Every state change advances the version, so a drop of an older snapshot fails."""
    return as_int(version) + 1


def mark_lost(key: str, model_call_id: str, what: str, version: bytes | None) -> Command:
    """The write that marks the rollout incomplete and says what happened to the call."""
    mark = k.field(k.MARK, model_call_id)
    return ("HSET", key, k.INCOMPLETE, 1, mark, what, k.VERSION, next_version(version))


@dataclass(frozen=True)
class MarkIncomplete:
    """Note a lost call (or, with no call id, the whole rollout); allowed after freeze."""

    model_call_id: str

    def reads(self, key: str) -> list[Command]:
        return [("HMGET", key, k.VERSION)]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        (version,) = replies[0]
        return Plan(writes=[mark_lost(key, self.model_call_id, MARKED_INCOMPLETE, version)])


@dataclass(frozen=True)
class MarkUnreceived:
    """Note that the harness never received a call's reply; refused after freeze."""

    rollout_id: str
    model_call_id: str

    def reads(self, key: str) -> list[Command]:
        return [("HMGET", key, k.VERSION, k.FROZEN, k.field(k.UNRECEIVED, self.model_call_id))]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        version, frozen, current = replies[0]
        if frozen == b"1":
            return Plan(
                error=RolloutFrozenError(
                    f"rollout {self.rollout_id} is frozen; the note that call "
                    f"{self.model_call_id} went unreceived is too late"
                )
            )
        if current is not None:
            return Plan()
        mark = k.field(k.UNRECEIVED, self.model_call_id)
        return Plan(writes=[("HSET", key, mark, 1, k.VERSION, next_version(version))])


@dataclass(frozen=True)
class Freeze:
    """Stop all writes; the result is (every field, version, snapshot id) of the snapshot."""

    evidence_ttl_s: float | None

    def reads(self, key: str) -> list[Command]:
        return [("HGETALL", key)]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        fields = pairs(replies[0])
        state = {name: fields.get(name.encode()) for name in k.STATE_FIELDS}
        if state[k.FROZEN] == b"1":
            # Frozen already, maybe by an earlier try whose durability wait failed: rewrite
            # the unchanged flag, so the wait that follows covers that freeze too.
            result = (fields, as_int(state[k.VERSION]), state[k.SNAPSHOT_ID])
            return Plan(writes=[("HSET", key, k.FROZEN, 1)], result=result)
        snapshot_id = state[k.SNAPSHOT_ID] or uuid.uuid4().hex.encode()
        version = next_version(state[k.VERSION])
        writes = [("HSET", key, k.FROZEN, 1, k.SNAPSHOT_ID, snapshot_id, k.VERSION, version)]
        if self.evidence_ttl_s is not None:
            # Retiring replaces this with the tombstone's TTL; a rollout never retired
            # (a masked one, kept as evidence) still leaves memory in the end.
            writes.append(("PEXPIRE", key, max(1, int(self.evidence_ttl_s * 1000))))
        return Plan(writes=writes, result=(fields, version, snapshot_id))


@dataclass(frozen=True)
class Drop:
    """Retire exactly one snapshot, leaving its state as a tombstone; False if it changed."""

    snapshot_id: str
    version: int
    tombstone_ttl_s: float

    def reads(self, key: str) -> list[Command]:
        return [("HMGET", key, k.VERSION, k.FROZEN, k.SNAPSHOT_ID, k.RETIRED, k.INCOMPLETE)]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        current, frozen, stored_id, retired, incomplete = replies[0]
        same = (
            frozen == b"1"
            and stored_id is not None
            and stored_id.decode() == self.snapshot_id
            and as_int(current) == self.version
        )
        if not same:
            return Plan(result=False)
        if retired == b"1":
            return Plan(result=True)  # this very snapshot was already retired
        tombstone = {
            k.VERSION: self.version,
            k.FROZEN: 1,
            k.SNAPSHOT_ID: self.snapshot_id,
            k.INCOMPLETE: as_int(incomplete),
            k.RETIRED: 1,
            k.RETIRED_AT: time.time(),
        }
        ttl_ms = max(1, int(self.tombstone_ttl_s * 1000))
        hset = ("HSET", key, *(item for pair in tombstone.items() for item in pair))
        return Plan(writes=[("DEL", key), hset, ("PEXPIRE", key, ttl_ms)], result=True)


@dataclass(frozen=True)
class SweepOne:
    """Delete a tombstone retired more than ``older_than_s`` ago; True if it was deleted."""

    older_than_s: float

    def reads(self, key: str) -> list[Command]:
        return [("HMGET", key, k.RETIRED, k.RETIRED_AT)]

    def decide(self, key: str, replies: list[Any]) -> Plan:
        retired, retired_at = replies[0]
        if retired != b"1" or time.time() - float(retired_at or 0) < self.older_than_s:
            return Plan(result=False)
        return Plan(writes=[("DEL", key)], result=True)
