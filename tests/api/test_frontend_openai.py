"""The OpenAI dialects end to end: Chat Completions and Responses through the official SDK.

Each runs a tool loop against the real engine, streamed and not; the captured entries equal
the engine's ground truth, the rebuilt rollout is one contiguous chain, and no reply to the
harness carries token arrays or log-probs.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.support.frontend import (
    BASH_TOOL,
    OVERRIDES,
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    both_servers,
    finalize,
    freeze,
)

CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": BASH_TOOL["name"],
        "description": BASH_TOOL["description"],
        "parameters": BASH_TOOL["input_schema"],
    },
}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
MAX_TURNS = 6


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    with both_servers(tmp_path_factory.mktemp("captures")) as running:
        yield running


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="dummy", max_retries=0)


def chat_turn(sdk: openai.OpenAI, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    """One call; the assistant message as the harness keeps it, and the finish reason."""
    kwargs = dict(model="policy", messages=messages, tools=[CHAT_TOOL], max_tokens=2000)
    if not stream:
        completion = sdk.chat.completions.create(**kwargs)
        choice = completion.choices[0]
        assert choice.logprobs is None
        message = choice.message.model_dump(exclude_none=True)
        return {**message, "finish_reason": choice.finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    chunks = list(
        sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(
                    call.index,
                    {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return {**message, "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_tool_loop_is_captured_as_one_chain(servers, stream: bool) -> None:
    rollout_id = f"chat-loop-{'stream' if stream else 'json'}"
    servers.clear_ground_truth()
    sdk = client(servers.base(rollout_id))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "run echo hello"},
    ]
    for _ in range(MAX_TURNS):
        turn = chat_turn(sdk, messages, stream)
        finish = turn.pop("finish_reason")
        messages.append(turn)
        if finish != "tool_calls":
            break
        for call in turn["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"ran {command}"}
            )
    calls = sum(1 for message in messages if message["role"] == "assistant")
    assert calls == 3 and messages[-1]["content"].endswith("Done.")
    snapshot = freeze(servers.store_dir, rollout_id)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, servers.ground_truth())
    assert all(entry.overridden_sampling_keys == sorted(OVERRIDES) for entry in snapshot.entries)
    record, build = finalize(servers.store_dir, rollout_id, [])
    assert_one_contiguous_chain(build, record, calls)


def responses_turn(sdk: openai.OpenAI, items: list[Any], stream: bool) -> list[dict[str, Any]]:
    """One call; its output items as the harness sends them back."""
    kwargs = dict(
        model="policy",
        instructions="You are a coding agent.",
        input=items,
        tools=[RESPONSES_TOOL],
        max_output_tokens=2000,
    )
    if stream:
        with sdk.responses.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    else:
        response = sdk.responses.create(**kwargs)
    assert response.status == "completed"
    output = [item.model_dump(exclude_none=True) for item in response.output]
    for item in output:
        assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs"} & set(item)
    return output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_responses_tool_loop_is_captured_as_one_chain(servers, stream: bool) -> None:
    rollout_id = f"responses-loop-{'stream' if stream else 'json'}"
    servers.clear_ground_truth()
    sdk = client(servers.base(rollout_id))
    items: list[Any] = [{"role": "user", "content": "run echo hello"}]
    calls = 0
    for _ in range(MAX_TURNS):
        output = responses_turn(sdk, items, stream)
        calls += 1
        items.extend(output)
        tool_calls = [item for item in output if item["type"] == "function_call"]
        if not tool_calls:
            break
        # Reasoning items come back as the harness got them (reasoning -> message -> calls).
        for call in tool_calls:
            command = json.loads(call["arguments"])["command"]
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": f"ran {command}",
                }
            )
    assert calls == 3
    assert any(item.get("type") == "reasoning" for item in items)
    final_text = items[-1]["content"][0]["text"]
    snapshot = freeze(servers.store_dir, rollout_id)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, servers.ground_truth())
    # What the store kept is what was served: the same items, ids included.
    served_ids = {item["id"] for item in items if "id" in item}
    for entry in snapshot.entries:
        assert {item["id"] for item in entry.output_items} <= served_ids
    record, build = finalize(servers.store_dir, rollout_id, [items[-1]])
    assert_one_contiguous_chain(build, record, calls)
    assert final_text.endswith("Done.")
