"""Every chain, delivered: the segments beside the main chain, and what each one is.

With ``delivery: segments`` the rebuilt record keeps the main chain in ``response.output``
and adds every other chain as a contiguous segment, so no sampled token is left out
silently. Chains share their first calls (a retry branches, a summary request extends the
loop it summarizes), and a call is delivered once: a segment holds the calls of its chain
that no earlier delivery holds, and its first call's prompt carries the shared part as
context. A chain with an ambiguous call is not delivered.

A segment's role comes from the traits the front end recorded on each entry
(``api.call.traits``, under ``TRAITS_FIELD``): ``compaction_summary`` (its last call asked for a
summary), ``continuation`` (it resumes from a summary), ``title`` (a JSON answer with no
tools), ``subagent`` (the request says so, or another system prompt or tool set than the
main chain's), else ``other``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from capture.build.projection import project_chain
from capture.errors import ConfigError
from capture.records import TokenEntry
from capture.traits import is_side_request, traits

SEGMENTS_KEY = "_ng_token_segments"
# What a rebuild delivers: the main chain only, or every other chain too, as segments.
Delivery = Literal["chain", "segments"]
DELIVERIES: tuple[str, ...] = get_args(Delivery)
ROLES = ("subagent", "compaction_summary", "title", "continuation", "other")


def checked_delivery(delivery: str) -> Delivery:
    """``delivery`` when it is one of ``DELIVERIES``; a config error naming them otherwise."""
    if delivery not in DELIVERIES:
        raise ConfigError(f"delivery must be one of {', '.join(DELIVERIES)}, not {delivery!r}")
    return delivery  # type: ignore[return-value]


@dataclass(frozen=True)
class Segment:
    """One delivered chain beside the main one: its calls, in order, and its role."""

    role: str
    calls: tuple[TokenEntry, ...]

    @property
    def generated_tokens(self) -> int:
        return sum(len(call.generation_token_ids) for call in self.calls)

    def as_dict(self) -> dict[str, Any]:
        """The segment as a record carries it under ``_ng_token_segments``."""
        return {
            "role": self.role,
            "calls": [call.model_call_id for call in self.calls],
            "output": project_chain(self.calls),
            "metrics": {"n_calls": len(self.calls), "generated_tokens": self.generated_tokens},
        }


def role_of(first: TokenEntry, last: TokenEntry, main_root: TokenEntry | None) -> str:
    """What a chain is, from its root's and its last call's traits (see the module doc);
    ``main_root`` is the main chain's root (or the rollout's first), None for the main one."""
    root, last_traits = traits(first), traits(last)
    if last_traits.get("summary_request"):
        return "compaction_summary"
    if root.get("continuation"):
        return "continuation"
    if is_side_request(root):
        return "title"
    if root.get("subagent"):  # the harness said so (the Claude Code CLI does)
        return "subagent"
    main = traits(main_root) if main_root is not None else {}
    if (
        root
        and main
        and (root.get("system"), root.get("tools"))
        != (
            main.get("system"),
            main.get("tools"),
        )
    ):
        return "subagent"
    return "other"


def segments_of(
    calls: Sequence[TokenEntry], paths: Sequence[Sequence[int]], main_path: Sequence[int]
) -> list[Segment]:
    """The segments of the chains ``paths`` (root-to-leaf call positions, in delivery
    order), each holding the calls no earlier delivery holds; the main chain goes first."""
    delivered = set(main_path)
    main_root = calls[main_path[0]] if main_path else None
    segments = []
    for path in paths:
        fresh = [position for position in path if position not in delivered]
        if not fresh:
            continue
        delivered.update(fresh)
        role = role_of(calls[path[0]], calls[path[-1]], main_root)
        segments.append(Segment(role, tuple(calls[p] for p in fresh)))
    return segments
