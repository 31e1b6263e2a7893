"""Link one rollout's calls into a graph and choose the leaf whose chain is delivered.

Calls that generated nothing are set aside, and so is a call the harness never received
that no later call extends; a resend that sampled exactly the same is folded into the
earliest. The rest are ordered by prompt length, then call id, so arrival order never
matters, and linked (``capture.build.graph``). Siblings with identical prompts are
retries: the one a later call extended is kept, and of a retry of the final call, the one
the final answer names. The main leaf is the one whose output is the final answer, when
exactly one matches; without a final answer, the only root's longest path; otherwise none,
and the build says why. What the build delivers and reports is ``capture.build.builder``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture.build.final_answer import answer_signature
from capture.build.graph import Graph, build_graph, link, settle_retries
from capture.codec.views import IdView
from capture.records import TokenEntry


@dataclass(frozen=True)
class LinkedCalls:
    """A rollout's calls linked into a graph, what was set aside on the way, and the leaf
    whose chain is delivered: everything a build is read from."""

    graph: Graph
    empty: tuple[str, ...]  # generated nothing
    unreceived: tuple[str, ...]  # never received by the harness, and extended by no call
    identical: tuple[str, ...]  # folded into an identical earlier call
    discarded: set[int]  # retries a sibling's extension settled
    unresolved: list[tuple[str, ...]]  # retries none of which was extended
    roots: list[int]
    leaves: list[int]
    main_leaf: int | None
    main_by: str
    unmatched: str  # why no leaf could be chosen, when a final answer was given


def link_calls(
    entries: list[TokenEntry], unreceived_ids: set[str], final_answer: Any
) -> LinkedCalls:
    """Link the calls that generated something, settle their retries, choose the main leaf
    (``unreceived_ids``: the calls whose reply the harness never received)."""
    empty = tuple(sorted(e.model_call_id for e in entries if not e.generation_token_ids))
    calls = sorted(
        (e for e in entries if e.generation_token_ids),
        key=lambda e: (len(e.prompt_token_ids), e.model_call_id),
    )
    calls, unreceived = _without_unreceived(calls, unreceived_ids)
    calls, identical = _fold_identical(calls)
    graph = build_graph(calls)
    ids = graph.ids
    discarded, unresolved = settle_retries(graph)
    kept, roots, leaves = _survivors(graph, discarded)
    main_leaf, main_by, unmatched = _main_leaf(
        calls, ids, leaves, roots, graph.root_of, final_answer
    )
    if main_by == "final_answer" and unresolved:
        # A retry of the final call, none extended: the final answer names the one kept.
        unresolved = _resolve_by_answer(graph, unresolved, ids[main_leaf], discarded)
        kept, roots, leaves = _survivors(graph, discarded)
    return LinkedCalls(
        graph=graph,
        empty=empty,
        unreceived=unreceived,
        identical=identical,
        discarded=discarded,
        unresolved=unresolved,
        roots=roots,
        leaves=leaves,
        main_leaf=main_leaf,
        main_by=main_by,
        unmatched=unmatched,
    )


def _survivors(graph: Graph, discarded: set[int]) -> tuple[list[int], list[int], list[int]]:
    """(kept calls, roots by creation, leaves) once the discarded retries are left out."""
    kept = [position for position in range(len(graph.calls)) if position not in discarded]
    roots = sorted(
        (position for position in kept if graph.parents[position] is None),
        key=lambda position: (graph.calls[position].created_at, graph.ids[position]),
    )
    leaves = [position for position in kept if not graph.has_child[position]]
    return kept, roots, leaves


def _resolve_by_answer(
    graph: Graph, unresolved: list[tuple[str, ...]], main_id: str, discarded: set[int]
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


def _without_unreceived(
    calls: list[TokenEntry], unreceived: set[str]
) -> tuple[list[TokenEntry], tuple[str, ...]]:
    """Calls without the unreceived ones that no kept call extends, and the ids left out.

    Children sort after their parents, so one backward pass settles every call: an
    unreceived call is kept only if one of its kept children extends it.
    """
    if not unreceived.intersection(call.model_call_id for call in calls):
        return calls, ()
    parents, _ = link(calls)
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
