"""How a rollout is laid out in Redis: one hash per rollout, named with a Cluster hash tag.

The key is ``<prefix>:{<rollout_id>}``; the braces make Redis Cluster hash only the rollout
id, so every key of one rollout (today there is one) lives in one slot and one WATCH/MULTI
covers it. Inside the hash, state fields have fixed names and everything per call or per
block carries a one-letter kind prefix, so a field name alone says what it holds.
"""

from __future__ import annotations

import re
from typing import Any

# State fields: these survive a drop and form the tombstone.
VERSION = "version"
FROZEN = "frozen"
SNAPSHOT_ID = "snapshot_id"
INCOMPLETE = "incomplete"
RETIRED = "retired"
RETIRED_AT = "retired_at"
STATE_FIELDS = (VERSION, FROZEN, SNAPSHOT_ID, INCOMPLETE, RETIRED, RETIRED_AT)
# Random, set by the first put and gone when the hash is: a writer's cache of the block
# names a hash holds is valid only while the epoch it saw is still there.
EPOCH = "epoch"

# Per-call and per-block fields, by kind.
ENTRY = "e:"  # e:<model_call_id> -> the codec body
DIGEST = "d:"  # d:<model_call_id> -> payload digest (idempotency check)
INTENT = "i:"  # i:<model_call_id> -> OPEN or VOID
MARK = "m:"  # m:<model_call_id> -> why the call was lost ("" call id: the rollout as a whole)
UNRECEIVED = "u:"  # u:<model_call_id> -> 1: the harness never received this call's reply
BLOCK = "b:"  # b:<block name> -> a stored block of the codec (see capture.codec.blocks)
TAIL = "t:"  # t:<parent block name> -> the codec tail: the partial block a later call may extend

INTENT_OPEN = b"open"
INTENT_VOID = b"void"

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def rollout_key(prefix: str, rollout_id: str) -> str:
    return f"{prefix}:{{{rollout_id}}}"


def rollout_pattern(prefix: str) -> str:
    """A SCAN pattern matching every rollout hash under ``prefix``."""
    return _GLOB_SPECIAL.sub(r"\\\1", prefix) + ":{*}"


def rollout_id_of(prefix: str, key: str) -> str | None:
    """The rollout id a key names, or None if the key is not a rollout hash of ``prefix``."""
    head = prefix + ":{"
    if key.startswith(head) and key.endswith("}"):
        return key[len(head) : -1]
    return None


def field(kind: str, name: str) -> str:
    return kind + name


def split_field(name: bytes) -> tuple[str, str]:
    """``b"e:call-1"`` -> ``("e:", "call-1")``; a state field -> ``("", name)``."""
    text = name.decode()
    if len(text) > 1 and text[1] == ":":
        return text[:2], text[2:]
    return "", text


def as_text(value: Any) -> str:
    """A reply or stream field as text (redis-py hands back bytes unless told to decode)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
