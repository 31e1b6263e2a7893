"""Tool loops in every dialect through the official SDKs, judged against the ground truth.

A loop is what a harness runs: ask, run the tools the reply calls, send the results back
with the whole history as the SDK returned it, until the model answers in text. The
engine's script (``write_script``) thinks on most turns and calls a tool with nested JSON
arguments until a tool result says ``finish``. Afterwards each rollout is rebuilt from its
final answer and judged: ``one_chain`` (unmasked, one chain through every answered call,
everything sampled delivered), and ``wrong`` (unmasked, but the delivered calls are not
exactly the answered ones with the ids and log-probs the engine sampled).
"""

from __future__ import annotations

import asyncio
import importlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
import yaml

from capture.delivery import finalize_rollout_token_capture
from capture.rollout_ids import capture_base_url
from tests.support.fault_loops import GroundTruth

DIALECTS = ("anthropic", "chat", "responses")
TOOL_NAME = "list_files"
PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "recursive": {"type": "boolean"}},
    "required": ["path"],
}
ARGUMENTS = {"path": "src/data", "recursive": False, "filter": {"suffix": ".py", "max": 20}}


def write_script(path: Path) -> str:
    """Think and call the tool (most turns), call it without thinking, or finish in text."""
    call = [{"name": TOOL_NAME, "arguments": ARGUMENTS}]
    script = {
        "entries": [
            {"match": "finish", "think": "All listed; I can answer.", "text": "Done: 3 files."},
            {"match": "quick", "text": "Next directory.", "tool_calls": call},
        ],
        "default": {
            "think": "I should list the next directory.",
            "text": "Listing.",
            "tool_calls": call,
        },
    }
    path.write_text(yaml.safe_dump(script))
    return str(path)


@dataclass
class Loop:
    rollout_id: str
    dialect: str
    stream: bool
    turns: int
    # A user note beside each round of tool results, as Claude Code sends system reminders:
    # a new user query, before which Qwen3's template drops earlier thinking.
    remind: bool = False
    replies: list[dict[str, Any]] = field(default_factory=list)  # text and tool ids, in order
    error: str | None = None


@dataclass
class Harness:
    """Where the loops send their calls (turn t goes to ``fronts[t % len(fronts)]``), over
    one HTTP client that opens a new connection per call (so a multi-worker server spreads
    them) and counts the ``x-tokcap-prompt`` headers it gets."""

    fronts: list[str]
    prompts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        # Each SDK insists on its own HTTP client class (the anthropic SDK may ship its own
        # httpx), so each gets one, built the same way.
        self.anthropic_http = self._client(anthropic)
        self.openai_http = self._client(openai)

    def _client(self, sdk: Any) -> Any:
        # The HTTP package the SDK's client class is built on (httpx, or its httpx2 fork).
        http = importlib.import_module(sdk.DefaultAsyncHttpxClient.__mro__[1].__module__)
        return sdk.DefaultAsyncHttpxClient(
            timeout=120.0,
            limits=http.Limits(max_keepalive_connections=0),
            event_hooks={"response": [self._on_response]},
        )

    async def close(self) -> None:
        await self.anthropic_http.aclose()
        await self.openai_http.aclose()

    async def _on_response(self, response: Any) -> None:
        how = response.headers.get("x-tokcap-prompt")
        if how:
            self.prompts[how] += 1

    def base(self, loop: Loop, turn: int) -> str:
        return capture_base_url(self.fronts[turn % len(self.fronts)], loop.rollout_id)


def _result_text(loop: Loop, turn: int) -> str:
    """The tool's output; it tells the policy to finish on the loop's last turn."""
    if turn + 2 >= loop.turns:
        return "3 files. finish"
    return "a.py b.py" + (" quick" if turn % 3 == 2 else "")


def _reminder(loop: Loop, turn: int) -> list[str]:
    """The user note after this round's results (it repeats the cue the script reads)."""
    return [f"Reminder: {_result_text(loop, turn)}"] if loop.remind else []


async def _anthropic(harness: Harness, loop: Loop) -> None:
    tools = [{"name": TOOL_NAME, "description": "List files.", "input_schema": PARAMETERS}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{loop.rollout_id}: list."}]
    for turn in range(loop.turns):
        client = anthropic.AsyncAnthropic(
            base_url=harness.base(loop, turn),
            api_key="k",
            max_retries=0,
            http_client=harness.anthropic_http,
        )
        kwargs = {"model": "m", "max_tokens": 512, "messages": messages, "tools": tools}
        if loop.stream:
            async with client.messages.stream(**kwargs) as stream:
                reply = await stream.get_final_message()
        else:
            reply = await client.messages.create(**kwargs)
        uses = [b for b in reply.content if b.type == "tool_use"]
        text = "".join(b.text for b in reply.content if b.type == "text")
        loop.replies.append({"text": text, "tool_ids": [u.id for u in uses]})
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        if not uses:
            return
        results = [
            {"type": "tool_result", "tool_use_id": u.id, "content": _result_text(loop, turn)}
            for u in uses
        ]
        results += [{"type": "text", "text": note} for note in _reminder(loop, turn)]
        messages.append({"role": "user", "content": results})


def _openai(harness: Harness, loop: Loop, turn: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=harness.base(loop, turn) + "/v1",
        api_key="k",
        max_retries=0,
        http_client=harness.openai_http,
    )


async def _chat(harness: Harness, loop: Loop) -> None:
    tools = [{"type": "function", "function": {"name": TOOL_NAME, "parameters": PARAMETERS}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{loop.rollout_id}: list."}]
    for turn in range(loop.turns):
        client = _openai(harness, loop, turn)
        kwargs = {"model": "m", "max_tokens": 512, "messages": messages, "tools": tools}
        if loop.stream:
            async with client.chat.completions.stream(**kwargs) as stream:
                completion = await stream.get_final_completion()
        else:
            completion = await client.chat.completions.create(**kwargs)
        message = completion.choices[0].message
        calls = message.tool_calls or []
        loop.replies.append({"text": message.content or "", "tool_ids": [c.id for c in calls]})
        # As chat clients do: content and tool calls go back; the reasoning does not.
        echoed: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            echoed["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in calls]
        messages.append(echoed)
        if not calls:
            return
        for call in calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": _result_text(loop, turn)}
            )
        messages += [{"role": "user", "content": note} for note in _reminder(loop, turn)]


async def _responses(harness: Harness, loop: Loop) -> None:
    tools = [{"type": "function", "name": TOOL_NAME, "parameters": PARAMETERS}]
    items: list[Any] = [{"role": "user", "content": f"{loop.rollout_id}: list."}]
    for turn in range(loop.turns):
        client = _openai(harness, loop, turn)
        kwargs = {"model": "m", "max_output_tokens": 512, "input": items, "tools": tools}
        if loop.stream:
            async with client.responses.stream(**kwargs) as stream:
                response = await stream.get_final_response()
        else:
            response = await client.responses.create(**kwargs)
        calls = [item for item in response.output if item.type == "function_call"]
        loop.replies.append({"text": response.output_text, "tool_ids": [c.call_id for c in calls]})
        items += [item.model_dump(exclude_none=True) for item in response.output]
        if not calls:
            return
        for call in calls:
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": _result_text(loop, turn),
                }
            )
        items += [{"role": "user", "content": note} for note in _reminder(loop, turn)]


RUNNERS = {"anthropic": _anthropic, "chat": _chat, "responses": _responses}


async def run_loop(harness: Harness, loop: Loop) -> Loop:
    try:
        await RUNNERS[loop.dialect](harness, loop)
    except Exception as exc:  # the record ends at the last reply; the judge says so
        loop.error = f"{type(exc).__name__}: {exc}"
    return loop


async def run_loops(harness: Harness, loops: list[Loop]) -> list[Loop]:
    try:
        return list(await asyncio.gather(*(run_loop(harness, loop) for loop in loops)))
    finally:
        await harness.close()


def final_record(loop: Loop) -> dict[str, Any]:
    text = loop.replies[-1]["text"] if loop.replies else ""
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    ]
    return {"_ng_rollout_id": loop.rollout_id, "response": {"output": output}}


def _calls(output: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The delivered output items grouped by call (each call's items end at its carrier)."""
    calls, current = [], []
    for item in output:
        current.append(item)
        if "generation_token_ids" in item:
            calls.append(current)
            current = []
    return calls


def wrong(loop: Loop, record: dict[str, Any], truth: GroundTruth) -> str | None:
    """Why an unmasked record is not the answered calls as sampled, or None.

    A record may deliver fewer calls than were answered only when it says so (more than one
    chain, a delivered fraction below one); those it delivers must then be answered calls
    in the order they were answered, ending with the last: the chain the final answer ends
    (a call whose sampled ids the next prompt re-rendered otherwise is context there, not
    a delivered call).
    """
    if record.get("mask_sample"):
        return None
    metrics = record["_ng_token_capture"]
    calls = _calls(record["response"]["output"])
    if len(calls) != len(loop.replies):
        reported = metrics["chains"] > 1 and metrics["delivered_fraction"] < 1.0
        if not reported or not calls or len(calls) > len(loop.replies):
            return f"unmasked with {len(calls)} calls; the harness was answered {len(loop.replies)}"
    replies = iter(loop.replies)
    for turn, items in enumerate(calls):
        if not truth.sampled(items[-1]):
            return f"call {turn}: ids or log-probs the engine never sampled"
        served = [item["call_id"] for item in items if item.get("type") == "function_call"]
        if not any(reply["tool_ids"] == served for reply in replies):
            return f"call {turn}: not an answered call, in the order answered"
    if served != loop.replies[-1]["tool_ids"]:
        return "the delivered chain does not end in the last answered call"
    return None


@dataclass
class Figures:
    """One serving configuration's row: the issue's table."""

    rollouts: int = 0
    one_chain: int = 0
    masked: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    captured_tokens: int = 0
    delivered_tokens: int = 0

    @property
    def delivered_share(self) -> float:
        return self.delivered_tokens / self.captured_tokens if self.captured_tokens else 0.0

    def row(self, name: str) -> str:
        return (
            f"| {name} | {self.one_chain}/{self.rollouts} one chain | "
            f"{self.delivered_share:.1%} of sampled tokens delivered | {self.masked} masked | "
            f"{len(self.wrong)} wrong | {len(self.errors)} loop errors |"
        )


async def judge(source: Any, loops: list[Loop], truth: GroundTruth) -> Figures:
    figures = Figures()
    for loop in loops:
        record = final_record(loop)
        build = await finalize_rollout_token_capture(record, source)
        metrics = build.metrics
        figures.rollouts += 1
        figures.masked += bool(record.get("mask_sample"))
        figures.captured_tokens += metrics["generated_tokens_captured"]
        if not record.get("mask_sample"):
            figures.delivered_tokens += metrics["generated_tokens_delivered"]
        if (
            not record.get("mask_sample")
            and metrics["chains"] == 1
            and metrics["n_calls"] == len(loop.replies)
            and metrics["delivered_fraction"] == 1.0
        ):
            figures.one_chain += 1
        problem = wrong(loop, record, truth)
        if problem is not None:
            figures.wrong.append(f"{loop.rollout_id}: {problem}")
        if loop.error is not None:
            figures.errors.append(f"{loop.rollout_id}: {loop.error}")
    return figures


def loops_for(
    prefix: str, count: int, *, dialects=DIALECTS, first_turns: int = 6, remind: bool = False
) -> list[Loop]:
    """``count`` loops cycling through dialects, streamed and not, of 6-10 turns."""
    return [
        Loop(
            f"{prefix}-{index}",
            dialects[index % len(dialects)],
            stream=(index // len(dialects)) % 2 == 1,
            turns=first_turns + index % 5,
            remind=remind,
        )
        for index in range(count)
    ]
