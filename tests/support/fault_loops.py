"""Concurrent harness loops under faults, checked against the engine's ground truth.

Each rollout is a streamed tool loop over the official ``anthropic`` SDK, as Claude Code
runs one: the SDK retries a 503 on its own, and the loop keeps every reply it was answered
with. Afterwards each rollout is rebuilt from its final answer (the last reply it got, even
when the loop ended in an error) and checked for the one property a trainer relies on:

    unmasked  =>  the delivered calls are exactly the calls the harness was answered for,
                  in order, each with the ids and log-probs the engine sampled.

A rollout that breaks it is *critical*; every fault test asserts there are none. The engine
runs a scripted policy whose replies are words it samples (so every call differs) plus one
tool call per turn, until the harness asks for its final answer with ``tool_choice: none``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import yaml

from capture.delivery import finalize_rollout_token_capture
from capture.rollout_ids import capture_base_url
from tokcap_devtools.engine.ground_truth import read_jsonl

MAX_TURNS = 12
TOOL = {
    "name": "list_files",
    "description": "List the files in a directory.",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    },
}
# Hooks a scenario may run before each turn: (rollout, turn index) -> awaitable.
BeforeTurn = Callable[["Rollout", int], Awaitable[None]]


def write_script(path: Path) -> str:
    """The engine's script: sampled words and one tool call per turn, words at the end."""
    entries = [
        {
            "turn": turn,
            "sampled_words": 4 + turn % 5,
            "tool_calls": [{"name": TOOL["name"], "arguments": {"path": f"dir-{turn}"}}],
        }
        for turn in range(MAX_TURNS)
    ]
    path.write_text(yaml.safe_dump({"entries": entries, "default": {"sampled_words": 8}}))
    return str(path)


@dataclass
class Rollout:
    """One harness run: what it asked for and every reply it was answered with."""

    rollout_id: str
    turns: int
    answered: list[Any] = field(default_factory=list)  # anthropic Message objects, in order
    error: str | None = None
    task: str = ""  # the first user message; by default it names the rollout

    def __post_init__(self) -> None:
        self.task = self.task or f"Rollout {self.rollout_id}: list the directories one by one."


@dataclass
class Tally:
    """What the harness side saw, over all loops: HTTP statuses and the error messages."""

    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    async def on_response(self, response: Any) -> None:
        if "/v1/messages" not in response.url.path:
            return
        self.statuses[response.status_code] += 1
        if response.status_code >= 400:
            await response.aread()
            self.errors[f"{response.status_code} {response.text[:160]}"] += 1


def harness_client(tally: Tally) -> Any:
    """One HTTP client for every loop (the SDK's own kind), counting the statuses it gets."""
    return anthropic.DefaultAsyncHttpxClient(
        timeout=120.0, event_hooks={"response": [tally.on_response]}
    )


async def tool_loop(
    front: str,
    rollout: Rollout,
    http: Any,
    *,
    max_retries: int = 3,
    before_turn: BeforeTurn | None = None,
    tool_output_chars: int = 0,
    stream: bool = True,
) -> Rollout:
    """Run one rollout's loop to its end, or to the first error the SDK gives up on; each
    tool result is padded to about ``tool_output_chars`` characters, when given. Calls are
    streamed, as Claude Code's are, unless ``stream`` is False."""
    client = anthropic.AsyncAnthropic(
        base_url=capture_base_url(front, rollout.rollout_id),
        api_key="fault-suite",
        max_retries=max_retries,
        http_client=http,
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": rollout.task}]
    try:
        for turn in range(rollout.turns):
            if before_turn is not None:
                await before_turn(rollout, turn)
            last = turn == rollout.turns - 1
            call = {
                "model": "m",
                "max_tokens": 256,
                "messages": messages,
                "tools": [TOOL],
                "tool_choice": {"type": "none"} if last else {"type": "auto"},
            }
            if stream:
                async with client.messages.stream(**call) as events:
                    reply = await events.get_final_message()
            else:
                reply = await client.messages.create(**call)
            rollout.answered.append(reply)
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in reply.content],
                }
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            results = [
                {
                    "type": "tool_result",
                    "tool_use_id": u.id,
                    "content": _listing(u.input, tool_output_chars),
                }
                for u in uses
            ]
            messages.append({"role": "user", "content": results})
    except Exception as exc:  # the harness gave up: its record ends at its last reply
        rollout.error = f"{type(exc).__name__}: {exc}"
    return rollout


def _listing(arguments: Any, chars: int) -> str:
    """A tool's output: what it listed, padded with file names to about ``chars``."""
    head = f"{arguments} holds a.txt"
    names = "".join(f"\nfile-{n}.txt" for n in range(max(0, chars - len(head)) // 14))
    return head + names


async def run_loops(
    front: str,
    rollouts: Iterable[Rollout],
    http: Any,
    **options: Any,
) -> list[Rollout]:
    return list(await asyncio.gather(*(tool_loop(front, r, http, **options) for r in rollouts)))


def final_record(rollout: Rollout) -> dict[str, Any]:
    """The record a collector submits: the last reply the harness got is its answer."""
    output: list[dict[str, Any]] = []
    if rollout.answered:
        last = rollout.answered[-1]
        text = "".join(b.text for b in last.content if b.type == "text")
        output.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        )
        for block in last.content:
            if block.type == "tool_use":
                output.append(
                    {
                        "type": "function_call",
                        "call_id": block.id,
                        "name": block.name,
                        "arguments": json.dumps(block.input),
                    }
                )
    return {"_ng_rollout_id": rollout.rollout_id, "response": {"output": output}}


@dataclass
class Engine:
    """The scripted engine of a fault test: its URL and its ground-truth log."""

    url: str
    truth_path: Path

    def truth(self) -> GroundTruth:
        return GroundTruth(self.truth_path)


class GroundTruth:
    """The engine's JSONL log, indexed by (prompt ids, generated ids)."""

    def __init__(self, path: str | Path) -> None:
        self.records = read_jsonl(path)
        self._by_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], list[dict[str, Any]]] = {}
        self._by_prompt: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        for record in self.records:
            key = (tuple(record["prompt_token_ids"]), tuple(record["token_ids"]))
            self._by_ids.setdefault(key, []).append(record)
            self._by_prompt.setdefault(key[0], []).append(record)

    def parts(self, carrier: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The engine's records a carrier continued across a weight update is made of: a
        cut record (``finish_reason: abort``) and what continued it from its prompt and the
        ids sampled so far, in order; None when its ids are not such a chain."""
        prompt, ids = list(carrier["prompt_token_ids"]), list(carrier["generation_token_ids"])
        parts: list[dict[str, Any]] = []
        done = 0
        while done < len(ids):  # a part cut before it sampled anything adds nothing: skipped
            found = [
                record
                for record in self._by_prompt.get(tuple(prompt + ids[:done]), [])
                if record["token_ids"]
                and record["token_ids"] == ids[done : done + len(record["token_ids"])]
            ]
            if len(found) != 1 or (parts and parts[-1]["finish_reason"] != "abort"):
                return None
            parts.append(found[0])
            done += len(found[0]["token_ids"])
        if not parts or parts[-1]["finish_reason"] == "abort":
            return None
        log_probs = [value for part in parts for value in part["logprobs"]]
        return parts if log_probs == list(carrier["generation_log_probs"]) else None

    def sampled(self, carrier: dict[str, Any]) -> list[dict[str, Any]]:
        """The engine's records with exactly this item's ids and log-probs."""
        key = (tuple(carrier["prompt_token_ids"]), tuple(carrier["generation_token_ids"]))
        return [
            record
            for record in self._by_ids.get(key, [])
            if record["logprobs"] == carrier["generation_log_probs"]
        ]


def _same_reply(sampled: dict[str, Any], reply: Any) -> bool:
    """Whether the engine's record is the call that produced this reply to the harness: its
    tool calls (by id where the engine named them, as text prompts pass them on; by name and
    arguments where the front end parsed the ids itself, as faithful prompts do) and text."""
    uses = [b for b in reply.content if b.type == "tool_use"]
    text = "".join(b.text for b in reply.content if b.type == "text")
    calls = sampled.get("tool_calls") or []
    same_ids = [b.id for b in uses] == [call["id"] for call in calls]
    same_calls = [(b.name, b.input) for b in uses] == [
        (call["function"]["name"], json.loads(call["function"]["arguments"] or "{}"))
        for call in calls
    ]
    if (same_ids or same_calls) and text.strip() == (sampled.get("content") or "").strip():
        return True
    # A token-in call (faithful prompts): the engine parsed nothing, the front end parsed
    # its sampled text into the reply.
    raw = sampled.get("text") or ""
    found = [
        json.loads(body)
        for body in re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", raw, re.S)
    ]
    raw_calls = [(call.get("name"), call.get("arguments") or {}) for call in found]
    if not uses and _words(text) == _words(raw):
        return True  # tool_choice none: the calls the policy wrote stay text, tags aside
    head = raw.split("<tool_call>")[0]
    return [(b.name, b.input) for b in uses] == raw_calls and text.strip() == head.strip()


def _words(text: str) -> list[str]:
    return re.sub(r"</?tool_call>", " ", text).split()


def violation(rollout: Rollout, record: dict[str, Any], truth: GroundTruth) -> str | None:
    """What breaks the property for this rollout, or None when it holds."""
    if record.get("mask_sample"):
        return None
    if "_ng_token_capture" not in record:
        return "never rebuilt"
    output = record["response"]["output"]
    carriers = [item for item in output if "generation_token_ids" in item]
    if len(carriers) != len(rollout.answered):
        return f"unmasked with {len(carriers)} calls; the harness got {len(rollout.answered)}"
    for turn, (carrier, reply) in enumerate(zip(carriers, rollout.answered, strict=True)):
        sampled = truth.sampled(carrier)
        if not sampled and carrier.get("policy_version_spans"):
            problem = _continued_problem(carrier, truth)
            if problem is not None:
                return f"turn {turn}: {problem}"
            continue
        if not sampled:
            return f"turn {turn}: delivered ids or log-probs the engine never sampled"
        if not any(_same_reply(record, reply) for record in sampled):
            return f"turn {turn}: delivered a call other than the one the harness was answered by"
    return None


def _continued_problem(carrier: dict[str, Any], truth: GroundTruth) -> str | None:
    """What is wrong with a call continued across a weight update, or None: its parts are
    the engine's, in order, and each span's version is the one that sampled it."""
    parts = truth.parts(carrier)
    if parts is None:
        return "delivered a continued call whose parts the engine never sampled"
    versions = [version for _, _, version in carrier["policy_version_spans"]]
    if versions != [part["weight_version"] for part in parts]:
        return f"spans name versions {versions}, the engine sampled with others"
    return None


async def rebuild(source: Any, rollouts: list[Rollout]) -> list[dict[str, Any]]:
    """Each rollout's record, rebuilt through ``source`` as a trainer would."""
    records = []
    for rollout in rollouts:
        record = final_record(rollout)
        await finalize_rollout_token_capture(record, source)
        records.append(record)
    return records


@dataclass
class Outcome:
    """One scenario's figures: the closing-note table's row."""

    fault: str
    rollouts: int
    masked: int
    critical: list[str]
    answered_calls: int
    failed_loops: int
    statuses: dict[int, int]
    mask_reasons: dict[str, int]
    errors: dict[str, int]  # the error replies the harnesses got, by status and message
    masked_rollouts: list[str] = field(default_factory=list)

    def row(self) -> str:
        return (
            f"{self.fault}: {self.rollouts} rollouts, {self.masked} masked, "
            f"{len(self.critical)} critical, {self.answered_calls} answered calls, "
            f"{self.failed_loops} loops gave up, harness statuses {dict(sorted(self.statuses.items()))}, "
            f"masked for {self.mask_reasons}"
        )


def _reasons(records: list[dict[str, Any]]) -> Counter[str]:
    """Why rollouts were masked, by the first words of each reason (ids stripped)."""
    reasons: Counter[str] = Counter()
    for record in records:
        if record.get("mask_sample"):
            for reason in record["_ng_token_capture"].get("mask_reasons") or ["?"]:
                reasons[reason.split(":")[0]] += 1
    return reasons


def judge(
    fault: str,
    rollouts: list[Rollout],
    records: list[dict[str, Any]],
    truth: GroundTruth,
    tally: Tally,
) -> Outcome:
    critical = []
    for rollout, record in zip(rollouts, records, strict=True):
        problem = violation(rollout, record, truth)
        if problem is not None:
            critical.append(f"{rollout.rollout_id}: {problem}")
    outcome = Outcome(
        fault=fault,
        rollouts=len(rollouts),
        masked=sum(bool(record.get("mask_sample")) for record in records),
        critical=critical,
        answered_calls=sum(len(r.answered) for r in rollouts),
        failed_loops=sum(r.error is not None for r in rollouts),
        statuses=dict(tally.statuses),
        mask_reasons=dict(_reasons(records)),
        errors=dict(tally.errors),
        masked_rollouts=[
            r.rollout_id
            for r, record in zip(rollouts, records, strict=True)
            if record.get("mask_sample")
        ],
    )
    print(outcome.row())  # the closing note's table; shown with pytest -s
    return outcome
