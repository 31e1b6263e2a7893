"""Dialect translation on its own: what each request becomes, and what a reply streams as.

These are the pure steps of the data path (request -> chat request; reply -> events), fed
with the shapes real harnesses send. The end-to-end files check the same code against the
engine; these pin the corner cases one by one.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from api.dialects import anthropic, chat, responses
from api.dialects.common import RequestError
from api.ids import item_id
from api.types import Delta
from tests.support.frontend import both_servers, sse_events


def test_anthropic_blocks_become_chat_messages_in_order() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": "You are terse.",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                    {"type": "text", "text": "at this"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                        "is_error": False,
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "system", "content": "mid-conversation note"},
        ],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}, "not a tool"],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["STOP"],
        "top_k": 40.0,
        "unknown_field": {"anything": True},
    }
    request = anthropic.to_chat(body)
    assert request["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "look\nat this"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hm",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "and now?"},
        {"role": "system", "content": "mid-conversation note"},
    ]
    assert "tools" not in request and "tool_choice" not in request  # server tools only
    assert request["stop"] == ["STOP"] and request["top_k"] == 40


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": "hi"}, "messages must be an array"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [1]}]},
            "messages[0].content[0] must be an object",
        ),
        ({"messages": [], "max_tokens": "many"}, "max_tokens must be an integer"),
        (
            {"messages": [], "system": [{"type": "text", "text": 5}]},
            "system[0].text must be a string",
        ),
    ],
)
def test_anthropic_requests_it_cannot_translate_say_where(body: dict, message: str) -> None:
    with pytest.raises(RequestError) as error:
        anthropic.to_chat(body)
    assert message in str(error.value)


def test_responses_items_merge_back_into_one_assistant_turn() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "house rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "calling"}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "Bash",
                "arguments": '{"command": "ls"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "Bash",
                "arguments": '{"command": "pwd"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "/"}],
            },
            {"type": "web_search_call", "id": "ws_1"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done"}],
            },
        ],
        "tools": [
            {"type": "function", "name": "Bash", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
        "tool_choice": {"type": "function", "name": "Bash"},
        "max_output_tokens": 99,
    }
    request = responses.to_chat(body)
    assert [m["role"] for m in request["messages"]] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    turn = request["messages"][3]
    assert turn["content"] == "calling" and turn["reasoning_content"] == "think"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert request["messages"][5]["content"] == "/"
    assert request["messages"][6] == {"role": "assistant", "content": "done"}
    assert [t["function"]["name"] for t in request["tools"]] == ["Bash"]
    assert request["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    assert request["max_tokens"] == 99


def test_chat_requests_keep_sampling_and_drop_capture_fields() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
        "logprobs": True,
        "top_logprobs": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
        "seed": 4,
        "max_completion_tokens": 12,
        "n": 1,
        "user": "u",
    }
    request = chat.to_chat(body)
    assert request == {
        "model": "m",
        "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
        "temperature": 0.3,
        "seed": 4,
        "max_tokens": 12,
    }
    assert chat.include_usage(body)


def test_anthropic_stream_replays_the_reply_block_by_block() -> None:
    reply = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"command": "ls"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 5},
    }
    events = sse_events(b"".join(anthropic.events(reply, {}, opened=False)).decode())
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    assert events[7][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "Bash",
        "input": {},
    }
    assert json.loads(events[8][1]["delta"]["partial_json"]) == {"command": "ls"}
    assert events[10][1]["delta"]["stop_reason"] == "tool_use"
    assert events[10][1]["usage"]["output_tokens"] == 5


def test_responses_relay_opens_an_item_per_kind_and_completes_with_their_ids() -> None:
    """Deltas of reasoning, text and two tool calls: each item is added, filled and done in
    order, sequence numbers run on from the opening, and the completed response holds the
    captured items under the ids the stream announced (both name them after the reply)."""
    body = {"model": "m", "stream": True}
    head = responses.reply_head(body)
    call = {"index": 0, "id": "call_a", "name": "Bash", "arguments": '{"command": '}
    deltas = [
        Delta(reasoning="let me "),
        Delta(reasoning="look"),
        Delta(text="Running."),
        Delta(tool_calls=(call,)),
        Delta(tool_calls=({"index": 0, "id": None, "name": None, "arguments": '"ls"}'},)),
        Delta(tool_calls=({"index": 1, "id": "call_b", "name": "Read", "arguments": "{}"},)),
    ]
    captured = [
        {
            "type": "reasoning",
            "id": item_id("rs_", head["id"]),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "let me look"}],
        },
        {
            "type": "message",
            "id": item_id("msg_", head["id"]),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Running.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": item_id("fc_", head["id"], 0),
            "call_id": "call_a",
            "name": "Bash",
            "arguments": '{"command": "ls"}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "id": item_id("fc_", head["id"], 1),
            "call_id": "call_b",
            "name": "Read",
            "arguments": "{}",
            "status": "completed",
        },
    ]
    reply = {**responses.reply_head(body), **head, "status": "completed", "output": captured}
    relay = responses.Relay(head, body)
    sent = responses.opening(head, body)
    for delta in deltas:
        sent += relay.delta(delta)
    sent += relay.close(reply)
    events = sse_events(b"".join(sent).decode())
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    name, completed = events[-1]
    assert name == "response.completed"
    output = completed["response"]["output"]
    assert [item["id"] for item in added] == [item["id"] for item in done]
    # Added empty: the content comes as deltas (an SDK appends them to what was added).
    assert [item.get("content") for item in added[:2]] == [[], []]
    assert [item["arguments"] for item in added[2:]] == ["", ""]
    assert [item["id"] for item in added] == [item["id"] for item in captured]
    assert output == captured
    assert done[-1] == output[-1] and output[2]["arguments"] == '{"command": "ls"}'
    texts = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    arguments = [
        data["delta"] for name, data in events if name == "response.function_call_arguments.delta"
    ]
    assert texts == ["Running."] and arguments == ['{"command": ', '"ls"}', "{}"]
    positions = [data["output_index"] for name, data in events if name.endswith(".delta")]
    assert positions == [0, 0, 1, 2, 2, 3]


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/v1/messages", "max_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", "max_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", "max_output_tokens", {"input": "hi"}),
        ("/v1/chat/completions", "seed", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_number_no_engine_takes_is_a_400_naming_its_field_and_nothing_is_sampled(
    tmp_path: Path, path: str, field: str, body: dict
) -> None:
    huge = {"model": "m", **body, field: 10**30}
    if field != "max_tokens" and path == "/v1/chat/completions":
        huge["max_tokens"] = 8
    with both_servers(tmp_path / "store") as servers:
        reply = httpx.post(servers.base("huge") + path, json=huge, headers={"x-api-key": "k"})
        sampled = servers.ground_truth()
    assert reply.status_code == 400 and field in reply.text and "out of range" in reply.text
    assert sampled == []
