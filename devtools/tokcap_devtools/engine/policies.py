"""What the engine says: a scripted policy (YAML) or a seeded random one.

A policy returns a :class:`Reply` (optional think text, text, tool calls); the engine turns
it into text with :func:`reply_text`, encodes it and scores every token.

Script format (YAML)::

    entries:                      # first entry that fits wins
      - match: "(?i)title"        # regex searched in the last message's text
        text: '{"title": "Echo hello"}'
      - match: "(?i)crash"
        error: {status: 500, message: "engine overloaded"}   # answer this error instead
      - turn: 0                   # number of assistant turns already in the conversation
        think: "The user wants a command run."
        text: "I'll run it."          # or sampled_words: 6 (words drawn from the model)
        tool_calls:
          - name: Bash
            arguments: {command: "echo hello"}
    default:                      # when no entry fits
      text: "Done."

An entry with both ``turn`` and ``match`` needs both. Tool calls are dropped when the
request offers no tools (or ``tool_choice`` is ``"none"``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from .template import rendered_text

DEFAULT_SCRIPT_PATH = Path(__file__).resolve().parent / "assets" / "default_script.yaml"


@dataclass(frozen=True)
class Reply:
    think: str = ""
    text: str = ""
    tool_calls: tuple[tuple[str, dict], ...] = ()
    # Words the engine samples from the model in place of ``text`` (a sentence ending ".").
    sampled_words: int = 0
    # An HTTP error (status, message) the engine answers instead, for failure tests.
    error: tuple[int, str] | None = None


@dataclass(frozen=True)
class Conversation:
    """What a policy may look at: the messages and the tools the request offers."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    tools_allowed: bool = True

    @property
    def assistant_turns(self) -> int:
        return sum(1 for m in self.messages if m.get("role") == "assistant")

    @property
    def last_text(self) -> str:
        return rendered_text(self.messages[-1].get("content")) if self.messages else ""

    @property
    def tool_names(self) -> list[str]:
        names = []
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and function.get("name"):
                names.append(str(function["name"]))
        return names


class Policy(Protocol):
    def reply(self, conversation: Conversation, rng: random.Random) -> Reply: ...


def reply_text(reply: Reply, separators: tuple[str, str]) -> str:
    """The generated text of a reply, in exactly the form the chat template renders."""
    calls = [
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": args}, ensure_ascii=False, separators=separators)
        + "\n</tool_call>"
        for name, args in reply.tool_calls
    ]
    text = reply.text.strip()
    body = text + ("\n" if text and calls else "") + "\n".join(calls)
    think = reply.think.strip()
    return f"<think>\n{think}\n</think>\n\n{body}" if think else body


def _entry_reply(entry: dict) -> Reply:
    calls = tuple(
        (str(call["name"]), dict(call.get("arguments") or {}))
        for call in entry.get("tool_calls") or []
    )
    error = entry.get("error")
    if error is not None:
        if not isinstance(error, dict):
            error = {"status": error}
        error = (int(error.get("status") or 500), str(error.get("message") or "scripted failure"))
    return Reply(
        str(entry.get("think") or ""),
        str(entry.get("text") or ""),
        calls,
        sampled_words=int(entry.get("sampled_words") or 0),
        error=error,
    )


def _allowed(reply: Reply, conversation: Conversation) -> Reply:
    if reply.tool_calls and not (conversation.tools_allowed and conversation.tools):
        if reply.sampled_words:
            return replace(reply, tool_calls=())
        return replace(reply, text=reply.text or "Done.", tool_calls=())
    return reply


class ScriptedPolicy:
    """Replies from a script, chosen by turn index and/or a regex on the last message."""

    def __init__(self, script: dict) -> None:
        self.entries = list(script.get("entries") or [])
        self.default = _entry_reply(script.get("default") or {"text": "Done."})
        for entry in self.entries:
            if entry.get("match") is not None:
                re.compile(entry["match"])

    @classmethod
    def from_path(cls, path: str | Path | None = None) -> ScriptedPolicy:
        with open(path or DEFAULT_SCRIPT_PATH, encoding="utf-8") as handle:
            return cls(yaml.safe_load(handle) or {})

    def reply(self, conversation: Conversation, rng: random.Random) -> Reply:
        for entry in self.entries:
            turn = entry.get("turn")
            if turn is not None and int(turn) != conversation.assistant_turns:
                continue
            pattern = entry.get("match")
            if pattern is not None and not re.search(pattern, conversation.last_text):
                continue
            return _allowed(_entry_reply(entry), conversation)
        return _allowed(self.default, conversation)


WORDS = (
    "the file lists output command run check result shows value done next step read "
    "write test passes error fixed directory contains script prints hello world config "
    "updated returns line number first then"
).split()


class RandomPolicy:
    """Seeded random replies: sampled text, sometimes a think block, sometimes tool calls.

    The text is left to the engine (``sampled_words``), which draws it from the model with
    the request's seed; think text and tool arguments are seeded choices of plain words.
    """

    def __init__(self, max_tool_turns: int = 3) -> None:
        self.max_tool_turns = max_tool_turns

    def _arguments(self, tool: dict, rng: random.Random) -> dict:
        params = (tool.get("function") or {}).get("parameters") or {}
        props = params.get("properties") or {}
        required = params.get("required") or list(props)[:1]
        args: dict[str, Any] = {}
        for name in required:
            kind = (props.get(name) or {}).get("type", "string")
            if kind in ("integer", "number"):
                args[name] = rng.randint(1, 100)
            elif kind == "boolean":
                args[name] = rng.random() < 0.5
            else:
                args[name] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        return args

    def reply(self, conversation: Conversation, rng: random.Random) -> Reply:
        words = rng.randint(3, 12)
        think = ""
        if rng.random() < 0.3:
            think = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        calls: tuple[tuple[str, dict], ...] = ()
        tools = [t for t in conversation.tools if (t.get("function") or {}).get("name")]
        if (
            tools
            and conversation.tools_allowed
            and conversation.assistant_turns < self.max_tool_turns
            and rng.random() < 0.7
        ):
            chosen = [rng.choice(tools) for _ in range(rng.randint(1, 2))]
            calls = tuple((t["function"]["name"], self._arguments(t, rng)) for t in chosen)
            if rng.random() < 0.5:
                words = 0
        return Reply(think, "", calls, sampled_words=words)


def make_policy(name: str, script_path: str | None = None) -> Policy:
    if name == "scripted":
        return ScriptedPolicy.from_path(script_path)
    if name == "random":
        return RandomPolicy()
    raise ValueError(f"unknown policy {name!r}: use 'scripted' or 'random'")
