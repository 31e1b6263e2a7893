"""Two harness runs under one rollout id, noticed while they run.

A rollout id names one harness run; a training loop that restarts its numbering hands the
same id to a second run, and the two runs' calls land in one capture. The front end sees it
first: one harness loop waits for each reply before its next call, so two calls of one
rollout in flight at once with the same system prompt and tools but different histories
(another first message, or the same task at another point) are two loops. A resend of the
same request is not: its history is the same. Sub-agents the harness marks as such (the
Claude Code CLI's billing line) and side requests (a title: JSON, no tools) are left out, as
they legitimately run beside the loop. Each rollout is counted once
(``tokcap_rollout_id_collisions_total``) and logged once, naming the id, so the operator
finds the numbering bug before a step trains on it; the rebuild masks such a rollout in
segments delivery (``capture.build.roots``). A worker sees only its own calls, so on
several workers a collision may go unseen here; the rebuild does not depend on it.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import prometheus_client

from capture.context import CallCapture
from capture.traits import ANSWERED_BEFORE, TURNS_BEFORE, is_side_request

log = logging.getLogger("tokcap.frontend")

# How many rollouts already reported are remembered, so each is logged once.
REMEMBERED = 4096


# (system prompt, tools) of a harness loop, and where one call of it stands: its first user
# message, the assistant turns it carries and the digest of the last one.
Harness = tuple[str, str]
History = tuple[str, int, str]


def history_of(traits: Mapping[str, Any]) -> tuple[Harness, History] | None:
    """The harness loop a call belongs to and its history (digests), from the request's
    traits (``api.call.traits``); None for calls that legitimately run beside the loop."""
    if traits.get("subagent") or is_side_request(traits):
        return None
    harness = (str(traits.get("system")), str(traits.get("tools")))
    history = (
        str(traits.get("first_user")),
        int(traits.get(TURNS_BEFORE) or 0),
        str(traits.get(ANSWERED_BEFORE)),
    )
    return harness, history


class CollisionWatch:
    """The histories of each rollout's calls in flight in this worker."""

    def __init__(self, collisions: prometheus_client.Counter) -> None:
        self._collisions = collisions
        self._in_flight: dict[str, Counter[tuple[Harness, History]]] = {}
        self._reported: OrderedDict[str, None] = OrderedDict()

    @contextmanager
    def watching(self, call: CallCapture | None, traits: Mapping[str, Any]) -> Iterator[None]:
        """Hold a captured call's history as in flight while the block runs."""
        found = history_of(traits)
        if call is None or found is None:
            yield
            return
        rollout_id = call.rollout_id
        flying = self._in_flight.setdefault(rollout_id, Counter())
        if any(other[0] == found[0] and other[1] != found[1] for other in flying):
            self._report(rollout_id)
        flying[found] += 1
        try:
            yield
        finally:
            flying[found] -= 1
            if flying[found] <= 0:
                del flying[found]
            if not flying:
                del self._in_flight[rollout_id]

    def _report(self, rollout_id: str) -> None:
        if rollout_id in self._reported:
            self._reported.move_to_end(rollout_id)
            return
        self._reported[rollout_id] = None
        if len(self._reported) > REMEMBERED:
            self._reported.popitem(last=False)
        self._collisions.inc()
        log.warning(
            "rollout %s: two calls with the same system prompt and tools but different "
            "histories are in flight at once; two harness runs share this rollout id? (a "
            "training loop that restarted its numbering). Give every run its own id",
            rollout_id,
        )
