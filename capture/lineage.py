"""Lineage: which recorded call of a running rollout a new request continues.

In faithful prompt mode the front end names each call's conversation (its request history
plus the reply it served) by lineage keys, and records them on the call's entry under
``LINEAGE_FIELD``. A later request whose history ends in that conversation continues the
call: its prompt is the call's prompt and generation, extended. Because the keys ride on
the entry, any worker or node that reaches the rollout's store can find the call. A
prompt the front end had to render whole although the history held an assistant turn is
recorded with its reason under ``FALLBACK_FIELD``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from capture.codec.entries import decode_entry, read_body
from capture.records import TokenEntry

LINEAGE_FIELD = "lineage_keys"
FALLBACK_FIELD = "faithful_fallback"


def entry_with_key(
    bodies: Iterable[bytes], blocks: Mapping[str, bytes], key: str
) -> TokenEntry | None:
    """The entry among stored ``bodies`` that carries lineage ``key``, decoded; else None.

    Only the bodies are read to find it (small), and only the match is assembled from the
    blocks, so a lookup costs one prompt, not the rollout's every prompt.
    """
    for body in bodies:
        fields = read_body(body).get("fields") or {}
        if key in (fields.get(LINEAGE_FIELD) or ()):
            return decode_entry(body, blocks, trusted=True)
    return None
