"""The demo's harness: a multi-turn tool-using agent loop over Anthropic Messages, streamed
through the official ``anthropic`` SDK as Claude Code would, with stand-in tools.

It knows nothing of tokcap beyond the capture base URL, as a real harness knows nothing:
it returns the finished rollout record a Gym collector would hold (text only, no ids). An
editing harness returns its own text as the answer, which no call produced.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic

from capture import capture_base_url

MODEL = "tokcap-engine"
SYSTEM = "You are a careful agent. Use the tools, then answer."
TOOLS = [
    {
        "name": "list_files",
        "description": "List the files in a directory.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
    {
        "name": "word_count",
        "description": "Count the words of a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file": {"type": "string"}},
            "required": ["file"],
        },
    },
]
TASKS = [
    "Which files are in the project, and how long is the README?",
    "Count the words of the design notes.",
    "List the source directory and summarise what you find.",
    "Find the longest file in the docs folder.",
    "Check whether the tests directory has a conftest file.",
    "How many words are in the changelog?",
]
EDIT_NOTE = "\n\n(Checked by the harness.)"  # what the editing harness adds to its answer


def _run_tool(name: str, arguments: dict[str, Any]) -> str:
    """Deterministic stand-ins for real tools: the harness side of the loop."""
    text = json.dumps(arguments, sort_keys=True)
    if name == "list_files":
        return "README.md\nsrc/\ndocs/\ntests/conftest.py\n" + text
    return f"{len(text) * 7} words in {arguments.get('file', 'the file')}"


async def drive(
    front_url: str, rollout_id: str, task: str, max_turns: int, edits_answer: bool = False
) -> tuple[dict[str, Any], int]:
    """One harness run over Anthropic Messages, streamed; returns (record, turns)."""
    client = anthropic.AsyncAnthropic(
        base_url=capture_base_url(front_url, rollout_id), api_key="demo", max_retries=0
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    final: Any = None
    turns = 0
    try:
        while turns < max_turns:
            turns += 1
            async with client.messages.stream(
                model=MODEL, max_tokens=512, system=SYSTEM, tools=TOOLS, messages=messages
            ) as stream:
                final = await stream.get_final_message()
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in final.content],
                }
            )
            calls = [b for b in final.content if b.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": _tool_results(calls)})
    finally:
        await client.close()
    output = _output_of(final)
    if edits_answer:
        # The harness returns its own text, not the model's: no call produced this answer.
        text = output[0]["content"][0]["text"]
        output = [_message(text + EDIT_NOTE)]
    record = {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "transcript": messages,
        "response": {"id": f"resp_{rollout_id}", "object": "response", "output": output},
    }
    return record, turns


def _tool_results(calls: list[Any]) -> list[dict[str, Any]]:
    return [
        {"type": "tool_result", "tool_use_id": b.id, "content": _run_tool(b.name, b.input)}
        for b in calls
    ]


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _output_of(final: Any) -> list[dict[str, Any]]:
    """The harness's answer as Responses items: its text, then any tool calls left open."""
    blocks = final.content if final else []
    output = [_message("".join(b.text for b in blocks if b.type == "text"))]
    for block in blocks:
        if block.type == "tool_use":
            output.append(
                {
                    "type": "function_call",
                    "call_id": block.id,
                    "name": block.name,
                    "arguments": json.dumps(block.input),
                }
            )
    return output
