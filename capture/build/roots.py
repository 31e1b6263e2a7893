"""Why each root of a rollout is there: where its conversation began, and what leads to it.

A harness re-sends its whole conversation with every call, so the first call of a
conversation carries no assistant turn and every later call carries the reply of the one
before (the front end records both on the entry: ``turns_before``, ``answered_before``).
A root that carries an assistant turn that no earlier call of the same harness sampled was
seeded: few-shot examples, a session resumed from elsewhere. It is delivered, those turns
in its prompt. Calls lost from the store look the same here, so they are found apart, by
the entries' own stamps (``capture.build.lost_calls``).

Beside the main chain, a root is delivered (``delivery: segments``) only when the capture
itself relates it to what is delivered: a side request of a known shape (a title: a JSON
answer with no tools); a conversation that continues from, or is continued by, a delivered
call's reply (a resumed loop, compaction with a kept round); a conversation whose opening
message carries text a delivered call sampled (a sub-agent's prompt, given as a tool
call's argument), or whose sampled text a delivered conversation opens with (a compaction
summary). Text is compared by line digests, markup tags and whitespace aside, each tagged
section of a reply on its own (a harness that keeps a ``<summary>`` and drops the
``<analysis>`` before it still matches). A conversation that opens like the main run (its
system prompt and tools, no sub-agent mark) is related only by a reply or a compaction
summary, never by a line some call happened to repeat: one that nothing relates so is
most likely a second harness run under the same rollout id, and masks the rollout. Other
roots nothing relates are left out.

Entries without these traits (another front end, older captures) are taken as explained:
what cannot be told is not held against them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture.items import content_text
from capture.records import TokenEntry
from capture.traits import (
    ANSWERED_BEFORE,
    OPENING,
    TAG,
    TURNS_BEFORE,
    is_side_request,
    line_digests,
    reply_digest,
    traits,
)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a parsed JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for inner in value.values():
            yield from _strings(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _strings(inner)


def sampled_pieces(entry: TokenEntry) -> list[list[str]]:
    """What a call sampled, piece by piece (each tagged section of its text, each string of
    its tool arguments), as line digests; pieces with no line worth comparing are left out."""
    texts = []
    for item in entry.output_items or ():
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            texts.append(content_text(item.get("content")))
        elif item.get("type") == "function_call":
            try:
                texts.extend(_strings(json.loads(item.get("arguments") or "null")))
            except (TypeError, ValueError):
                texts.append(str(item.get("arguments") or ""))
    sections = [section for text in texts for section in TAG.split(text)]
    return [digests for digests in map(line_digests, sections) if digests]


def carries(opening: Sequence[str], piece: Sequence[str]) -> bool:
    """Whether an opening message holds at least half of a sampled piece's lines."""
    held = set(opening)
    return 2 * sum(line in held for line in piece) >= len(piece)


@dataclass
class RootCheck:
    """The verdict on a rollout's roots (positions in the builder's call order)."""

    seeded: list[int] = field(default_factory=list)  # carried turns nothing here sampled
    unexplained: list[int] = field(default_factory=list)  # nothing relates them
    second_runs: list[int] = field(default_factory=list)  # unexplained, like the main run


# How much later than a root the call it continues may have been stamped: the clocks of two
# front-end nodes may disagree by that much.
CLOCK_SKEW_S = 1.0
_HARNESS = ("system", "tools", "subagent")


class _Roots:
    """The roots of one build and the links between their conversations (module doc)."""

    def __init__(self, calls: Sequence[TokenEntry], root_of: Sequence[int]) -> None:
        self.calls = calls
        self.root_of = root_of
        self._replies: dict[str, list[int]] | None = None

    @property
    def replies(self) -> dict[str, list[int]]:
        """Calls by the digest of their reply; read only when a root carries a turn."""
        if self._replies is None:
            self._replies = {}
            for position, call in enumerate(self.calls):
                digest = reply_digest(list(call.output_items or ()))
                if digest is not None:
                    self._replies.setdefault(digest, []).append(position)
        return self._replies

    def traits(self, position: int) -> dict[str, Any]:
        return traits(self.calls[position])

    def known(self, root: int) -> bool:
        return TURNS_BEFORE in self.traits(root)

    def same_harness(self, a: int, b: int) -> bool:
        """Calls of one harness loop: the same system prompt, tools and sub-agent mark."""
        mine, theirs = self.traits(a), self.traits(b)
        return all(mine.get(key) == theirs.get(key) for key in _HARNESS)

    def answered_by(self, root: int) -> list[int]:
        """The calls of the same harness, in other trees and not later than ``root``, that
        sampled the last reply ``root``'s request carried."""
        digest = self.traits(root).get(ANSWERED_BEFORE)
        if not digest:
            return []
        at = self.calls[root].created_at + CLOCK_SKEW_S
        return [
            p
            for p in self.replies.get(digest, ())
            if self.root_of[p] != root
            and self.calls[p].created_at <= at
            and self.same_harness(p, root)
        ]

    def begins_mid_conversation(self, root: int) -> bool:
        return bool(self.traits(root).get(TURNS_BEFORE)) and not self.answered_by(root)

    def like_main_run(self, root: int, main_root: int) -> bool:
        """A conversation start of the main chain's harness (not marked a sub-agent)."""
        return (
            not self.traits(root).get(TURNS_BEFORE)
            and not self.traits(root).get("subagent")
            and self.same_harness(root, main_root)
        )

    def links(self, roots: Sequence[int]) -> dict[int, dict[int, bool]]:
        """Roots whose conversations relate (either way), each link marked strong when it
        is a reply carried on or a compaction summary, weak when it is other text."""
        linked: dict[int, dict[int, bool]] = {root: {} for root in roots}

        def link(a: int, b: int, strong: bool) -> None:
            if a != b:
                linked[a][b] = linked[b][a] = strong or linked[a].get(b, False)

        for root in roots:
            for position in self.answered_by(root):
                link(root, self.root_of[position], True)
        openings = {r: set(self.traits(r).get(OPENING) or ()) for r in roots}
        openings = {r: opening for r, opening in openings.items() if opening}
        summaries = [p for p in range(len(self.calls)) if self.traits(p).get("summary_request")]
        for root in roots:  # a loop resumed from a summary, in the harness's own words
            if self.traits(root).get("continuation"):
                at = self.calls[root].created_at + CLOCK_SKEW_S
                for p in summaries:
                    if self.calls[p].created_at <= at:
                        link(root, self.root_of[p], True)
        if openings:
            for position, call in enumerate(self.calls):
                summary = bool(self.traits(position).get("summary_request"))
                for piece in sampled_pieces(call):
                    for root, opening in openings.items():
                        if carries(opening, piece):
                            link(root, self.root_of[position], summary)
        return linked


def check_roots(
    calls: Sequence[TokenEntry], roots: Sequence[int], root_of: Sequence[int], main_root: int
) -> RootCheck:
    """Which roots were seeded with turns nothing here sampled, and which nothing relates
    to the main chain's."""
    found = _Roots(calls, root_of)
    check = RootCheck()
    check.seeded = [r for r in roots if found.known(r) and found.begins_mid_conversation(r)]
    # Titles and roots without traits are explained by what they are; only the rest need
    # the links, which read every call's sampled text.
    doubtful = [
        r
        for r in roots
        if r != main_root and found.known(r) and not is_side_request(found.traits(r))
    ]
    if not doubtful:
        return check
    links = found.links(roots)
    reached, frontier = {main_root}, [main_root]
    while frontier:
        for near, strong in links[frontier.pop()].items():
            if near in reached or (not strong and found.like_main_run(near, main_root)):
                continue
            reached.add(near)
            frontier.append(near)
    check.unexplained = [r for r in doubtful if r not in reached]
    check.second_runs = [r for r in check.unexplained if found.like_main_run(r, main_root)]
    return check
