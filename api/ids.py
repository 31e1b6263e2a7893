"""The ids this server makes: of a reply, of its output items, of a tool call.

Every room names things with them (a dialect its reply, the engine room a tool call the
engine left unnamed, the capture step the items it stores), so they belong to none.
"""

from __future__ import annotations

import uuid

ID_HEX = 24  # the random hex digits of an id this server makes


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:ID_HEX]}"


def item_id(prefix: str, reply_id: str, index: int | None = None) -> str:
    """The id of one Responses output item of a reply: its kind's prefix and the reply's
    own random digits (with the tool call's index), so the capture, which names the items
    it stores, and a relayed stream, which names them as they open, agree."""
    stem = f"{prefix}{reply_id[-ID_HEX:]}"
    return stem if index is None else f"{stem}_{index}"
