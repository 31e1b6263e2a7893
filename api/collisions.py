"""Two harness runs under one rollout id, noticed while they run.

A rollout id names one harness run; a training loop that restarts its numbering hands the
same id to a second run, and the two runs' calls land in one capture. The front end sees it
first: two calls of one rollout in flight at once whose conversations share a system prompt
and tools but open with different user messages. Sub-agents the harness marks as such (the
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

from prometheus_client import Counter as Total

log = logging.getLogger("tokcap.frontend")

# How many rollouts already reported are remembered, so each is logged once.
REMEMBERED = 4096


def conversation_of(traits: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(system, tools, first user message) digests, or None for calls left out."""
    side = traits.get("structured_output") and not traits.get("n_tools")
    if traits.get("subagent") or side:
        return None
    return (str(traits.get("system")), str(traits.get("tools")), str(traits.get("first_user")))


class CollisionWatch:
    """The conversations of each rollout's calls in flight in this worker."""

    def __init__(self, collisions: Total) -> None:
        self._collisions = collisions
        self._in_flight: dict[str, Counter[tuple[str, str, str]]] = {}
        self._reported: OrderedDict[str, None] = OrderedDict()

    @contextmanager
    def call(self, rollout_id: str, traits: Mapping[str, Any]) -> Iterator[None]:
        """Hold the call's conversation as in flight while the block runs."""
        conversation = conversation_of(traits)
        if conversation is None:
            yield
            return
        flying = self._in_flight.setdefault(rollout_id, Counter())
        if any(other[:2] == conversation[:2] and other[2] != conversation[2] for other in flying):
            self._report(rollout_id)
        flying[conversation] += 1
        try:
            yield
        finally:
            flying[conversation] -= 1
            if flying[conversation] <= 0:
                del flying[conversation]
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
            "rollout %s: two conversations with the same system prompt and tools but "
            "different first messages are in flight at once; two harness runs share this "
            "rollout id? (a training loop that restarted its numbering). Segments delivery "
            "masks such a rollout; give every run its own id",
            rollout_id,
        )
