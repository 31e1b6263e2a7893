"""tokcap in front of vLLM and SGLang themselves (issue 23): what it captures is what the
engine sampled.

A recording proxy between the front end and the engine keeps the engine's own replies (a
stream as the whole it adds up to); every captured entry must equal one of them, ids and
log-probs, and each call must have one. The scripted agent turns make the tiny random model
answer like an agent, so each engine's reasoning parser, hermes tool parser and (vLLM) its
stream all run. The calls are sampled greedily, each scripted token just above the largest
logit, so the log-probs compared are the model's own, varying values (``log_probs``). The
checks that hold on both engines run on each (``engine``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from api.prompts.vocab import qwen3_tokenizer
from api.settings import ServerSettings
from api.startup import probe
from capture.config import TokenIdCaptureConfig
from tests.real_engines.conftest import RealEngine
from tests.real_engines.log_probs import assert_captured_as_sampled
from tests.real_engines.recording_proxy import recording_proxy
from tests.support.frontend import assert_one_contiguous_chain, finalize, freeze, front_end

# The first test may install an engine and start it cold: minutes, not the default 300 s.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
# Greedy: the scripted token is then put just above the largest logit, so each captured
# log-prob is the model's own value at its position, which the checks compare.
PINNED = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
TOOL = {
    "name": "list_files",
    "description": "List the files in a directory.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
ASK = "List the files here."


def settings(upstream: str, store: Path, **server: Any) -> ServerSettings:
    """The front end's settings for the tier: file store, ``PINNED`` sampling unless
    ``server`` pins its own."""
    capture = TokenIdCaptureConfig(enabled=True, dir=str(store))
    server.setdefault("sampling_overrides", PINNED)
    return ServerSettings(upstream=upstream, capture=capture, **server)


def base(front: str, rollout: str) -> str:
    return f"{front}/ng-rollout/{rollout}/training-token-capture"


async def test_the_probe_finds_the_engine_and_accepts_it(engine: RealEngine) -> None:
    pinned = await probe(ServerSettings(upstream=engine.url, sampling_overrides=PINNED))
    loose = {"temperature": 1.0}
    loose = await probe(ServerSettings(upstream=engine.url, sampling_overrides=loose))
    assert pinned.family == engine.family and pinned.warnings == []
    assert pinned.max_model_len == 8192
    assert "top_p, top_k, min_p, repetition_penalty" in loose.warnings[0]


def anthropic_loop(url: str, stream: bool) -> list[Any]:
    """A two-call tool loop: the engine's parsers turn the scripted turns into a tool call, then
    an answer; each reply goes back in the history as the CLI sends it."""
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    replies = []
    for _ in range(2):
        call = {"model": "m", "max_tokens": 200, "messages": messages, "tools": [TOOL]}
        if stream:
            with client.messages.stream(**call) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**call)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "a.txt"} for u in uses]
        messages.append({"role": "user", "content": results})
    return replies


def answer(reply: Any) -> list[dict[str, Any]]:
    """The record a collector submits: the loop's last reply."""
    text = reply.content[-1].text
    content = [{"type": "output_text", "text": text}]
    return [{"type": "message", "role": "assistant", "content": content}]


def proxy_for(engine: RealEngine) -> Any:
    return recording_proxy(engine.url, engine.family)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "create"])
def test_an_anthropic_tool_loop_is_captured_as_the_engine_sampled_it(
    engine: RealEngine, tmp_path: Path, stream: bool
) -> None:
    with proxy_for(engine) as proxy, front_end(settings(proxy.url, tmp_path)) as front:
        replies = anthropic_loop(base(front, "loop-1"), stream)
    first, second = replies
    # The engines send the blank line between the thinking and the tool call as content.
    blocks = [b for b in first.content if b.type != "text" or b.text.strip()]
    assert [b.type for b in blocks] == ["thinking", "tool_use"]
    assert blocks[1].name == "list_files" and blocks[1].input == {"path": "."}
    assert first.stop_reason == "tool_use"
    assert second.content[-1].text.strip() == "The directory holds a.txt."
    snapshot = freeze(tmp_path, "loop-1")
    assert not snapshot.incomplete
    assert_captured_as_sampled(snapshot, proxy.sampled)
    record, build = finalize(tmp_path, "loop-1", answer(second))
    assert_one_contiguous_chain(build, record, 2)
    assert proxy.paths.count("/v1/chat/completions") == 2


def hello(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"hello {n}"}]


def test_openai_chat_and_responses_calls_are_captured_as_the_engine_sampled_them(
    engine: RealEngine, tmp_path: Path
) -> None:
    with proxy_for(engine) as proxy, front_end(settings(proxy.url, tmp_path)) as front:
        sdk = openai.OpenAI(base_url=base(front, "sdk-1") + "/v1", api_key="x", max_retries=0)
        # Four prompts, so each entry matches exactly one of the engine's replies.
        whole = sdk.chat.completions.create(model="m", messages=hello(1), max_tokens=100)
        chunks = list(
            sdk.chat.completions.create(model="m", messages=hello(2), max_tokens=100, stream=True)
        )
        created = sdk.responses.create(model="m", input="hello 3", max_output_tokens=100)
        with sdk.responses.stream(model="m", input="hello 4", max_output_tokens=100) as events:
            streamed = events.get_final_response()
    assert whole.choices[0].message.content.strip() == "Hello from the tiny model."
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "Hello from the tiny model."
    assert (
        created.output_text.strip() == streamed.output_text.strip() == "Hello from the tiny model."
    )
    snapshot = freeze(tmp_path, "sdk-1")
    assert not snapshot.incomplete
    assert_captured_as_sampled(snapshot, proxy.sampled)


TOKEN_IN_PATHS = {"vllm": "/v1/completions", "sglang": "/generate"}


def test_faithful_prompts_keep_a_tool_loop_one_chain(engine: RealEngine, tmp_path: Path) -> None:
    """The front end renders with the ``renderers`` Qwen3 renderer and sends token-in calls;
    the engine continues exactly the ids sent, and the loop is one chain of what it sampled."""
    faithful = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}
    with (
        proxy_for(engine) as proxy,
        front_end(settings(proxy.url, tmp_path, **faithful)) as front,
    ):
        replies = anthropic_loop(base(front, "faithful-1"), stream=True)
    assert [b.type for b in replies[0].content if b.type != "text"] == ["thinking", "tool_use"]
    assert replies[1].content[-1].text.strip() == "The directory holds a.txt."
    assert proxy.paths.count(TOKEN_IN_PATHS[engine.family]) == 2
    snapshot = freeze(tmp_path, "faithful-1")
    assert not snapshot.incomplete
    assert_captured_as_sampled(snapshot, proxy.sampled)
    record, build = finalize(tmp_path, "faithful-1", answer(replies[1]))
    assert_one_contiguous_chain(build, record, 2)


def test_a_streamed_call_is_relayed_from_vllms_own_stream(vllm: str, tmp_path: Path) -> None:
    """vLLM 0.32 streams every chunk's ids: a streamed harness call is one streamed request
    to vLLM, its deltas relayed, its ids the stream's."""
    with recording_proxy(vllm) as proxy, front_end(settings(proxy.url, tmp_path)) as front:
        client = anthropic.Anthropic(base_url=base(front, "relay-1"), api_key="x", max_retries=0)
        kinds = []
        with client.messages.stream(
            model="m", max_tokens=200, messages=[{"role": "user", "content": ASK}], tools=[TOOL]
        ) as events:
            kinds = [event.type for event in events]
    assert kinds.count("content_block_delta") >= 2
    assert proxy.streams == 1, "the front end asked vLLM for a stream"
    assert_captured_as_sampled(freeze(tmp_path, "relay-1"), proxy.sampled)


def test_the_tiny_models_tokenizer_is_the_real_qwen3_vocabulary(vllm_model: Path) -> None:
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"a": 1}\n</tool_call><|im_end|> Héllo 12345'
    hf = Tokenizer.from_file(str(vllm_model / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False).ids == qwen3_tokenizer().encode(text)


def test_a_stream_is_kept_alive_while_the_engine_prefills(
    engine: RealEngine, tmp_path: Path
) -> None:
    """The engine holds the call 3 s before its first token (the processor's slow prefill):
    the stream opens and pings every 0.5 s, then sends the deltas (vLLM's own, relayed; an
    SGLang call, whose stream carries no ids, is one whole request), then the final event."""
    slow = [{"role": "user", "content": "[slow prefill] hello"}]
    request = {"model": "m", "max_tokens": 100, "messages": slow, "stream": True}
    with (
        proxy_for(engine) as proxy,
        front_end(settings(proxy.url, tmp_path, keepalive_s=0.5)) as front,
        httpx.stream(
            "POST", base(front, "slow-1") + "/v1/messages", json=request, timeout=60
        ) as response,
    ):
        names = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    first_delta = names.index("content_block_delta")
    assert names[0] == "message_start" and names[:first_delta].count("ping") >= 3
    assert names[-1] == "message_stop"
    assert proxy.streams == (1 if engine.family == "vllm" else 0)
    assert_captured_as_sampled(freeze(tmp_path, "slow-1"), proxy.sampled)
