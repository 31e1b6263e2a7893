"""The call graph of one rollout: each call linked to the call whose prompt + generation is
the longest prefix of its prompt, in one forward pass over calls sorted by prompt length.

Full sequences are indexed by their first ``KEY_TOKENS`` tokens and by length, and a prompt
tries the longest candidate lengths first, so an ordinary chain finds its parent with one
comparison and the whole graph costs about one pass over the ids. Two candidates of the
same length make a call ambiguous; siblings with identical prompts are retries, settled by
which of them a later call extended (``settle_retries``).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from dataclasses import dataclass, field

from capture.codec.views import shares_prefix
from capture.records import TokenEntry

# Full sequences are grouped by their first tokens, so an unrelated root (a title call with
# its own system prompt) is never compared against every call of the main chain.
KEY_TOKENS = 32


def extends(prompt: list[int], parent: TokenEntry) -> bool:
    """Whether ``prompt`` starts with the parent's prompt + generation.

    A store's freeze hands the calls of a chain as views of one shared sequence, and then
    identity answers in O(1). Otherwise cheap probes first (a sibling branch usually differs
    at its end); then list equality, pointer comparison when the ids share objects.
    """
    before = parent.prompt_token_ids
    generation = parent.generation_token_ids
    if shares_prefix(prompt, before, generation):
        return True
    start = len(before)
    end = start + len(generation)
    if end > len(prompt) or prompt[end - 1] != generation[-1] or prompt[start] != generation[0]:
        return False
    if before and prompt[start - 1] != before[-1]:
        return False
    return prompt[start:end] == generation and prompt[:start] == before


@dataclass
class LengthIndex:
    """Full sequences (as call positions) by length, lengths kept sorted."""

    lengths: list[int] = field(default_factory=list)
    at: dict[int, list[int]] = field(default_factory=dict)

    def add(self, length: int, call: int) -> None:
        calls = self.at.get(length)
        if calls is None:
            insort(self.lengths, length)
            self.at[length] = [call]
        else:
            calls.append(call)

    def longest_prefixes(self, prompt: list[int], calls: list[TokenEntry]) -> list[int]:
        """Calls whose full sequence is the longest prefix of ``prompt`` found here."""
        position = bisect_right(self.lengths, len(prompt)) - 1
        while position >= 0:
            found = [c for c in self.at[self.lengths[position]] if extends(prompt, calls[c])]
            if found:
                return found
            position -= 1
        return []


def link(calls: list[TokenEntry]) -> tuple[list[int | None], list[bool]]:
    """Parent position and ambiguity of each call (calls sorted by prompt length)."""
    parents: list[int | None] = []
    ambiguous: list[bool] = []
    keyed: dict[tuple[int, ...], LengthIndex] = {}
    short = LengthIndex()  # full sequences shorter than the key
    for position, entry in enumerate(calls):
        prompt = entry.prompt_token_ids
        found: list[int] = []
        if len(prompt) >= KEY_TOKENS:
            group = keyed.get(tuple(prompt[:KEY_TOKENS]))
            if group is not None:
                found = group.longest_prefixes(prompt, calls)
        if not found:
            found = short.longest_prefixes(prompt, calls)
        # Candidates are in processing order, so the nominal parent of an ambiguous call
        # does not depend on arrival order.
        parents.append(found[0] if found else None)
        ambiguous.append(len(found) > 1)
        full = len(prompt) + len(entry.generation_token_ids)
        if full >= KEY_TOKENS:
            key = tuple(
                (prompt[:KEY_TOKENS] + entry.generation_token_ids[:KEY_TOKENS])[:KEY_TOKENS]
            )
            keyed.setdefault(key, LengthIndex()).add(full, position)
        else:
            short.add(full, position)
    return parents, ambiguous


def retry_groups(parents: list[int | None], calls: list[TokenEntry]) -> list[list[int]]:
    """Sibling calls with identical prompts (identical prompts imply the same parent)."""
    buckets: dict[tuple[int | None, int], list[int]] = {}
    for position, parent in enumerate(parents):
        size = len(calls[position].prompt_token_ids)
        buckets.setdefault((parent, size), []).append(position)
    groups = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        same: list[list[int]] = []
        for position in members:
            prompt = calls[position].prompt_token_ids
            for group in same:
                if calls[group[0]].prompt_token_ids == prompt:
                    group.append(position)
                    break
            else:
                same.append([position])
        groups.extend(group for group in same if len(group) > 1)
    return groups


@dataclass
class Graph:
    """The linked calls of one rollout, position by position (parents sort first)."""

    calls: list[TokenEntry]
    ids: list[str]
    parents: list[int | None]
    ambiguous: list[bool]
    has_child: list[bool]
    depth: list[int]  # calls from the root to here
    generated: list[int]  # generated tokens from the root to here
    tainted: list[bool]  # an ambiguous call on the path from the root
    root_of: list[int]


def build_graph(calls: list[TokenEntry]) -> Graph:
    """Link every call to its parent, then walk forward once (a parent always sorts first)."""
    parents, ambiguous = link(calls)
    size = len(calls)
    graph = Graph(
        calls=calls,
        ids=[call.model_call_id for call in calls],
        parents=parents,
        ambiguous=ambiguous,
        has_child=[False] * size,
        depth=[1] * size,
        generated=[len(call.generation_token_ids) for call in calls],
        tainted=list(ambiguous),
        root_of=list(range(size)),
    )
    for position, parent in enumerate(parents):
        if parent is None:
            continue
        graph.has_child[parent] = True
        graph.depth[position] = graph.depth[parent] + 1
        graph.generated[position] += graph.generated[parent]
        graph.tainted[position] = graph.tainted[parent] or ambiguous[position]
        graph.root_of[position] = graph.root_of[parent]
    return graph


def settle_retries(graph: Graph) -> tuple[set[int], list[tuple[str, ...]]]:
    """(retries discarded because a sibling was extended, groups none of which was)."""
    discarded: set[int] = set()
    unresolved: list[tuple[str, ...]] = []
    for group in retry_groups(graph.parents, graph.calls):
        if any(graph.has_child[position] for position in group):
            discarded.update(position for position in group if not graph.has_child[position])
        else:
            unresolved.append(tuple(sorted(graph.ids[position] for position in group)))
    return discarded, unresolved


def path_to(graph: Graph, leaf: int | None) -> list[int]:
    path: list[int] = []
    while leaf is not None:
        path.append(leaf)
        leaf = graph.parents[leaf]
    return path[::-1]
