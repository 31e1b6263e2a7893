"""How a put decides and writes: one server-side script, usually one round trip.

The script (``PUT_SCRIPT``) reads the rollout's state and writes the entry atomically, so a
put needs no WATCH and never loses a race: a frozen rollout refuses it; the same payload
again is a no-op; a different payload for the same call marks the rollout incomplete; else
the entry is written with the blocks the hash lacks. Blocks are content-addressed, and a
put sends only those it does not know to be held: what this process wrote before is
remembered per rollout with the hash's epoch (a random field set by the first put and gone
with the hash), and the script refuses a put planned on an epoch that is no longer there.

A block is sent with its stored bytes, or by name only when this process cannot tell
whether the hash holds it (a long prompt first seen here, say written by another front
end). A block the script finds missing without its bytes, or sent as an extension of a tail
the hash no longer holds, makes the script write nothing and answer what it lacks; the put
then plans again from that answer (``Put.replan``). Usually a put knows its rollout and
takes one round trip; the first put of a long rollout in this process takes two.

Routes that continue a stored prefix (``EncodedEntry.requires``) send the prefix's tip by
name: a rollout that does not hold it answers it lacking, and that put fails for good
(``RoutesPrefixError``): its bytes are not this process's to send.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from capture.codec.blocks import parent_of
from capture.codec.entries import EncodedEntry
from capture.reasons import CONFLICTING_PAYLOAD
from transports.redis import keys as k
from transports.redis.durability import Durability

# Sending bytes the hash may hold costs less than a round trip up to about this much; an
# unknown rollout's longer entry is asked about by name first.
BLIND_SEND_BYTES = 32 * 1024
_KNOWN_TAILS = 8  # tails remembered per rollout: a retry or fork may extend an older one
_BLOCK_ARGS = 5  # script arguments per block (see PUT_SCRIPT), its name first

# KEYS[1]: the rollout hash. ARGV: call id, payload digest, body, epoch for a new hash,
# epoch the put was planned on ("" if none), touch ("1": rewrite the epoch when the payload
# is already stored, so the durability wait that follows covers the earlier write), the
# conflict reason, then 5 per block: name, parent name, tail it extends ("" if whole), its
# stored bytes ("" if not sent), the tail it sets under its parent ("" if none).
# Lua's false is a missing field. Writes go in chunks: unpack() has a stack limit. The reply
# is one word, with the epoch after "stored" and "same" (one string parses fastest), or the
# list "lacking", epoch, then the name of each block missing and the tail under its parent.
PUT_SCRIPT = """
local key = KEYS[1]
local call, digest, body, fresh, planned, touch, reason =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local state = redis.call('HMGET', key, 'version', 'frozen', 'd:' .. call, 'epoch')
local version, frozen, stored, epoch = state[1], state[2], state[3], state[4]
if frozen == '1' then return 'frozen' end
if planned ~= '' and epoch ~= planned then return 'stale' end
if stored == digest then
  if touch == '1' then redis.call('HSET', key, 'epoch', epoch) end
  return 'same ' .. epoch
end
local nextv = (tonumber(version) or 0) + 1
if stored then
  redis.call('HSET', key, 'incomplete', 1, 'm:' .. call, reason, 'version', nextv)
  return 'conflict'
end
local writes, lacking = {}, {}
for i = 8, #ARGV, 5 do
  local name, parent, extends, value, tail = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  if redis.call('HEXISTS', key, 'b:' .. name) == 0 then
    local held = ''
    if value == '' or extends ~= '' then held = redis.call('HGET', key, 't:' .. parent) or '' end
    if value == '' or (extends ~= '' and held ~= extends) then
      lacking[#lacking + 1] = name
      lacking[#lacking + 1] = held
    else
      writes[#writes + 1] = 'b:' .. name
      writes[#writes + 1] = value
      if tail ~= '' then
        writes[#writes + 1] = 't:' .. parent
        writes[#writes + 1] = tail
      end
    end
  end
end
if #lacking > 0 then
  return {'lacking', epoch or '', unpack(lacking)}
end
epoch = epoch or fresh
redis.call('HSET', key, 'version', nextv, 'e:' .. call, body, 'd:' .. call, digest, 'epoch', epoch)
for i = 1, #writes, 1000 do
  redis.call('HSET', key, unpack(writes, i, math.min(i + 999, #writes)))
end
return 'stored ' .. epoch
"""
PUT_SHA = hashlib.sha1(PUT_SCRIPT.encode()).hexdigest()


@dataclass(frozen=True)
class Known:
    """Block names a rollout's hash holds, and tails it was seen to hold, under ``epoch``.

    ``names`` only grows while the epoch lasts: each put adds the names it sent to the same
    set (``Put.learned``) instead of copying every name of a long chain again.
    """

    epoch: bytes
    names: set[str]
    tails: dict[str, bytes] = field(default_factory=dict)  # parent name -> tail value


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
class Put:
    """One attempt at a put: the script's arguments, planned on what this process knows.

    ``known`` is what the plan assumed held (its epoch is checked by the script); blocks not
    in it are sent with their bytes, or by name when nothing is known and they are many
    (``BLIND_SEND_BYTES``).
    """

    entry: EncodedEntry
    known: Known | None
    blocks: tuple[Any, ...]  # _BLOCK_ARGS script arguments per block sent, its name first
    tails: dict[str, bytes]  # the tails planned on, and those this put sets
    by_name: frozenset[str] = frozenset()  # blocks sent without their bytes

    @classmethod
    def plan(cls, entry: EncodedEntry, known: Known | None) -> Put:
        """Send what ``known`` does not hold; an unknown long entry goes by name first."""
        every = entry.every_block
        if known is None and sum(len(block.data) for block in every) > BLIND_SEND_BYTES:
            blocks = [(b.name, b.parent.hex(), b"", b"", b"") for b in every]
            names = frozenset(entry.block_names)
            return cls(entry, None, _flat(blocks) + _required(entry), {}, names)
        return cls._with_bytes(entry, known)

    @classmethod
    def _with_bytes(cls, entry: EncodedEntry, known: Known | None) -> Put:
        held = known.names if known else frozenset()
        tails = dict(known.tails) if known else {}
        writes = entry.plan(held, tails)
        sets = dict(writes.tails)  # parent -> the tail this put sets there
        blocks = []
        for name, stored in writes.blocks:
            parent = parent_of(stored)
            extends = tails.get(parent, b"") if stored[:1] == b"x" else b""
            blocks.append((name, parent, extends, stored, sets.get(parent, b"")))
        tails.update(sets)
        return cls(entry, known, _flat(blocks) + _required(entry), tails)

    def lacks_required(self, reply: list[bytes]) -> str | None:
        """The first block of ``requires`` a ``lacking`` reply names, or None."""
        lacking = {name.decode() for name in reply[2::2]}
        return next((name for name in self.entry.requires if name in lacking), None)

    def replan(self, reply: list[bytes]) -> Put:
        """Plan again from a ``lacking`` reply: the blocks missing, the tails held now.

        Nothing was written. Blocks sent by name and not reported missing are held; those
        sent with their bytes are sent again (the script skips any held by then).
        """
        epoch, lacking = reply[1], reply[2:]
        parents = {block.name: block.parent.hex() for block in self.entry.every_block}
        missing = {name.decode() for name in lacking[0::2]}
        tails = dict(self.known.tails) if self.known else {}
        for name, tail in zip(lacking[0::2], lacking[1::2], strict=True):
            parent = parents[name.decode()]
            if tail:
                tails[parent] = tail
            else:
                tails.pop(parent, None)
        held = set(self.by_name - missing)
        if self.known:
            held |= self.known.names
        known = Known(epoch, held, tails) if epoch else None
        return Put._with_bytes(self.entry, known)

    def learned(self, epoch: bytes) -> Known:
        """What this process knows of the rollout once the entry is stored under ``epoch``.

        Under the epoch planned on, the chain is what ``known`` held (the plan sends the
        blocks after the last held one) and what this put sent, so only the names sent are
        added; a put then costs the blocks it adds, not the chain's length.
        """
        if self.known is not None and self.known.epoch == epoch:
            names = self.known.names
            names.update(self.blocks[0::_BLOCK_ARGS])
        else:
            names = set(self.entry.block_names)
        tails = self.tails
        if len(tails) > _KNOWN_TAILS:
            tails = dict(list(tails.items())[-_KNOWN_TAILS:])
        return Known(epoch, names, tails)

    def args(self, durability: Durability) -> tuple[Any, ...]:
        """The script's arguments. Where a wait proves durability, a put of a payload already
        stored rewrites one unchanged field: its first write may have lost its connection
        before the wait answered, and waiting for the later write covers the earlier one."""
        entry = self.entry
        head = (
            entry.model_call_id,
            entry.digest,
            entry.body,
            uuid.uuid4().hex,
            self.known.epoch if self.known else b"",
            b"1" if durability.wait else b"",
            CONFLICTING_PAYLOAD,
        )
        return head + self.blocks


def _flat(blocks: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    return tuple(item for block in blocks for item in block)


def _required(entry: EncodedEntry) -> tuple[Any, ...]:
    """The blocks the rollout must hold already, sent by name only (no parent, no tail)."""
    return _flat([(name, "", b"", b"", b"") for name in entry.requires])


# The script's field names must be the keys module's.
assert (k.VERSION, k.FROZEN, k.EPOCH, k.INCOMPLETE) == ("version", "frozen", "epoch", "incomplete")
assert (k.ENTRY, k.DIGEST, k.MARK, k.BLOCK, k.TAIL) == ("e:", "d:", "m:", "b:", "t:")
