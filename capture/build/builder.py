"""Rebuild one rollout from its entries: link calls by token prefixes, pick the main chain.

A harness re-sends the whole history with every call, so a call's prompt starts with the
prompt and generation of the call it continues: its parent is the earlier call whose
prompt+generation is the longest prefix of its prompt. Calls that generated nothing are set
aside (counted). Calls are ordered by prompt length, then call id, so arrival order never
matters. Two identical candidate parents make a call ambiguous (quarantined): its tokens
are known, but not which generation they continue. Siblings with identical prompts are
retries: the one a later call extended is kept; when none was extended the retry is
unresolved and the rollout is masked.

Chains are root-to-leaf paths, computed in one forward pass (no recursion, so 10,000-turn
rollouts are fine); a chain through a quarantined call is flagged, and the rollout is
masked when that chain is the one delivered. The main chain is the one whose leaf produced
the harness's final answer, when exactly one leaf matches; a final answer that matches no
leaf (or several) masks the rollout. Without a final answer the only root's longest path is
delivered, and several roots mask the rollout: a stranger's call or a title call must never
become the delivered chain by arriving first. Other chains (titles, compaction summaries,
sub-agents) are reported, never silently dropped. A call whose reply the harness never
received (``snapshot.unreceived``) is left out unless a later call extends it, and counted.

Full sequences are indexed by their first tokens and by length, and a prompt tries the
longest candidate lengths first, so an ordinary chain finds its parent with one comparison
and the whole build costs about one pass over the ids.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from capture.build.final_answer import answer_signature
from capture.build.projection import flat_ids_and_mask, project_chain
from capture.build.roots import RootCheck, check_roots
from capture.build.segments import Segment, checked_delivery, role_of, segments_of
from capture.codec.views import IdView, shares_prefix
from capture.errors import ConflictingEntryError
from capture.lineage import FALLBACK_FIELD
from capture.records import TokenEntry

# Full sequences are grouped by their first tokens, so an unrelated root (a title call with
# its own system prompt) is never compared against every call of the main chain.
_KEY_TOKENS = 32
# What a rebuild delivers: the main chain only, or every chain (the others as segments).


@dataclass(frozen=True)
class ChainInfo:
    """One root-to-leaf path of the rebuilt rollout."""

    root: str
    leaf: str
    calls: int
    generated_tokens: int
    quarantined: bool
    main: bool
    # What the chain is, as segments are labelled (capture.build.segments.ROLES); beside
    # the main chain's root, or the first root when no main chain was chosen.
    role: str = ""


@dataclass(frozen=True)
class BuildResult:
    """What a rebuild found: the call graph, the delivered chain and its projection."""

    rollout_id: str
    n_calls: int
    parents: dict[str, str | None]
    main_chain: tuple[str, ...]
    main_chain_by: str  # "final_answer", "only_root", or "" when nothing is delivered
    chains: tuple[ChainInfo, ...]
    roots: tuple[str, ...]
    quarantined: tuple[str, ...]
    empty_generation: tuple[str, ...]
    unreceived: tuple[str, ...]  # left out: the harness never got them and nothing extends them
    discarded_retries: tuple[str, ...]
    unresolved_retries: tuple[tuple[str, ...], ...]
    generated_tokens_captured: int
    generated_tokens_delivered: int
    mask_reasons: tuple[str, ...]
    output: tuple[dict[str, Any], ...] = field(repr=False)
    main_entries: tuple[TokenEntry, ...] = field(repr=False)
    # Faithful prompts rendered whole although their history held an assistant turn, by
    # reason (``capture.lineage``): each began a new root.
    faithful_fallbacks: dict[str, int] = field(default_factory=dict)
    # Calls folded into an identical earlier call (same prompt, ids and log-probs).
    identical_retries: tuple[str, ...] = ()
    main_role: str = ""  # the main chain's role, as segments are labelled ("other" usually)
    segments: tuple[Segment, ...] = field(default=(), repr=False)  # delivery="segments"
    # Roots nothing relates to the main chain's conversation (capture.build.roots): never
    # delivered as segments; and roots that began mid-conversation (calls before them lost).
    unexplained_roots: tuple[str, ...] = ()
    missing_start_roots: tuple[str, ...] = ()

    @property
    def masked(self) -> bool:
        return bool(self.mask_reasons)

    @property
    def quarantined_fraction(self) -> float:
        return len(self.quarantined) / self.n_calls if self.n_calls else 0.0

    @property
    def delivered_fraction(self) -> float:
        captured = self.generated_tokens_captured
        return self.generated_tokens_delivered / captured if captured else 0.0

    def flat_ids_and_mask(self) -> tuple[list[int], list[int]]:
        """The delivered token sequence and its loss mask (0 context, 1 generated)."""
        return flat_ids_and_mask(self.output)


def _extends(prompt: list[int], parent: TokenEntry) -> bool:
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
class _LengthIndex:
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
            found = [c for c in self.at[self.lengths[position]] if _extends(prompt, calls[c])]
            if found:
                return found
            position -= 1
        return []


def _entries_of(source: Any) -> tuple[str, list[TokenEntry]]:
    """The rollout id and entries of a snapshot (anything with ``entries``) or an iterable."""
    raw = getattr(source, "entries", source)
    entries = [TokenEntry.coerce(entry) for entry in raw]
    rollout_id = getattr(source, "rollout_id", None)
    ids = {entry.rollout_id for entry in entries}
    if rollout_id is None:
        if len(ids) > 1:
            raise ValueError(f"entries of several rollouts handed to one build: {sorted(ids)}")
        rollout_id = next(iter(ids), "")
    elif ids - {rollout_id}:
        raise ValueError(
            f"snapshot of rollout {rollout_id!r} holds entries of {sorted(ids - {rollout_id})}"
        )
    return rollout_id, entries


def _unique(entries: Iterable[TokenEntry]) -> list[TokenEntry]:
    """One entry per call id; a repeated identical entry keeps its earliest copy."""
    by_id: dict[str, TokenEntry] = {}
    for entry in entries:
        seen = by_id.get(entry.model_call_id)
        if seen is None:
            by_id[entry.model_call_id] = entry
            continue
        same = (
            seen.prompt_token_ids == entry.prompt_token_ids
            and seen.generation_token_ids == entry.generation_token_ids
            and seen.generation_log_probs == entry.generation_log_probs
        )
        if not same:
            raise ConflictingEntryError(
                f"call {entry.model_call_id} appears twice with different token ids"
            )
        if entry.created_at < seen.created_at:
            by_id[entry.model_call_id] = entry
    return list(by_id.values())


def _link(calls: list[TokenEntry]) -> tuple[list[int | None], list[bool]]:
    """Parent position and ambiguity of each call (calls sorted by prompt length)."""
    parents: list[int | None] = []
    ambiguous: list[bool] = []
    keyed: dict[tuple[int, ...], _LengthIndex] = {}
    short = _LengthIndex()  # full sequences shorter than the key
    for position, entry in enumerate(calls):
        prompt = entry.prompt_token_ids
        found: list[int] = []
        if len(prompt) >= _KEY_TOKENS:
            group = keyed.get(tuple(prompt[:_KEY_TOKENS]))
            if group is not None:
                found = group.longest_prefixes(prompt, calls)
        if not found:
            found = short.longest_prefixes(prompt, calls)
        # Candidates are in processing order, so the nominal parent of an ambiguous call
        # does not depend on arrival order.
        parents.append(found[0] if found else None)
        ambiguous.append(len(found) > 1)
        full = len(prompt) + len(entry.generation_token_ids)
        if full >= _KEY_TOKENS:
            key = tuple(
                (prompt[:_KEY_TOKENS] + entry.generation_token_ids[:_KEY_TOKENS])[:_KEY_TOKENS]
            )
            keyed.setdefault(key, _LengthIndex()).add(full, position)
        else:
            short.add(full, position)
    return parents, ambiguous


def _retry_groups(parents: list[int | None], calls: list[TokenEntry]) -> list[list[int]]:
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
class _Graph:
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


def _graph(calls: list[TokenEntry]) -> _Graph:
    """Link every call to its parent, then walk forward once (a parent always sorts first)."""
    parents, ambiguous = _link(calls)
    size = len(calls)
    graph = _Graph(
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


def _settle_retries(graph: _Graph) -> tuple[set[int], list[tuple[str, ...]]]:
    """(retries discarded because a sibling was extended, groups none of which was)."""
    discarded: set[int] = set()
    unresolved: list[tuple[str, ...]] = []
    for group in _retry_groups(graph.parents, graph.calls):
        if any(graph.has_child[position] for position in group):
            discarded.update(position for position in group if not graph.has_child[position])
        else:
            unresolved.append(tuple(sorted(graph.ids[position] for position in group)))
    return discarded, unresolved


def _path_to(graph: _Graph, leaf: int | None) -> list[int]:
    path: list[int] = []
    while leaf is not None:
        path.append(leaf)
        leaf = graph.parents[leaf]
    return path[::-1]


def _chains(
    graph: _Graph, leaves: list[int], roots: list[int], main_leaf: int | None
) -> tuple[ChainInfo, ...]:
    """Every root-to-leaf chain, by root (earliest first), then by its leaf's creation (so
    the chain that shares its first calls with a later one always delivers them)."""
    rank = {root: order for order, root in enumerate(roots)}
    calls = graph.calls
    ordered = sorted(
        leaves,
        key=lambda leaf: (rank[graph.root_of[leaf]], calls[leaf].created_at, graph.ids[leaf]),
    )
    reference = graph.root_of[main_leaf] if main_leaf is not None else (roots or [None])[0]
    return tuple(
        ChainInfo(
            root=graph.ids[graph.root_of[leaf]],
            leaf=graph.ids[leaf],
            calls=graph.depth[leaf],
            generated_tokens=graph.generated[leaf],
            quarantined=graph.tainted[leaf],
            main=leaf == main_leaf,
            role=role_of(
                calls[graph.root_of[leaf]],
                calls[leaf],
                None if leaf == main_leaf or reference is None else calls[reference],
            ),
        )
        for leaf in ordered
    )


def _mask_reasons(
    graph: _Graph,
    n_entries: int,
    unmatched: str,
    unresolved: list[tuple[str, ...]],
    main_path: list[int],
) -> list[str]:
    """Why the rollout must be masked; empty when it may be delivered."""
    reasons = []
    if not n_entries:
        reasons.append("nothing recorded: the rollout has no entries")
    elif not graph.calls:
        reasons.append("no call generated any tokens")
    elif unmatched:
        reasons.append(unmatched)
    for group in unresolved:
        reasons.append(
            f"unresolved retry: calls {', '.join(group)} share a prompt and none was extended"
        )
    for position in main_path:
        if graph.ambiguous[position]:
            reasons.append(
                f"ambiguous parent on the delivered chain: call {graph.ids[position]} extends "
                "several identical calls"
            )
    return reasons


def run_builder(
    entries_or_snapshot: Any, *, final_answer: Any = None, delivery: str = "chain"
) -> BuildResult:
    """Rebuild a rollout from a snapshot or an iterable of entries.

    ``final_answer`` is what the harness returned (its ``response.output`` items, one item,
    or a string); it picks the main chain when exactly one leaf produced it. With
    ``delivery="segments"`` every other chain is delivered too (``BuildResult.segments``).
    """
    checked_delivery(delivery)
    rollout_id, entries = _entries_of(entries_or_snapshot)
    entries = _unique(entries)
    empty = tuple(sorted(e.model_call_id for e in entries if not e.generation_token_ids))
    calls = sorted(
        (e for e in entries if e.generation_token_ids),
        key=lambda e: (len(e.prompt_token_ids), e.model_call_id),
    )
    calls, unreceived = _without_unreceived(
        calls, set(getattr(entries_or_snapshot, "unreceived", ()))
    )
    calls, identical = _fold_identical(calls)
    graph = _graph(calls)
    ids = graph.ids
    discarded, unresolved = _settle_retries(graph)
    kept, roots, leaves = _survivors(graph, discarded)
    main_leaf, main_by, unmatched = _main_leaf(
        calls, ids, leaves, roots, graph.root_of, final_answer
    )
    if main_by == "final_answer" and unresolved:
        # A retry of the final call, none extended: the final answer names the one kept.
        unresolved = _resolve_by_answer(graph, unresolved, ids[main_leaf], discarded)
        kept, roots, leaves = _survivors(graph, discarded)
    main_path = _path_to(graph, main_leaf)
    main_entries = tuple(calls[position] for position in main_path)
    chains = _chains(graph, leaves, roots, main_leaf)
    checked = check_roots(calls, roots, graph.root_of, main_path[0]) if main_path else RootCheck()
    left_out = {ids[root] for root in checked.unexplained + checked.missing_start}
    segments = _segments(graph, chains, main_path, left_out) if delivery == "segments" else []
    delivered = graph.generated[main_leaf] if main_leaf is not None else 0
    return BuildResult(
        rollout_id=rollout_id,
        n_calls=len(entries) - len(identical),  # a resend that sampled the same is one call
        parents={
            ids[position]: (ids[parent] if parent is not None else None)
            for position, parent in enumerate(graph.parents)
        },
        main_chain=tuple(ids[position] for position in main_path),
        main_chain_by=main_by,
        chains=chains,
        roots=tuple(ids[root] for root in roots),
        quarantined=tuple(sorted(ids[p] for p in range(len(calls)) if graph.ambiguous[p])),
        empty_generation=empty,
        unreceived=unreceived,
        discarded_retries=tuple(sorted(ids[position] for position in discarded)),
        unresolved_retries=tuple(sorted(unresolved)),
        generated_tokens_captured=sum(
            len(e.generation_token_ids) for e in entries if e.model_call_id not in identical
        ),
        generated_tokens_delivered=delivered + sum(s.generated_tokens for s in segments),
        mask_reasons=tuple(
            _mask_reasons(graph, len(entries), unmatched, unresolved, main_path)
            + _root_reasons(ids, checked, main_path, delivery)
        ),
        output=tuple(project_chain(main_entries)),
        main_entries=main_entries,
        faithful_fallbacks=_fallbacks(entries),
        identical_retries=identical,
        main_role=role_of(main_entries[0], main_entries[-1], None) if main_entries else "",
        segments=tuple(segments),
        unexplained_roots=tuple(sorted(ids[root] for root in checked.unexplained)),
        missing_start_roots=tuple(sorted(ids[root] for root in checked.missing_start)),
    )


def _root_reasons(
    ids: list[str], checked: RootCheck, main_path: list[int], delivery: str
) -> list[str]:
    """Why the roots mask the rollout: the delivered chain, or with segments any delivered
    conversation, began mid-conversation; or a second harness run shares the rollout id."""
    reasons = []
    for root in checked.missing_start:
        if root == main_path[0] or delivery == "segments":
            reasons.append(
                f"calls missing: the request of call {ids[root]} continues a conversation whose "
                "last reply no earlier captured call sampled (the rollout's capture lost calls: "
                "a Redis that evicted it, or keys deleted while the harness ran)"
            )
    if delivery == "segments" and checked.second_runs:
        reasons.append(
            f"two harness runs share this rollout id: call {ids[checked.second_runs[0]]} "
            "begins another conversation with the main chain's system prompt and tools, "
            "and nothing the rollout sampled leads to it (a rollout id used twice?)"
        )
    return reasons


def _survivors(graph: _Graph, discarded: set[int]) -> tuple[list[int], list[int], list[int]]:
    """(kept calls, roots by creation, leaves) once the discarded retries are left out."""
    kept = [position for position in range(len(graph.calls)) if position not in discarded]
    roots = sorted(
        (position for position in kept if graph.parents[position] is None),
        key=lambda position: (graph.calls[position].created_at, graph.ids[position]),
    )
    leaves = [position for position in kept if not graph.has_child[position]]
    return kept, roots, leaves


def _resolve_by_answer(
    graph: _Graph, unresolved: list[tuple[str, ...]], main_id: str, discarded: set[int]
) -> list[tuple[str, ...]]:
    """Unresolved retry groups left once the one the final answer chose is kept."""
    position_of = {call_id: position for position, call_id in enumerate(graph.ids)}
    left = []
    for group in unresolved:
        if main_id in group:
            discarded.update(position_of[call_id] for call_id in group if call_id != main_id)
        else:
            left.append(group)
    return left


def _fold_identical(calls: list[TokenEntry]) -> tuple[list[TokenEntry], tuple[str, ...]]:
    """One call per identical sampled sequence (prompt, ids and log-probs): a retry that
    sampled exactly the same is the same call, not an ambiguity. The earliest is kept."""
    seen: dict[tuple[Any, ...], list[TokenEntry]] = {}
    kept: list[TokenEntry] = []
    folded: list[str] = []
    for call in sorted(calls, key=lambda c: (c.created_at, c.model_call_id)):
        ids = call.generation_token_ids
        key = (
            len(call.prompt_token_ids),
            ids.key() if isinstance(ids, IdView) else tuple(ids),
            tuple(call.generation_log_probs),
        )
        twins = seen.setdefault(key, [])
        if any(twin.prompt_token_ids == call.prompt_token_ids for twin in twins):
            folded.append(call.model_call_id)
            continue
        twins.append(call)
        kept.append(call)
    if not folded:
        return calls, ()
    kept.sort(key=lambda e: (len(e.prompt_token_ids), e.model_call_id))
    return kept, tuple(sorted(folded))


def _segments(
    graph: _Graph, chains: tuple[ChainInfo, ...], main_path: list[int], left_out: set[str]
) -> list:
    """The chains beside the main one, as segments (none when nothing is delivered), but for
    those whose root is left out (``capture.build.roots``)."""
    if not main_path:
        return []
    position_of = {call_id: position for position, call_id in enumerate(graph.ids)}
    paths = [
        _path_to(graph, position_of[chain.leaf])
        for chain in chains
        if not chain.main and not chain.quarantined and chain.root not in left_out
    ]
    return segments_of(graph.calls, paths, main_path)


def _fallbacks(entries: list[TokenEntry]) -> dict[str, int]:
    reasons = [(entry.model_extra or {}).get(FALLBACK_FIELD) for entry in entries]
    return dict(sorted(Counter(str(reason) for reason in reasons if reason).items()))


def _without_unreceived(
    calls: list[TokenEntry], unreceived: set[str]
) -> tuple[list[TokenEntry], tuple[str, ...]]:
    """Calls without the unreceived ones that no kept call extends, and the ids left out.

    Children sort after their parents, so one backward pass settles every call: an
    unreceived call is kept only if one of its kept children extends it.
    """
    if not unreceived.intersection(call.model_call_id for call in calls):
        return calls, ()
    parents, _ = _link(calls)
    extended = [False] * len(calls)
    dropped: set[int] = set()
    for position in range(len(calls) - 1, -1, -1):
        if calls[position].model_call_id in unreceived and not extended[position]:
            dropped.add(position)
        elif parents[position] is not None:
            extended[parents[position]] = True
    kept = [call for position, call in enumerate(calls) if position not in dropped]
    return kept, tuple(sorted(calls[position].model_call_id for position in dropped))


def _main_leaf(
    calls: list[TokenEntry],
    ids: list[str],
    leaves: list[int],
    roots: list[int],
    root_of: list[int],
    final_answer: Any,
) -> tuple[int | None, str, str]:
    """The leaf that produced the final answer, else the only root's longest path.

    Returns (leaf, how it was chosen, why none could be): a final answer that matches no
    leaf, or several, and several roots without a final answer, choose nothing.
    """
    wanted = answer_signature(final_answer)
    if wanted is not None:
        matches = [leaf for leaf in leaves if answer_signature(calls[leaf].output_items) == wanted]
        if len(matches) == 1:
            return matches[0], "final_answer", ""
        if not matches:
            return None, "", "final answer matches no captured call"
        return None, "", f"final answer matches {len(matches)} captured calls"
    if not roots:
        return None, "", ""
    if len(roots) > 1:
        return None, "", f"no final answer to choose among {len(roots)} roots"
    longest = max(
        leaves,
        key=lambda leaf: (
            len(calls[leaf].prompt_token_ids) + len(calls[leaf].generation_token_ids),
            ids[leaf],
        ),
    )
    return longest, "only_root", ""
