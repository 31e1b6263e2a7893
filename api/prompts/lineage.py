"""Where a worker finds the call a request continues: its own memory, then the sink.

A worker remembers the calls it served last (their lineage keys and sampled sequence, as
compact arrays, bounded by a token budget that their route chains count against too), so
a rollout that keeps landing on one worker never waits on the store. A request for a call
another worker or node served asks the sink (``capture.protocols.LineageSource``), where
the keys ride on the call's entry.

With routes captured, a call found either way names the blocks its routes are stored in
(``ContinuedCall.routes_chain``), so the next call can ask for the rows it adds only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from capture.context import current_call
from capture.protocols import LineageSource
from capture.routes import RouteChain

log = logging.getLogger("tokcap.prompts")

# Tokens a worker keeps of served calls (about 36 bytes each as Python ints: 256 MB).
DEFAULT_BUDGET_TOKENS = 8_000_000
# Sequences kept per rollout: its main line, and a few others (a title, a sub-agent).
BRANCHES_PER_ROLLOUT = 4
# A call's route chain costs its tuple's slots (8 bytes a name) in tokens of 36 bytes: the
# names themselves are shared along a branch (each call reuses its prefix's), one 89-byte
# string per 250 ids, about 1% of the ids.
NAME_SLOTS_PER_TOKEN = 36 // 8


def _route_tokens(chain: RouteChain | None) -> int:
    """What remembering a call's route chain adds, in tokens of the budget."""
    return 0 if chain is None else -(-len(chain.names) // NAME_SLOTS_PER_TOKEN)


@dataclass(frozen=True)
class ContinuedCall:
    """A recorded call a request continues: its id and the ids it saw and sampled."""

    model_call_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    found_in: str = "memory"  # "memory" (this worker served it) or "store"
    # The blocks its routes are stored in, where known (``api.prompts.route_prefix``).
    routes_chain: RouteChain | None = None


@dataclass
class _Branch:
    """One growing sequence of a rollout; each call on it is a prefix (its two lengths)."""

    sequence: list[int]
    # lineage key -> (call id, prompt end, end, the blocks its routes are stored in)
    calls: dict[str, tuple[str, int, int, RouteChain | None]]
    route_tokens: int = 0  # what its calls' route chains are charged to the budget

    @property
    def tokens(self) -> int:
        return len(self.sequence) + self.route_tokens


class LineageMemory:
    """Calls this worker served, by rollout and lineage key; least recently used out first.

    A rollout's calls mostly form one line, each prompt extending the previous call's
    sequence, so they share one list: remembering a call appends only what it added, and
    recalling one slices it. A call that extends no kept sequence starts a branch.
    """

    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self._budget = budget_tokens
        self._tokens = 0
        self._rollouts: OrderedDict[str, list[_Branch]] = OrderedDict()

    def remember(
        self,
        rollout_id: str,
        keys: Sequence[str],
        model_call_id: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        routes_chain: RouteChain | None = None,
    ) -> None:
        branches = self._rollouts.setdefault(rollout_id, [])
        self._rollouts.move_to_end(rollout_id)
        branch = _extended(branches, prompt_ids)
        if branch is None:
            branch = _Branch(list(prompt_ids), {})
            branches.append(branch)
            self._tokens += len(prompt_ids)
            if len(branches) > BRANCHES_PER_ROLLOUT:
                self._tokens -= branches.pop(0).tokens
        else:
            added = prompt_ids[len(branch.sequence) :]
            branch.sequence.extend(added)
            self._tokens += len(added)
        branch.sequence.extend(completion_ids)
        routes = _route_tokens(routes_chain)
        branch.route_tokens += routes
        self._tokens += len(completion_ids) + routes
        for key in keys:
            branch.calls[key] = (model_call_id, len(prompt_ids), len(branch.sequence), routes_chain)
        while self._tokens > self._budget and len(self._rollouts) > 1:
            _, dropped = self._rollouts.popitem(last=False)
            self._tokens -= sum(branch.tokens for branch in dropped)

    def recall(self, rollout_id: str, key: str) -> ContinuedCall | None:
        for branch in self._rollouts.get(rollout_id, ()):
            found = branch.calls.get(key)
            if found is not None:
                call_id, prompt_end, end, chain = found
                sequence = branch.sequence
                prompt, completion = sequence[:prompt_end], sequence[prompt_end:end]
                return ContinuedCall(call_id, prompt, completion, routes_chain=chain)
        return None


def _extended(branches: list[_Branch], prompt_ids: list[int]) -> _Branch | None:
    """The branch whose whole sequence ``prompt_ids`` starts with (last ids compared first)."""
    for branch in reversed(branches):
        sequence = branch.sequence
        length = len(sequence)
        if (
            0 < length <= len(prompt_ids)
            and prompt_ids[length - 1] == sequence[-1]
            and prompt_ids[:length] == sequence
        ):
            return branch
    return None


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
            chain = getattr(entry.routed_experts, "chain", None)  # read from its blocks
            return ContinuedCall(
                entry.model_call_id,
                entry.prompt_token_ids,
                entry.generation_token_ids,
                "store",
                chain,
            )
    return None
