"""The prefix property of the tokcap engine, and what each knob does to it.

With all knobs off, a multi-turn tool loop that sends each reply back as OpenAI messages
(content, reasoning_content, tool_calls, then tool results) gets prompts that extend the
previous prompt + sampled ids exactly. Each knob breaks that the way real serving does,
while the text stays the same.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def tool_loop(base: str, *, seed: int = 0, max_turns: int = 5) -> list[dict]:
    """Run a tool loop with the openai SDK; return each turn's ids and message."""
    messages: list[dict] = [
        {"role": "system", "content": "You run commands."},
        {"role": "user", "content": "run echo hello"},
    ]
    turns = []
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
        for turn in range(max_turns):
            reply = client.chat.completions.create(
                model="tokcap-engine",
                messages=messages,
                tools=TOOLS,
                seed=seed * 100 + turn,
                extra_body={"return_token_ids": True},
            )
            choice = reply.choices[0]
            message = choice.message
            turns.append(
                {
                    "prompt": reply.model_extra["prompt_token_ids"],
                    "generated": choice.model_extra["token_ids"],
                    "message": message,
                }
            )
            assistant = {
                "role": "assistant",
                "content": message.content,
                "reasoning_content": message.model_extra.get("reasoning_content"),
            }
            if message.tool_calls:
                assistant["tool_calls"] = [tc.model_dump() for tc in message.tool_calls]
            messages.append(assistant)
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": f"output of {call.function.arguments}",
                    }
                )
            messages.append({"role": "system", "content": f"reminder {turn}"})
    return turns


def extends(turns: list[dict]) -> list[bool]:
    """Per turn k>0: does prompt(k) start with prompt(k-1) + generated(k-1)?"""
    return [
        nxt["prompt"][: len(cur["prompt"]) + len(cur["generated"])]
        == cur["prompt"] + cur["generated"]
        for cur, nxt in zip(turns, turns[1:], strict=False)
    ]


@pytest.fixture(scope="module")
def servers():
    variants = {
        "off": EngineSettings(),
        "random_off": EngineSettings(policy="random", seed=3),
        "noncanonical": EngineSettings(noncanonical_rate=0.5, seed=1),
        "think_strip": EngineSettings(think_strip=True),
        "json_reserialize": EngineSettings(json_reserialize=True),
    }
    opened = {}
    stack = []
    try:
        for name, settings in variants.items():
            manager = serve_app(create_app(settings))
            opened[name] = manager.__enter__()
            stack.append(manager)
        yield opened
    finally:
        for manager in reversed(stack):
            manager.__exit__(None, None, None)


def test_knobs_off_scripted_tool_loop_is_one_token_prefix_chain(servers):
    turns = tool_loop(servers["off"])
    assert len(turns) == 3, "default script: two Bash round trips then an answer"
    assert turns[0]["message"].model_extra["reasoning_content"], "turn 0 thinks"
    assert extends(turns) == [True, True]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_knobs_off_random_policy_keeps_the_prefix_too(servers, seed):
    turns = tool_loop(servers["random_off"], seed=seed)
    assert all(extends(turns))


def test_noncanonical_segmentation_breaks_the_prefix_but_not_the_text(servers):
    turns = tool_loop(servers["noncanonical"])
    off = tool_loop(servers["off"])
    assert extends(turns) == [False, False]
    for noisy, clean in zip(turns, off, strict=True):
        assert noisy["message"].content == clean["message"].content
        assert len(noisy["generated"]) > len(clean["generated"]), "split tokens: more ids"
    assert turns[0]["prompt"] == off[0]["prompt"], "no history yet: nothing to re-render"


def test_think_strip_breaks_only_after_a_thinking_turn(servers):
    turns = tool_loop(servers["think_strip"])
    # Turn 0 thinks (its <think> block is dropped on re-render); turn 1 does not think.
    assert extends(turns) == [False, True]
    off = tool_loop(servers["off"])
    assert turns[0]["generated"] == off[0]["generated"], "the knob changes rendering, not sampling"


def test_json_reserialize_breaks_after_every_tool_call_turn(servers):
    turns = tool_loop(servers["json_reserialize"])
    assert extends(turns) == [False, False]
    args = turns[0]["message"].tool_calls[0].function.arguments
    assert args == '{"command": "echo hello", "description": "Print hello"}'
    # The sampled text had compact JSON; the template writes it with spaces.
    off = tool_loop(servers["off"])
    assert turns[0]["generated"] != off[0]["generated"] and turns[0]["prompt"] == off[0]["prompt"]
