"""Where a worker finds the call a request continues: its own memory, then the sink.

A worker remembers the calls it served last (their lineage keys and sampled sequence, as
compact arrays, bounded by a token budget), so a rollout that keeps landing on one worker
never waits on the store. A request for a call another worker or node served asks the sink
(``capture.protocols.LineageSource``), where the keys ride on the call's entry.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from capture.context import current_call
from capture.protocols import LineageSource

log = logging.getLogger("tokcap.prompts")

# Tokens a worker keeps of served calls: 32 M ids is 128 MB of int32 arrays.
DEFAULT_BUDGET_TOKENS = 32_000_000


@dataclass(frozen=True)
class ContinuedCall:
    """A recorded call a request continues: its id and the ids it saw and sampled."""

    model_call_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    found_in: str = "memory"  # "memory" (this worker served it) or "store"


@dataclass(frozen=True)
class _Remembered:
    model_call_id: str
    sequence: array
    prompt_len: int


class LineageMemory:
    """Calls this worker served, by rollout and lineage key; least recently used out first."""

    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self._budget = budget_tokens
        self._tokens = 0
        self._calls: OrderedDict[tuple[str, str], _Remembered] = OrderedDict()

    def remember(
        self,
        rollout_id: str,
        keys: Sequence[str],
        model_call_id: str,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
    ) -> None:
        sequence = array("i", prompt_ids)
        sequence.extend(completion_ids)
        remembered = _Remembered(model_call_id, sequence, len(prompt_ids))
        for key in keys:
            self._forget((rollout_id, key))
            self._calls[rollout_id, key] = remembered
            self._tokens += len(sequence)
        while self._tokens > self._budget and self._calls:
            self._forget(next(iter(self._calls)))

    def _forget(self, name: tuple[str, str]) -> None:
        old = self._calls.pop(name, None)
        if old is not None:
            self._tokens -= len(old.sequence)

    def recall(self, rollout_id: str, key: str) -> ContinuedCall | None:
        found = self._calls.get((rollout_id, key))
        if found is None:
            return None
        self._calls.move_to_end((rollout_id, key))
        ids = found.sequence.tolist()
        return ContinuedCall(found.model_call_id, ids[: found.prompt_len], ids[found.prompt_len :])


async def find_continued(memory: LineageMemory, keys: Sequence[str]) -> ContinuedCall | None:
    """The recorded call of this request's rollout that one of ``keys`` names, or None.

    Untagged traffic has no rollout, so nothing to continue. A sink that cannot be asked
    (no ``find_call``, or it is down) is the same as no match: the prompt is rendered whole
    and the fallback counted, never guessed.
    """
    call = current_call()
    if call is None:
        return None
    for key in keys:
        found = memory.recall(call.rollout_id, key)
        if found is not None:
            return found
    if not isinstance(call.sink, LineageSource):
        return None
    for key in keys:
        try:
            entry = await call.sink.find_call(call.rollout_id, key)
        except Exception as exc:  # an outage of the store: render whole, say so
            log.warning("lineage lookup failed (%s); rendering the prompt whole", exc)
            return None
        if entry is not None:
            return ContinuedCall(
                entry.model_call_id, entry.prompt_token_ids, entry.generation_token_ids, "store"
            )
    return None
