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
Linking the calls and choosing the main leaf are ``capture.build.linking``'s; the links
themselves, and what they cost, ``capture.build.graph``'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from capture.build.graph import Graph, path_to
from capture.build.linking import LinkedCalls, link_calls
from capture.build.lost_calls import lost_calls
from capture.build.projection import flat_ids_and_mask, project_chain
from capture.build.roots import RootCheck, check_roots
from capture.build.segments import Segment, checked_delivery, role_of, segments_of
from capture.errors import ConflictingEntryError
from capture.lineage import FALLBACK_FIELD
from capture.records import TokenEntry


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
    # delivered as segments; and roots whose request carried assistant turns no captured call
    # sampled (few-shot examples, a resumed session: delivered, those turns as prompt).
    unexplained_roots: tuple[str, ...] = ()
    seeded_roots: tuple[str, ...] = ()

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


def _chains(
    graph: Graph, leaves: list[int], roots: list[int], main_leaf: int | None
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
    graph: Graph,
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
    unreceived_ids = set(getattr(entries_or_snapshot, "unreceived", ()))
    linked = link_calls(entries, unreceived_ids, final_answer)
    return _result(rollout_id, entries, linked, delivery)


def _result(
    rollout_id: str, entries: list[TokenEntry], linked: LinkedCalls, delivery: str
) -> BuildResult:
    """The build of the linked calls: the main chain projected, every chain reported."""
    graph, ids, main_leaf = linked.graph, linked.graph.ids, linked.main_leaf
    main_path = path_to(graph, main_leaf)
    main_entries = tuple(graph.calls[position] for position in main_path)
    chains = _chains(graph, linked.leaves, linked.roots, main_leaf)
    checked = (
        check_roots(graph.calls, linked.roots, graph.root_of, main_path[0])
        if main_path
        else RootCheck()
    )
    left_out = {ids[root] for root in checked.unexplained}
    segments = _segments(graph, chains, main_path, left_out) if delivery == "segments" else []
    delivered = graph.generated[main_leaf] if main_leaf is not None else 0
    reasons = _mask_reasons(graph, len(entries), linked.unmatched, linked.unresolved, main_path)
    return BuildResult(
        rollout_id=rollout_id,
        n_calls=len(entries) - len(linked.identical),  # a resend that sampled the same is one call
        parents=_parents_by_id(graph),
        main_chain=tuple(ids[position] for position in main_path),
        main_chain_by=linked.main_by,
        chains=chains,
        roots=tuple(ids[root] for root in linked.roots),
        quarantined=tuple(sorted(ids[p] for p in range(len(graph.calls)) if graph.ambiguous[p])),
        empty_generation=linked.empty,
        unreceived=linked.unreceived,
        discarded_retries=tuple(sorted(ids[position] for position in linked.discarded)),
        unresolved_retries=tuple(sorted(linked.unresolved)),
        generated_tokens_captured=sum(
            len(e.generation_token_ids) for e in entries if e.model_call_id not in linked.identical
        ),
        generated_tokens_delivered=delivered + sum(s.generated_tokens for s in segments),
        mask_reasons=tuple(reasons + lost_calls(entries) + _root_reasons(ids, checked, delivery)),
        output=tuple(project_chain(main_entries)),
        main_entries=main_entries,
        faithful_fallbacks=_fallbacks(entries),
        identical_retries=linked.identical,
        main_role=role_of(main_entries[0], main_entries[-1], None) if main_entries else "",
        segments=tuple(segments),
        unexplained_roots=tuple(sorted(ids[root] for root in checked.unexplained)),
        seeded_roots=tuple(sorted(ids[root] for root in checked.seeded)),
    )


def _parents_by_id(graph: Graph) -> dict[str, str | None]:
    """Each call's parent, by call id (None for a root)."""
    return {
        graph.ids[position]: (graph.ids[parent] if parent is not None else None)
        for position, parent in enumerate(graph.parents)
    }


def _root_reasons(ids: list[str], checked: RootCheck, delivery: str) -> list[str]:
    """Why the roots mask the rollout: with segments, a second harness run shares its id."""
    reasons = []
    if delivery == "segments" and checked.second_runs:
        reasons.append(
            f"two harness runs share this rollout id: call {ids[checked.second_runs[0]]} "
            "begins another conversation with the main chain's system prompt and tools, "
            "and nothing the rollout sampled leads to it (a rollout id used twice?)"
        )
    return reasons


def _segments(
    graph: Graph, chains: tuple[ChainInfo, ...], main_path: list[int], left_out: set[str]
) -> list:
    """The chains beside the main one, as segments (none when nothing is delivered), but for
    those whose root is left out (``capture.build.roots``)."""
    if not main_path:
        return []
    position_of = {call_id: position for position, call_id in enumerate(graph.ids)}
    paths = [
        path_to(graph, position_of[chain.leaf])
        for chain in chains
        if not chain.main and not chain.quarantined and chain.root not in left_out
    ]
    return segments_of(graph.calls, paths, main_path)


def _fallbacks(entries: list[TokenEntry]) -> dict[str, int]:
    reasons = [(entry.model_extra or {}).get(FALLBACK_FIELD) for entry in entries]
    return dict(sorted(Counter(str(reason) for reason in reasons if reason).items()))
