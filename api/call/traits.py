"""What a request shows about its place in a rollout, recorded on its entry for the builder.

A rollout's calls can form several chains: the agent loop, a title call, a sub-agent (its
own system prompt and tools), a compaction summary and the loop that resumes from it. The
builder labels each delivered segment from these traits (``capture.build.segments``) and
checks where each root's conversation began and what leads to it (``capture.build.roots``:
the assistant turns the request carried, the digest of the last one, and for a
conversation's first call the line digests of its opening message). They are read off the
request here, where the request is whole, because the entry keeps only ids. The summary
and continuation patterns are the Claude Code CLI's (2.1.x) wording.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from api.engine.generation import Generation, with_changes
from capture.items import content_text
from capture.records import TRAITS_FIELD
from capture.traits import ANSWERED_BEFORE, OPENING, TURNS_BEFORE, opening_digests, reply_digest

# The CLI's compaction request ("Your task is to create a detailed summary of the
# conversation so far...") and the first message of the loop that resumes from it. Found
# by a plain substring search first: a message can be a whole 16k-token prompt, and a
# case-insensitive pattern tried at every position of it costs milliseconds per call.
SUMMARY_MARK = "summary of"
SUMMARY_REQUEST = re.compile(r"\b(create|write|provide) a (detailed |concise )?summary of$")
CONTINUATION = "this session is being continued from a previous conversation"


def _asks_for_summary(lowered: str) -> bool:
    """Whether a lower-cased message asks for the CLI's compaction summary."""
    at = lowered.find(SUMMARY_MARK)
    while at >= 0:
        if SUMMARY_REQUEST.search(lowered, max(0, at - 40), at + len(SUMMARY_MARK)):
            return True
        at = lowered.find(SUMMARY_MARK, at + 1)
    return False


# The CLI's first system line: "x-anthropic-billing-header: cc_version=2.1.197.<h>; ...",
# where <h> hashes characters of the first user message (so it changes when a compacted
# session resumes) and a sub-agent's line adds "cc_is_subagent=true".
BILLING_HEADER = "x-anthropic-billing-header:"
SUBAGENT_MARK = "cc_is_subagent=true"


def _system_parts(system: str) -> tuple[str, bool]:
    """The system prompt without the CLI's billing line, and whether that line marks a
    sub-agent. The line is per request, not part of the prompt the policy is given."""
    first, _, rest = system.partition("\n")
    if first.strip().startswith(BILLING_HEADER):
        return rest, SUBAGENT_MARK in first
    return system, False


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _texts(messages: list[Mapping[str, Any]], role: str, picks: slice) -> list[str]:
    """The text of the picked messages of ``role`` only: the rest of a long history is
    never joined into strings on the call's path."""
    chosen = [m for m in messages if m.get("role") == role][picks]
    return [content_text(m.get("content")) for m in chosen]


class _Facts:
    """What the traits read off one whole message text; ``opening`` is filled when the text
    first opens a conversation."""

    __slots__ = ("digest", "continuation", "summary_request", "opening")

    def __init__(self, text: str) -> None:
        lowered = text.lower()
        self.digest = _digest(text)
        self.continuation = CONTINUATION in lowered
        self.summary_request = _asks_for_summary(lowered)
        self.opening: tuple[str, ...] | None = None

    def opening_digests(self, text: str) -> list[str]:
        if self.opening is None:
            self.opening = tuple(opening_digests(text))
        return list(self.opening)


# Every call of a rollout repeats its system prompt and first user message, and a GRPO
# group's rollouts share them: for a 64 KB message, lower-casing and digesting it costs
# about 0.24 ms a call, a hit 0.01 ms. Their facts are kept for the texts seen last, keyed
# by the text itself (a hit is exact), each at most KEPT_CHARS long, up to FACTS_CHARS in
# all: enough for the first messages of 1,000 rollouts in flight at 64 KB each.
FACTS_CHARS = 64 << 20
KEPT_CHARS = 1 << 17
_known: OrderedDict[str, _Facts] = OrderedDict()
_kept_chars = 0


def _facts(text: str) -> _Facts:
    """The facts of ``text``, read once while it is among the texts seen last."""
    global _kept_chars
    facts = _known.get(text)
    if facts is not None:
        _known.move_to_end(text)
        return facts
    facts = _Facts(text)
    if len(text) <= KEPT_CHARS:
        _known[text] = facts
        _kept_chars += len(text)
        while _kept_chars > FACTS_CHARS and _known:
            _kept_chars -= len(_known.popitem(last=False)[0])
    return facts


def _structured(body: Mapping[str, Any]) -> bool:
    """A JSON-schema answer was asked for (Anthropic output_config, OpenAI formats)."""
    output_config = body.get("output_config")
    text = body.get("text")
    response_format = body.get("response_format")
    return bool(
        (isinstance(output_config, Mapping) and output_config.get("format"))
        or (
            isinstance(text, Mapping)
            and isinstance(text.get("format"), Mapping)
            and text["format"].get("type") == "json_schema"
        )
        or (isinstance(response_format, Mapping) and response_format.get("type") == "json_schema")
    )


def _summary_request(last_user: list[str], first_users: list[str]) -> bool:
    """Whether the last user message asks for the CLI's compaction summary. A later user
    message is most often a tool's result, seen once: read, and not kept among the facts."""
    if not last_user:
        return False
    last = last_user[0]
    if any(last is text for text in first_users):
        return _facts(last).summary_request
    return _asks_for_summary(last.lower())


def _history(messages: list[Mapping[str, Any]], first_user: str) -> dict[str, Any]:
    """Where the request stands in its conversation: the assistant turns it carries (a
    trailing assistant message is a prefill, not a turn), the digest of the last one, and
    for a conversation's first call the line digests of its opening user message."""
    history = messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages
    answers = [m for m in history if m.get("role") == "assistant"]
    found: dict[str, Any] = {
        TURNS_BEFORE: len(answers),
        ANSWERED_BEFORE: reply_digest(answers[-1]) if answers else None,
    }
    if not answers:
        found[OPENING] = _facts(first_user).opening_digests(first_user)
    return found


def request_traits(body: Mapping[str, Any], chat_request: Mapping[str, Any]) -> dict[str, Any]:
    """The traits of one request, as the entry's ``request_traits`` field."""
    messages = [m for m in chat_request.get("messages") or [] if isinstance(m, Mapping)]
    systems = _texts(messages, "system", slice(0, 1))
    first_users = _texts(messages, "user", slice(0, 2))
    last_user = _texts(messages, "user", slice(-1, None))
    tools = sorted(
        str((tool.get("function") or {}).get("name") or "")
        for tool in chat_request.get("tools") or []
        if isinstance(tool, Mapping)
    )
    system, subagent = _system_parts(systems[0] if systems else "")
    first = [_facts(text) for text in first_users]
    return {
        "system": _facts(system).digest,
        "first_user": first[0].digest if first else _digest(""),
        "subagent": subagent,
        "tools": _digest("\n".join(tools)),
        "n_tools": len(tools),
        "structured_output": _structured(body),
        "summary_request": _summary_request(last_user, first_users),
        "continuation": any(facts.continuation for facts in first),
        **_history(messages, first_users[0] if first_users else ""),
    }


def with_traits(generation: Generation, traits: Mapping[str, Any]) -> Generation:
    """The generation with its request's traits among the fields its entry records."""
    fields = {**generation.entry_fields, TRAITS_FIELD: dict(traits)}
    return with_changes(generation, entry_fields=fields)
