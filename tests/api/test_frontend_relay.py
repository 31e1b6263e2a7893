"""Streamed replies relayed as the engine samples them (issue 22), against a paced engine.

The engine (vLLM wire, 0.12: every stream chunk carries its ids) takes ``FIRST_S`` to its
first token and ``TOKEN_S`` per token after it. Through the front end, a streamed harness
gets its first delta about when the engine sends it, not after the whole generation, and
then the deltas one by one; the final event comes after the entry is durable, and the
captured ids are exactly the engine's, in all three dialects. Token-in calls (faithful
prompts) are relayed from the engine's token-in stream (vLLM and SGLang), each delta the
settled parse of the ids so far. A text-mode call on an engine whose chat stream lacks ids
is not relayed: kept alive, then sent whole.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from api.prompts.renderer import build_renderer
from tests.api.test_frontend_hangup import (
    metric,
    peek_entries,
    send_and_hang_up,
    settings,
    wait_for,
)
from tests.support.frontend import engine_server, front_end, inspect, run

FIRST_S, TOKEN_S = 0.4, 0.05
# The default script answers "hello" with a few dozen tokens: about 2 s of generation.
ASK = [{"role": "user", "content": "hello"}]


def paced(**extra: Any) -> Any:
    return engine_server(first_token_s=FIRST_S, token_s=TOKEN_S, **extra)


def base(front: str, rollout: str) -> str:
    return f"{front}/ng-rollout/{rollout}/training-token-capture"


def ground_truth(engine: str) -> list[dict[str, Any]]:
    return httpx.get(engine + "/tokcap/ground_truth", timeout=30).json()


def test_anthropic_deltas_arrive_as_the_engine_samples_them(tmp_path: Path) -> None:
    with paced() as engine, front_end(settings(engine, tmp_path, keepalive_s=5.0)) as front:
        client = anthropic.Anthropic(base_url=base(front, "relay-a"), api_key="x", max_retries=0)
        started = time.monotonic()
        arrivals: list[float] = []
        with client.messages.stream(model="m", max_tokens=300, messages=ASK) as events:
            for event in events:
                if event.type == "content_block_delta":
                    arrivals.append(time.monotonic() - started)
            message = events.get_final_message()
        total = time.monotonic() - started
        (truth,) = ground_truth(engine)
    generated = len(truth["token_ids"])
    assert total >= FIRST_S + TOKEN_S * (generated - 1) * 0.8, "the engine was paced"
    # Relative to the call's own length, so a loaded machine that slows everything alike
    # still passes, and a reply held back to the end (first delta at ``total``) does not.
    sampling = total - FIRST_S
    assert arrivals[0] < FIRST_S + sampling / 2, (
        f"first delta at {arrivals[0]:.2f} s of {total:.2f} s"
    )
    assert len(arrivals) >= generated // 2, "deltas one by one, not one at the end"
    assert message.stop_reason == "end_turn"
    (entry,) = run(peek_entries(tmp_path, "relay-a"))
    assert entry.generation_token_ids == truth["token_ids"]
    assert list(entry.prompt_token_ids) == truth["prompt_token_ids"]
    assert entry.generation_log_probs == pytest.approx(truth["logprobs"])


def test_chat_deltas_arrive_as_the_engine_samples_them(tmp_path: Path) -> None:
    with paced() as engine, front_end(settings(engine, tmp_path)) as front:
        client = openai.OpenAI(base_url=base(front, "relay-c") + "/v1", api_key="x", max_retries=0)
        started = time.monotonic()
        arrivals, text = [], []
        for chunk in client.chat.completions.create(
            model="m", messages=ASK, max_tokens=300, stream=True
        ):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
                arrivals.append(time.monotonic() - started)
                text.append(delta.content or "")
        total = time.monotonic() - started
        (truth,) = ground_truth(engine)
    assert arrivals[0] < FIRST_S + (total - FIRST_S) / 2  # not held back to the end
    assert len(arrivals) > 3
    (entry,) = run(peek_entries(tmp_path, "relay-c"))
    assert entry.generation_token_ids == truth["token_ids"]
    assert "".join(text) == (truth.get("content") or "")


def test_keep_alive_until_the_first_delta_then_the_deltas(tmp_path: Path) -> None:
    with (
        engine_server(first_token_s=1.5, token_s=0.02) as engine,
        front_end(settings(engine, tmp_path, keepalive_s=0.3)) as front,
        httpx.stream(
            "POST",
            base(front, "relay-k") + "/v1/messages",
            json={"model": "m", "max_tokens": 300, "messages": ASK, "stream": True},
            timeout=30,
        ) as response,
    ):
        names = [
            line[len("event: ") :] for line in response.iter_lines() if line.startswith("event: ")
        ]
    first_delta = names.index("content_block_delta")
    assert names[0] == "message_start" and names[:first_delta].count("ping") >= 3
    assert names[-1] == "message_stop"


FAITHFUL = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}


@pytest.mark.parametrize("prompts", ["text", "faithful"])
def test_a_harness_gone_mid_stream_cancels_its_engine_request(tmp_path: Path, prompts: str) -> None:
    """Gone 1 s into a relayed stream (deltas flowing): the engine aborts within 1 s."""
    faithful = prompts == "faithful"
    with (
        engine_server(first_token_s=0.2, token_s=0.2, tokenizer_path="qwen3") as engine,
        front_end(settings(engine, tmp_path, **(FAITHFUL if faithful else {}))) as front,
    ):
        received = send_and_hang_up(front, "relay-gone", True, after_s=1.0)
        aborted = wait_for(lambda: httpx.get(engine + "/tokcap/aborted", timeout=30).json())
        abandoned = wait_for(
            lambda: metric(front, 'tokcap_calls_total{dialect="anthropic",outcome="abandoned"}')
        )
    assert b"content_block_delta" in received, "deltas were relayed before the hang-up"
    assert len(aborted) == 1 and aborted[0]["after_s"] < 2.0
    assert abandoned == 1
    state = inspect(tmp_path, "relay-gone")
    assert state["calls"] == 0 and state["pending_intents"] == 0 and not state["incomplete"]


def test_responses_deltas_arrive_as_the_engine_samples_them(tmp_path: Path) -> None:
    """The Responses stream relays item by item, its sequence numbers unbroken; the SDK
    reads it as a whole response (its first call, which also pays the SDK's lazy set-up).
    The second call, read raw, times the deltas."""
    with paced() as engine, front_end(settings(engine, tmp_path)) as front:
        url = base(front, "relay-r") + "/v1"
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        with client.responses.stream(model="m", input="hello", max_output_tokens=300) as events:
            numbers = [event.sequence_number for event in events]
            final = events.get_final_response()
        started = time.monotonic()
        arrivals = []
        request = {"model": "m", "input": "hello", "max_output_tokens": 300, "stream": True}
        with httpx.stream("POST", url + "/responses", json=request, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith(("event: response.output_text.delta", "event: response.reas")):
                    arrivals.append(time.monotonic() - started)
        total = time.monotonic() - started
        first, second = ground_truth(engine)
    assert numbers == list(range(len(numbers))), "sequence numbers run on without a gap"
    assert final.status == "completed"
    assert final.output_text == (first.get("content") or "")
    assert arrivals[0] < FIRST_S + 0.5 < total
    assert len(arrivals) >= len(second["token_ids"]) // 2, "deltas one by one"
    entries = run(peek_entries(tmp_path, "relay-r"))
    assert [e.generation_token_ids for e in entries] == [first["token_ids"], second["token_ids"]]


@pytest.mark.parametrize("case", ["older vllm", "sglang"])
def test_what_is_not_relayed_is_kept_alive_then_sent_whole(tmp_path: Path, case: str) -> None:
    """A text-mode call on an engine whose chat stream lacks ids (vLLM before 0.12, SGLang)
    is not relayed: the stream opens and is kept alive while the engine works, then the
    reply comes whole."""
    engine_kw: dict[str, Any] = {
        "older vllm": {"vllm_version": "0.11.0"},
        "sglang": {"wire": "sglang"},
    }[case]
    with (
        engine_server(first_token_s=1.2, **engine_kw) as engine,
        front_end(settings(engine, tmp_path, keepalive_s=0.3)) as front,
    ):
        request = {"model": "m", "max_tokens": 300, "messages": ASK, "stream": True}
        url = base(front, "whole-1") + "/v1/messages"
        with httpx.stream("POST", url, json=request, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        (truth,) = ground_truth(engine)
    kept = [n for n, line in enumerate(lines) if line == "event: ping"]
    content = [n for n, line in enumerate(lines) if line == "event: content_block_delta"]
    assert len(kept) >= 2 and max(kept) < min(content), "kept alive, then the reply whole"
    assert lines[-2] == "event: message_stop"
    (entry,) = run(peek_entries(tmp_path, "whole-1"))
    assert entry.generation_token_ids == truth["token_ids"]


BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
def test_a_faithful_reply_is_relayed_as_the_parse_of_its_ids(tmp_path: Path, wire: str) -> None:
    """Token-in calls stream: thinking, then text, go out as the engine samples them, the
    tool call once the reply is whole, and what the harness assembles is exactly the
    renderer's parse of the ids the engine sampled (its ground truth) and the entry holds."""
    with (
        paced(tokenizer_path="qwen3", wire=wire) as engine,
        front_end(settings(engine, tmp_path, keepalive_s=5.0, **FAITHFUL)) as front,
    ):
        client = anthropic.Anthropic(base_url=base(front, "relay-f"), api_key="x", max_retries=0)
        started = time.monotonic()
        kinds: list[tuple[float, str]] = []
        request = {"model": "m", "max_tokens": 300, "messages": ASK, "tools": [BASH]}
        with client.messages.stream(**request) as events:
            for event in events:
                if event.type == "content_block_delta":
                    kinds.append((time.monotonic() - started, event.delta.type))
            message = events.get_final_message()
        total = time.monotonic() - started
        (truth,) = ground_truth(engine)
    parsed = build_renderer("qwen3", "qwen3").parse_response(truth["token_ids"])
    thinking, text, tool = message.content
    assert thinking.thinking == parsed.reasoning_content and text.text == parsed.content
    (call,) = parsed.tool_calls
    assert (tool.name, tool.input) == (call.name, call.arguments)
    assert kinds[0][0] < FIRST_S + 0.5 < total, "the first delta as the engine sent it"
    order = [kind for _, kind in kinds]
    assert order.index("text_delta") > order.count("thinking_delta") - 1, "thinking, then text"
    assert order.count("thinking_delta") + order.count("text_delta") > 5, "not sent whole"
    assert order[-1] == "input_json_delta" and kinds[-1][0] > kinds[0][0] + 1.0
    (entry,) = run(peek_entries(tmp_path, "relay-f"))
    assert entry.generation_token_ids == truth["token_ids"]
    assert entry.generation_log_probs == pytest.approx(truth["logprobs"])
