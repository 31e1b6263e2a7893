"""Why each root of a rollout is there: where its conversation began, and what leads to it.

A harness re-sends its whole conversation with every call, so the first call of a
conversation carries no assistant turn and every later call carries the reply of the one
before (the front end records both on the entry: ``turns_before``, ``answered_before``).
A root that carries an assistant turn that no earlier captured call sampled began in the
middle of its conversation: the calls before it were lost (a Redis that evicted the
rollout's hash, which the next put made anew, or a capture deleted while the harness ran).
Its chain must never be delivered as if it were the whole conversation.

Beside the main chain, a root is delivered (``delivery: segments``) only when the capture
itself relates it to what is delivered: a side request of a known shape (a title: a JSON
answer with no tools); a conversation that continues from, or is continued by, a delivered
call's reply (a resumed loop, compaction with a kept round); a conversation whose opening
message carries text a delivered call sampled (a sub-agent's prompt, given as a tool
call's argument), or whose sampled text a delivered conversation opens with (a compaction
summary). Text is compared by line digests, markup tags and whitespace aside, so a harness
that re-wraps the text still matches. A root nothing explains is not delivered; one that
opens another conversation with the main chain's system prompt and tools is most likely a
second harness run under the same rollout id, and masks the rollout.

Entries without these traits (another front end, older captures) are taken as explained:
what cannot be told is not held against them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from capture.build.final_answer import reply_digest
from capture.build.projection import content_text
from capture.build.segments import traits
from capture.records import TokenEntry

TURNS_BEFORE = "turns_before"  # assistant turns the request carried
ANSWERED_BEFORE = "answered_before"  # reply_digest of the last of them, or None
OPENING = "opening"  # line digests of the first user message (conversation starts only)
MAX_OPENING_LINES = 256
# Lines shorter than this say too little to relate two conversations ("Done.", "dir-3").
MIN_LINE_CHARS = 16
_TAG = re.compile(r"</?[A-Za-z][\w.-]*(?:\s[^<>]*)?/?>")


def line_digests(text: str) -> list[str]:
    """One short digest per line worth comparing, markup tags and spacing aside."""
    digests = []
    for line in _TAG.sub("\n", text).splitlines():
        words = " ".join(line.split())
        if len(words) >= MIN_LINE_CHARS:
            digests.append(hashlib.blake2b(words.encode(), digest_size=6).hexdigest())
    return digests


def opening_digests(text: str) -> list[str]:
    """The line digests a conversation start records of its first user message."""
    return list(dict.fromkeys(line_digests(text)))[:MAX_OPENING_LINES]


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
    """What a call sampled, piece by piece (its text, each string of its tool arguments),
    as line digests; pieces with no line worth comparing are left out."""
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
    return [digests for digests in map(line_digests, texts) if digests]


def carries(opening: Sequence[str], piece: Sequence[str]) -> bool:
    """Whether an opening message holds at least half of a sampled piece's lines."""
    held = set(opening)
    return 2 * sum(line in held for line in piece) >= len(piece)


@dataclass
class RootCheck:
    """The verdict on a rollout's roots (positions in the builder's call order)."""

    missing_start: list[int] = field(default_factory=list)  # began mid-conversation
    unexplained: list[int] = field(default_factory=list)  # nothing relates them
    second_runs: list[int] = field(default_factory=list)  # unexplained, like the main run


class _Roots:
    """The roots of one build and the links between their conversations (module doc)."""

    def __init__(self, calls: Sequence[TokenEntry], root_of: Sequence[int]) -> None:
        self.calls = calls
        self.root_of = root_of
        self._replies: dict[str, list[int]] | None = None

    @property
    def replies(self) -> dict[str, list[int]]:
        """Calls by the digest of their reply; read only when a root needs it (a rollout of
        one conversation start, the usual case, never does)."""
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

    def side_request(self, root: int) -> bool:
        """A request of a shape harnesses send beside their loop: a title (JSON, no tools)."""
        found = self.traits(root)
        return bool(found.get("structured_output")) and not found.get("n_tools")

    def answered_by(self, root: int) -> list[int]:
        """The earlier calls that sampled the last reply ``root``'s request carried."""
        digest = self.traits(root).get(ANSWERED_BEFORE)
        if not digest:
            return []
        at = self.calls[root].created_at
        return [p for p in self.replies.get(digest, ()) if self.calls[p].created_at <= at]

    def begins_mid_conversation(self, root: int) -> bool:
        return bool(self.traits(root).get(TURNS_BEFORE)) and not self.answered_by(root)

    def links(self, roots: Sequence[int]) -> dict[int, set[int]]:
        """Roots whose conversations relate (either way), by an answered reply or by an
        opening message that carries what a call sampled."""
        linked: dict[int, set[int]] = {root: set() for root in roots}

        def link(a: int, b: int) -> None:
            linked[a].add(b)
            linked[b].add(a)

        openings = {r: self.traits(r).get(OPENING) for r in roots if self.traits(r).get(OPENING)}
        for root in roots:
            for position in self.answered_by(root):
                link(root, self.root_of[position])
        if openings:
            for position, call in enumerate(self.calls):
                for piece in sampled_pieces(call):
                    for root, opening in openings.items():
                        if carries(opening, piece):
                            link(root, self.root_of[position])
        return linked

    def like_main_run(self, root: int, main_root: int) -> bool:
        """A conversation start with the main chain's system prompt and tools."""
        mine, main = self.traits(root), self.traits(main_root)
        return (
            not mine.get(TURNS_BEFORE)
            and not mine.get("subagent")
            and (mine.get("system"), mine.get("tools")) == (main.get("system"), main.get("tools"))
        )


def check_roots(
    calls: Sequence[TokenEntry], roots: Sequence[int], root_of: Sequence[int], main_root: int
) -> RootCheck:
    """Which roots began mid-conversation, and which nothing relates to the main chain's."""
    found = _Roots(calls, root_of)
    check = RootCheck()
    check.missing_start = [r for r in roots if found.known(r) and found.begins_mid_conversation(r)]
    others = [r for r in roots if r != main_root]
    if not others:
        return check
    links = found.links(roots)
    reached, frontier = {main_root}, [main_root]
    while frontier:
        for near in links[frontier.pop()] - reached:
            reached.add(near)
            frontier.append(near)
    check.unexplained = [
        r for r in others if r not in reached and found.known(r) and not found.side_request(r)
    ]
    check.second_runs = [r for r in check.unexplained if found.like_main_run(r, main_root)]
    return check
