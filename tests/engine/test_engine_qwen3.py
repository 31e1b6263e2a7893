"""``tokcap engine --tokenizer qwen3`` over real HTTP: Qwen3's vocabulary and chat template.

Prompts must be exactly what the ``renderers`` package's Qwen3 renderer makes of the
conversation (so the drift on re-rendering is the real template's: thinking before the last
user query is dropped), the engine's reply must use Qwen3's single-token markers, and the
token-in routes, both wires and the non-canonical knob must work over the 151,669 ids.
"""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from renderers import Qwen3RendererConfig, create_renderer

from api.prompts.vocab import qwen3_tokenizer
from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app
from tokcap_devtools.engine.cli import add_arguments, settings_from_args
from tokcap_devtools.engine.template import messages_from_prompt
from tokcap_devtools.engine.tokenizer import load_tokenizer

THINK, THINK_END, CALL, CALL_END, IM_END = 151667, 151668, 151657, 151658, 151645
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
USER = [
    {"role": "system", "content": "You run commands."},
    {"role": "user", "content": "run echo hello"},
]


def past_turn(arguments: str | dict) -> list[dict]:
    """A finished tool round trip: an assistant turn with thinking and a call, its result."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "Bash", "arguments": arguments}
    return [
        {
            "role": "assistant",
            "content": "I'll run it.",
            "reasoning_content": "Use bash.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    ]


# As a client sends it (arguments a compact JSON text), then a new user query.
CONVERSATION = [*USER, *past_turn('{"command":"echo hello"}'), {"role": "user", "content": "ls"}]
# As vLLM hands it to the template: arguments parsed into an object.
AS_TEMPLATE_SEES_IT = [*USER, *past_turn({"command": "echo hello"}), CONVERSATION[-1]]
IDS = {"return_token_ids": True, "logprobs": True}


@pytest.fixture(scope="module")
def renderer():
    return create_renderer(qwen3_tokenizer(), Qwen3RendererConfig())


@pytest.fixture(scope="module")
def servers():
    """One qwen3 engine per wire, and one with the non-canonical knob (vLLM wire)."""
    variants = {
        "vllm": EngineSettings(tokenizer_path="qwen3", ground_truth=True),
        "sglang": EngineSettings(tokenizer_path="qwen3", wire="sglang", ground_truth=True),
        "noncanonical": EngineSettings(
            tokenizer_path="qwen3", noncanonical_rate=0.5, seed=1, ground_truth=True
        ),
    }
    stack, opened = [], {}
    try:
        for name, settings in variants.items():
            manager = serve_app(create_app(settings))
            opened[name] = manager.__enter__()
            stack.append(manager)
        yield opened
    finally:
        for manager in reversed(stack):
            manager.__exit__(None, None, None)


def post(base: str, path: str, body: dict) -> dict:
    response = httpx.post(base + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def last_truth(base: str) -> dict:
    return httpx.get(f"{base}/tokcap/ground_truth", timeout=30).json()[-1]


def decode(ids: list[int]) -> str:
    return qwen3_tokenizer().decode(ids, skip_special_tokens=False)


def test_the_vocabulary_has_its_markers_splits_and_word_tables():
    tok = load_tokenizer("qwen3")
    assert tok.vocab_size == 151669 and tok.eos_id == IM_END == tok.im_end_id
    assert [tok.token_to_id(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")] == [
        THINK,
        THINK_END,
        CALL,
        CALL_END,
    ]
    assert tok.token_str(tok.token_to_id("Ġhello")) == "Ġhello"
    assert tok.splits(THINK) == () and tok.splits(IM_END) == ()
    [working] = tok.encode(" working")
    assert tok.splits(working)
    assert all(tok.decode(list(pair)) == " working" for pair in tok.splits(working))
    assert len(tok.word_ids) > 10_000 and all(
        tok.encode(tok.decode([i])) == [i] for i in tok.word_ids[:50]
    )


def test_chat_prompt_is_the_qwen3_template_and_drops_past_thinking(servers, renderer):
    reply = post(
        servers["vllm"], "/v1/chat/completions", {"messages": CONVERSATION, "tools": TOOLS, **IDS}
    )
    expected = renderer.render_ids(AS_TEMPLATE_SEES_IT, tools=TOOLS, add_generation_prompt=True)
    assert reply["prompt_token_ids"] == expected
    text = decode(expected)
    assert "Use bash." not in text, "thinking before the last user query is dropped"
    assert '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hello"}}' in text
    assert "<|im_start|>user\n<tool_response>\nhello\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nls<|im_end|>\n<|im_start|>assistant\n")
    tool_loop = CONVERSATION[:-1]  # no new user query: the thinking stays
    kept = post(servers["vllm"], "/tokenize", {"messages": tool_loop, "tools": TOOLS})["tokens"]
    assert "<think>\nUse bash.\n</think>\n\nI'll run it.\n<tool_call>" in decode(kept)


def test_reply_uses_single_marker_tokens_and_parses(servers):
    base = servers["vllm"]
    reply = post(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "seed": 4, **IDS})
    [choice] = reply["choices"]
    ids = choice["token_ids"]
    assert [ids.count(t) for t in (THINK, THINK_END, CALL, CALL_END)] == [1, 1, 1, 1]
    assert ids[0] == THINK and ids[-1] == IM_END and ids[-2] == CALL_END
    message = choice["message"]
    assert (
        message["reasoning_content"]
        == "The user wants a shell command run. I will use the Bash tool."
    )
    assert message["content"] == "I'll run that command."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == {
        "command": "echo hello",
        "description": "Print hello",
    }
    truth = last_truth(base)
    assert truth["prompt_token_ids"] == reply["prompt_token_ids"] and truth["token_ids"] == ids
    assert truth["tool_calls"] == message["tool_calls"]
    # Knobs off, within a tool loop, the real template re-renders exactly what was sampled.
    nxt = [*USER, {"role": "assistant", **message}]
    nxt.append({"role": "tool", "tool_call_id": call["id"], "content": "hello"})
    follow = post(base, "/v1/chat/completions", {"messages": nxt, "tools": TOOLS, **IDS})
    prefix = reply["prompt_token_ids"] + ids
    assert follow["prompt_token_ids"][: len(prefix)] == prefix
    # A new user query: the template drops that turn's thinking, and the prefix breaks.
    later = [*nxt, {"role": "user", "content": "thanks"}]
    again = post(base, "/v1/chat/completions", {"messages": later, "tools": TOOLS, **IDS})
    assert again["prompt_token_ids"][: len(prefix)] != prefix
    assert THINK not in again["prompt_token_ids"]
    in_tools_block = reply["prompt_token_ids"].count(CALL)
    assert again["prompt_token_ids"].count(CALL) == in_tools_block + 1, "the call stays"


def test_token_in_completions_read_a_qwen3_prompt(servers, renderer):
    base = servers["vllm"]
    prompt = renderer.render_ids(
        [*USER, *past_turn({"command": "echo hello"})], tools=TOOLS, add_generation_prompt=True
    )
    read = messages_from_prompt(decode(prompt))
    assert [m["role"] for m in read] == ["system", "user", "assistant", "tool"]
    assert read[-1]["content"] == "hello", "Qwen3's <tool_response> user turn is a tool result"
    reply = post(base, "/v1/completions", {"prompt": prompt, "seed": 2, **IDS})
    [choice] = reply["choices"]
    assert choice["prompt_token_ids"] == prompt
    assert choice["text"].startswith("Let me check the working directory too."), (
        "turn 1 of the script"
    )
    assert CALL in choice["token_ids"] and last_truth(base)["prompt_token_ids"] == prompt
    detokenized = post(base, "/detokenize", {"tokens": prompt})["prompt"]
    assert detokenized == decode(prompt)
    assert post(base, "/tokenize", {"prompt": detokenized})["tokens"] == prompt


def test_sglang_wire_serves_the_same_prompt_and_ids(servers):
    vllm, sglang = servers["vllm"], servers["sglang"]
    body = {"messages": CONVERSATION, "tools": TOOLS, "seed": 5, **IDS}
    on_vllm = post(vllm, "/v1/chat/completions", body)
    reply = post(sglang, "/v1/chat/completions", body)
    [choice] = reply["choices"]
    assert choice["prompt_token_ids"] == on_vllm["prompt_token_ids"]
    assert choice["response_token_ids"] == on_vllm["choices"][0]["token_ids"]
    first = post(sglang, "/v1/chat/completions", {**body, "messages": USER})
    [choice] = first["choices"]
    ids = choice["response_token_ids"]
    assert first["usage"]["reasoning_tokens"] == ids.index(THINK_END) + 1 > 2
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "Bash"
    sampling = {"sampling_seed": 5, "max_new_tokens": 512}
    generated = post(
        sglang, "/generate", {"input_ids": choice["prompt_token_ids"], "sampling_params": sampling}
    )
    assert generated["output_ids"] == last_truth(sglang)["token_ids"]
    assert generated["output_ids"][-1] == IM_END and CALL in generated["output_ids"]
    assert generated["meta_info"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    info = httpx.get(f"{sglang}/get_model_info", timeout=30).json()
    assert info["tokenizer_path"] == "qwen3"


def test_noncanonical_knob_changes_ids_not_text(servers):
    body = {"messages": USER, "tools": TOOLS, "seed": 4, **IDS}
    canonical = post(servers["vllm"], "/v1/chat/completions", body)["choices"][0]
    split = post(servers["noncanonical"], "/v1/chat/completions", body)["choices"][0]
    assert split["token_ids"] != canonical["token_ids"]
    assert len(split["token_ids"]) > len(canonical["token_ids"])
    assert decode(split["token_ids"]) == decode(canonical["token_ids"])
    assert split["message"] == {
        **canonical["message"],
        "tool_calls": split["message"]["tool_calls"],
    }
    tok = load_tokenizer("qwen3")
    assert tok.encode(decode(split["token_ids"][:-1])) + [IM_END] == canonical["token_ids"]


def test_cli_offers_qwen3_and_refuses_an_unknown_tokenizer(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert (
        "qwen3" in helps["tokenizer"] and "ignored with --tokenizer qwen3" in helps["think_strip"]
    )
    assert settings_from_args(parser.parse_args(["--tokenizer", "qwen3"])).tokenizer_path == "qwen3"
    with pytest.raises(ValueError, match="'qwen3' or a tokenizer.json"):
        settings_from_args(parser.parse_args(["--tokenizer", str(tmp_path / "none.json")]))
