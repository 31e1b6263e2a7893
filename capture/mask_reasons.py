"""Why a record is masked, in words a table or a dashboard can count by.

A record's ``_ng_token_capture.mask_reasons`` are sentences that name call ids, counts and
errors. ``reason_group`` strips those, leaving the kind of reason (what ``tokcap report``
tallies); ``reason_slug`` names each kind the rebuild gives with one fixed slug out of
``MASK_REASON_SLUGS``, so a metric key never carries a call id, a number or an error text.
A reason no slug knows (a newer build's, or a hand-written one) is ``other``: it is still
counted, and the groups in ``tokcap report`` show what it said.
"""

from __future__ import annotations

import re

NO_REASON = "(no reason given)"
OTHER = "other"
# A record masked although its summary names no reason: someone masked it before the rebuild
# (finalize only ever adds a mask), or a summary that lost its reasons.
UNSTATED = "unstated"

# Each reason group the rebuild writes (capture.delivery, capture.build), by its slug.
_SLUG_OF_GROUP = {
    "incomplete capture": "incomplete_capture",  # a call was lost (marked, or intent only)
    "nothing recorded": "nothing_recorded",  # the rollout has no entries
    "no call generated any tokens": "no_generated_tokens",
    "final answer matches no captured call": "final_answer_unmatched",
    "final answer matches N captured calls": "final_answer_ambiguous",
    "no final answer to choose among N roots": "several_roots",
    "unresolved retry": "unresolved_retry",
    "ambiguous parent on the delivered chain": "ambiguous_parent",
    "calls missing": "calls_missing",  # the delivered chain began mid-conversation
    "two harness runs share this rollout id": "shared_rollout_id",
    "routed experts captured for some calls only": "partial_routes",
    "delivered fraction N is below min_delivered_fraction N": "below_min_delivered",
    "record error": "record_error",  # finalize failed: the record cannot be rebuilt
    "source error": "source_error",  # ... the source could not be reached
    "build error": "build_error",  # ... anything else
}
MASK_REASON_SLUGS: tuple[str, ...] = (*_SLUG_OF_GROUP.values(), UNSTATED, OTHER)


def reason_group(reason: str) -> str:
    """A mask reason's group: its text before the first ':', call ids and counts stripped.

    ``incomplete capture: call c1: marked incomplete`` -> ``incomplete capture``; a reason about
    one call (``call c1: marked incomplete``) keeps what happened -> ``call: marked incomplete``;
    ``final answer matches 2 captured calls`` -> ``final answer matches N captured calls``;
    ``delivered fraction 0.312 is below min_delivered_fraction 0.5`` -> ``... N ... N``.
    """
    parts = [part.strip() for part in reason.split(":")]
    group = parts[0]
    if re.fullmatch(r"call \S+", group):
        group = f"call: {parts[1]}" if len(parts) > 1 else "call"
    return re.sub(r"\b\d+(?:\.\d+)?\b", "N", group) or NO_REASON


def reason_slug(reason: str) -> str:
    """The reason's slug out of ``MASK_REASON_SLUGS``; ``other`` for a reason none names."""
    return _SLUG_OF_GROUP.get(reason_group(reason), OTHER)
