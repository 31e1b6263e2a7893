"""How many of a rollout's entries this process has had acknowledged, stamped on each entry.

A rollout whose stored calls were lost while its harness ran (its hash deleted or evicted,
a Redis that came back without its data) must be masked, or its later calls would be
delivered as if they were the whole conversation. The harness's own history cannot tell
that apart from a conversation it seeded with turns the policy never sampled (few-shot
examples, a resumed session), so the check rests on the capture alone: before each put,
the entry is stamped with a name for this process and sink, and the count of the rollout's
puts that sink has acknowledged to it so far. An entry stamped ``n`` proves that ``n`` entries stamped
lower by the same process were stored; the rebuild (``capture.build.lost_calls``) masks a
rollout where fewer are there. Only acknowledged puts count, so a put that failed, a call
answered 503 or a hang-up never looks like a loss.

The counts live in memory, bounded (``REMEMBERED`` rollouts, least recently used out): a
rollout forgotten starts again from 0, which can only hide a loss, never invent one. Each
process counts its own (a forked child takes a new name), so with several workers a loss is
seen when a worker that stored a lost call stores a later one of the same rollout. A
rollout id used again while its old count is remembered (a bug of the id scheme) is masked.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from capture.records import ACKED_BEFORE_FIELD, TokenEntry

# Rollouts whose counts are kept per sink; 200k rollouts take about 30 MB.
REMEMBERED = 200_000


class _Counts:
    """One sink's counts in one process, under a name of their own."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.name = uuid.uuid4().hex[:16]
        self.by_rollout: OrderedDict[str, int] = OrderedDict()


class AckedPuts:
    """Per sink and rollout, the puts the sink acknowledged to this process (module doc)."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self.remembered = remembered
        self._sinks: weakref.WeakKeyDictionary[Any, _Counts] = weakref.WeakKeyDictionary()

    def _counts(self, sink: Any) -> _Counts:
        counts = self._sinks.get(sink)
        if counts is None or counts.pid != os.getpid():  # a forked child counts anew
            counts = self._sinks[sink] = _Counts()
        return counts

    def stamp(self, sink: Any, entry: TokenEntry) -> TokenEntry:
        """A copy of ``entry`` stamped with the count ``sink`` acknowledged so far."""
        counts = self._counts(sink)
        found = counts.by_rollout.get(entry.rollout_id, 0)
        stamp = {"worker": counts.name, "count": found}
        return entry.model_copy(update={ACKED_BEFORE_FIELD: stamp})

    def acknowledged(self, sink: Any, rollout_id: str) -> None:
        """``sink`` stored one more of the rollout's entries."""
        by_rollout = self._counts(sink).by_rollout
        by_rollout[rollout_id] = by_rollout.pop(rollout_id, 0) + 1
        while len(by_rollout) > self.remembered:
            by_rollout.popitem(last=False)


def acked_stamp(entry: TokenEntry) -> tuple[str, int] | None:
    """(process name, count) of an entry's stamp; None for an entry without a usable one."""
    found = (entry.model_extra or {}).get(ACKED_BEFORE_FIELD)
    if not isinstance(found, Mapping):
        return None
    worker, count = found.get("worker"), found.get("count")
    if not isinstance(worker, str) or not isinstance(count, int) or isinstance(count, bool):
        return None
    return worker, count


ACKED = AckedPuts()
