"""What the records of a rollout's log mean: the folded state, and entries read back.

A log holds a head, then one record per state change: ``put`` (an entry), ``lost`` (a
mark_incomplete), ``intent``, ``void``, ``freeze``; a dropped rollout's log is rewritten to a
head and a ``tomb``. The version is the number of state changes since the log began (a tomb
restores the dropped snapshot's version).

A ``put`` stores the entry's codec body and only the prompt blocks the rollout lacks. Two
things keep the bytes on disk growing with the final context rather than turns x context:
the body's list of block names is dropped (names are chained hashes, so the last name and
each block's parent determine the list), and a block that extends the last, partial block
of an earlier prompt under the same parent is stored as just the extra tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from capture.codec import EncodedEntry, decode_entry
from capture.records import TokenEntry

LOG_FORMAT = 1


@dataclass
class RolloutState:
    """What a rollout's log says, folded record by record."""

    version: int = 0
    calls: dict[str, str] = field(default_factory=dict)  # model_call_id -> payload digest
    blocks: set[str] = field(default_factory=set)
    # parent block name -> (name, bytes) of the last prompt-ending block stored under it
    tails: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    intents: set[str] = field(default_factory=set)
    voided: set[str] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)  # why the rollout is incomplete
    frozen: bool = False
    snapshot_id: str = ""
    retired: bool = False
    retired_at: float = 0.0
    prompt_tokens_max: int = 0
    generated_tokens: int = 0

    @property
    def pending_intents(self) -> list[str]:
        return sorted(self.intents - self.calls.keys() - self.voided)

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
            self.lost.append(record.get("reason") or f"call {call} was marked incomplete")
        elif kind == "intent":
            self.intents.add(call)
        elif kind == "void":
            self.voided.add(call)
        elif kind == "freeze":
            self.frozen = True
            self.snapshot_id = record["snapshot_id"]

    def _add_blocks(self, record: dict[str, Any]) -> None:
        for block in record["blocks"]:
            self.blocks.add(block[0])
        if record["blocks"] and record["blocks"][-1][0] == record["tip"]:
            name, parent, data = _block_bytes(record["blocks"][-1], self.tails)
            self.tails[parent] = (name, data)


def _block_bytes(
    block: list[Any], tails: dict[str, tuple[str, bytes]]
) -> tuple[str, str, bytes]:
    """(name, parent, full bytes) of a stored block, resolving a stored extension."""
    if len(block) == 3:
        return block[0], block[1], block[2]
    name, parent, extra, extends = block
    base_name, base = tails[parent]
    if base_name != extends:
        raise ValueError(f"block {name} extends {extends}, but the log's tail there is {base_name}")
    return name, parent, base + extra


def head_record(rollout_id: str) -> dict[str, Any]:
    """The first record of every log; its random id tells a rewritten log from the old one."""
    return {"k": "head", "format": LOG_FORMAT, "rollout_id": rollout_id,
            "log_id": uuid.uuid4().hex, "at": time.time()}


def put_record(entry: TokenEntry, encoded: EncodedEntry, state: RolloutState) -> dict[str, Any]:
    """The record of a new entry: its body, and only the blocks the rollout lacks."""
    body = msgpack.unpackb(encoded.body, raw=False)
    names = body["prompt_blocks"]
    body["prompt_blocks"] = []  # rebuilt from the tip and the parent links at read time
    parents = ["", *names][: len(names)]
    blocks: list[list[Any]] = []
    for (name, data), parent in zip(encoded.blocks, parents, strict=True):
        if name in state.blocks:
            continue
        tail = state.tails.get(parent)
        if tail and len(data) > len(tail[1]) and data.startswith(tail[1]):
            blocks.append([name, parent, data[len(tail[1]):], tail[0]])
        else:
            blocks.append([name, parent, data])
    return {
        "k": "put",
        "call": entry.model_call_id,
        "digest": encoded.digest,
        "body": msgpack.packb(body, use_bin_type=True),
        "tip": names[-1] if names else "",
        "n_blocks": len(names),
        "blocks": blocks,
        "prompt_len": len(entry.prompt_token_ids),
        "generated": len(entry.generation_token_ids),
    }


def entries_from_records(records: Iterable[dict[str, Any]]) -> list[TokenEntry]:
    """Every entry a log's records hold, decoded by the shared codec."""
    puts: list[dict[str, Any]] = []
    blocks: dict[str, bytes] = {}
    parents: dict[str, str] = {}
    tails: dict[str, tuple[str, bytes]] = {}
    for record in records:
        if record["k"] != "put":
            continue
        puts.append(record)
        for block in record["blocks"]:
            name, parent, data = _block_bytes(block, tails)
            blocks[name] = data
            parents[name] = parent
        if record["blocks"] and record["blocks"][-1][0] == record["tip"]:
            tip = record["tip"]
            tails[parents[tip]] = (tip, blocks[tip])
    entries = []
    cache: dict[str, list[int]] = {}  # blocks shared by the entries are unpacked once
    for record in puts:
        body = msgpack.unpackb(record["body"], raw=False)
        body["prompt_blocks"] = _chain(record["tip"], record["n_blocks"], parents)
        entries.append(
            decode_entry(msgpack.packb(body, use_bin_type=True), blocks, cache=cache, trusted=True)
        )
    return entries


def _chain(tip: str, length: int, parents: dict[str, str]) -> list[str]:
    """The block names ending in ``tip``, first block first, found through parent links."""
    names = []
    name = tip
    while name and len(names) < length:
        names.append(name)
        name = parents.get(name, "")
    if len(names) != length:
        raise ValueError(f"prompt block chain ending in {tip} has {len(names)} of {length} blocks")
    return names[::-1]
