"""What the records of a rollout's log mean: the folded state, and entries read back.

A log holds a head, then one record per state change: ``put`` (an entry), ``lost`` (a
mark_incomplete), ``intent``, ``void``, ``unreceived`` (a reply the harness never got),
``freeze``; a dropped rollout's log is rewritten to a
head and a ``tomb``. The version is the number of state changes since the log began (a tomb
restores the dropped snapshot's version).

A ``put`` stores exactly the shared codec's form: the entry's body, the blocks the rollout
lacks (whole, or as extensions of an earlier partial block) and the tails they set, as the
codec's ``EncodedEntry.plan`` decides from the blocks and tails the folded state holds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from capture.codec.entries import EncodedEntry, decode_entries
from capture.reasons import MARKED_INCOMPLETE, call_reason
from capture.records import TokenEntry

LOG_FORMAT = 2


@dataclass
class RolloutState:
    """What a rollout's log says, folded record by record."""

    version: int = 0
    calls: dict[str, str] = field(default_factory=dict)  # model_call_id -> payload digest
    blocks: set[str] = field(default_factory=set)
    tails: dict[str, bytes] = field(default_factory=dict)  # parent name -> codec tail value
    intents: set[str] = field(default_factory=set)
    voided: set[str] = field(default_factory=set)
    unreceived: set[str] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)  # why the rollout is incomplete
    frozen: bool = False
    snapshot_id: str = ""
    retired: bool = False
    retired_at: float = 0.0
    prompt_tokens_max: int = 0
    generated_tokens: int = 0

    @property
    def pending_intents(self) -> list[str]:
        return sorted(self.intents - self.calls.keys() - self.voided - self.unreceived)

    @property
    def incomplete(self) -> bool:
        return bool(self.lost)

    def apply(self, record: dict[str, Any]) -> None:
        kind = record["k"]
        if kind == "head":
            return
        if kind == "tomb":
            # Only ever the first record after the head of a fresh log (drop rewrites the log).
            # It keeps the dropped snapshot's name, so its version is restored as is.
            self.version = record["version"]
            self.frozen = self.retired = True
            self.snapshot_id = record["snapshot_id"]
            self.retired_at = record["at"]
            self.lost = list(record.get("lost", ()))
            return
        self.version += 1
        call = record.get("call", "")
        if kind == "put":
            self.calls[call] = record["digest"]
            self._add_blocks(record)
            self.prompt_tokens_max = max(self.prompt_tokens_max, record["prompt_len"])
            self.generated_tokens += record["generated"]
        elif kind == "lost":
            self.lost.append(record.get("reason") or call_reason(call, MARKED_INCOMPLETE))
        elif kind == "intent":
            self.intents.add(call)
        elif kind == "void":
            self.voided.add(call)
        elif kind == "unreceived":
            self.unreceived.add(call)
        elif kind == "freeze":
            self.frozen = True
            self.snapshot_id = record["snapshot_id"]

    def _add_blocks(self, record: dict[str, Any]) -> None:
        for name, _ in record["blocks"]:
            self.blocks.add(name)
        for parent, tail in record["tails"]:
            self.tails[parent] = tail


def head_record(rollout_id: str) -> dict[str, Any]:
    """The first record of every log; its random id tells a rewritten log from the old one."""
    return {
        "k": "head",
        "format": LOG_FORMAT,
        "rollout_id": rollout_id,
        "log_id": uuid.uuid4().hex,
        "at": time.time(),
    }


def put_record(entry: TokenEntry, encoded: EncodedEntry, state: RolloutState) -> dict[str, Any]:
    """The record of a new entry: its body, and only the blocks and tails the rollout lacks."""
    writes = encoded.plan(state.blocks, state.tails)
    return {
        "k": "put",
        "call": entry.model_call_id,
        "digest": encoded.digest,
        "body": encoded.body,
        "blocks": writes.blocks,
        "tails": writes.tails,
        "prompt_len": len(entry.prompt_token_ids),
        "generated": len(entry.generation_token_ids),
    }


def stored_entries(records: Iterable[dict[str, Any]]) -> tuple[list[bytes], dict[str, bytes]]:
    """The entry bodies a log's records hold, and every block they stored, in codec form."""
    bodies: list[bytes] = []
    blocks: dict[str, bytes] = {}
    for record in records:
        if record["k"] == "put":
            bodies.append(record["body"])
            blocks.update(record["blocks"])
    return bodies, blocks


def entries_from_records(records: Iterable[dict[str, Any]]) -> list[TokenEntry]:
    """Every entry a log's records hold, decoded by the shared codec; a chain's calls share
    one id sequence (their ids are views of it), so a long rollout's freeze holds its final
    context about once, not once per call."""
    bodies, blocks = stored_entries(records)
    return decode_entries(bodies, blocks, trusted=True, shared=True)
