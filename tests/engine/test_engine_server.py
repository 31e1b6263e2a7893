"""The tokcap engine over real HTTP (uvicorn on 127.0.0.1): vLLM shapes, streams, sampling
controls, tokenize/detokenize, ground truth. Clients: the official openai SDK, raw httpx for
vLLM's extra fields.
"""

from __future__ import annotations

import json

import httpx
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
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "run echo hello"},
]
EXTRAS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def base():
    with serve_app(create_app(EngineSettings(model="tiny", ground_truth=True))) as url:
        yield url


@pytest.fixture(scope="module")
def random_base():
    settings = EngineSettings(
        policy="random",
        seed=7,
        generation_config={"temperature": 0.7, "top_p": 0.9, "max_tokens": 6},
    )
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.fixture
def client(base):
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
        yield c


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30)


def sse_chunks(text: str) -> list[dict]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_health_and_models(base, client):
    assert httpx.get(f"{base}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 131072


def test_chat_completion_shape_with_token_ids_and_logprobs(base, client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        logprobs=True,
        top_logprobs=2,
        seed=3,
        extra_body=EXTRAS,
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "Bash"
    assert json.loads(call.function.arguments) == {
        "command": "echo hello",
        "description": "Print hello",
    }
    assert choice.message.content == "I'll run that command."
    token_ids = choice.model_extra["token_ids"]
    prompt_ids = reply.model_extra["prompt_token_ids"]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(token_ids)
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in token_ids]
    for entry in entries:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[1].logprob <= entry.logprob
    raw = post(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "seed": 3}).json()
    assert raw["prompt_token_ids"] is None and raw["choices"][0]["token_ids"] is None
    assert raw["choices"][0]["logprobs"] is None and raw["choices"][0]["stop_reason"] is None
    assert raw["usage"]["total_tokens"] == raw["usage"]["prompt_tokens"] + len(token_ids)
    assert set(raw) >= {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "kv_transfer_params",
        "system_fingerprint",
    }


def test_prompt_ids_equal_tokenize_messages_form(base):
    body = {"messages": USER, "tools": TOOLS, **EXTRAS}
    reply = post(base, "/v1/chat/completions", body).json()
    tokenized = post(base, "/tokenize", {"messages": USER, "tools": TOOLS}).json()
    assert tokenized["tokens"] == reply["prompt_token_ids"]
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 131072
    no_gen = post(
        base, "/tokenize", {"messages": USER, "tools": TOOLS, "add_generation_prompt": False}
    ).json()["tokens"]
    assert tokenized["tokens"][: len(no_gen)] == no_gen and len(no_gen) < tokenized["count"]
    text = post(base, "/detokenize", {"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "# Tools" in text
    again = post(base, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert again["tokens"] == tokenized["tokens"] and len(again["token_strs"]) == again["count"]


def test_stream_chunks_carry_prompt_ids_first_and_token_ids_each(base, client):
    body = {"messages": USER, "tools": TOOLS, "seed": 5, "logprobs": True, **EXTRAS}
    full = post(base, "/v1/chat/completions", body).json()
    response = post(
        base,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(response.text)
    first, *middle, usage = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["prompt_token_ids"] == full["prompt_token_ids"]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("prompt_token_ids" not in c for c in middle)
    ids = [t for c in middle for t in c["choices"][0]["token_ids"]]
    assert ids == full["choices"][0]["token_ids"]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in middle)
    tokens = [e["token"] for c in middle for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in ids]
    message = full["choices"][0]["message"]
    deltas = [c["choices"][0]["delta"] for c in middle]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    [call] = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert call["index"] == 0 and call["function"] == message["tool_calls"][0]["function"]
    assert middle[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["finish_reason"] for c in middle[:-1]] == [None] * (len(middle) - 1)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)
    # The SDK reads the same stream.
    stream = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, seed=5, stream=True, extra_body=EXTRAS
    )
    sdk_ids = [
        t for chunk in stream for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])
    ]
    assert sdk_ids == ids


def test_seed_determinism_and_generation_config_defaults(random_base):
    body = {
        "messages": USER,
        "tools": TOOLS,
        "seed": 11,
        "logprobs": True,
        **EXTRAS,
        "max_tokens": 40,
    }
    one = post(random_base, "/v1/chat/completions", body).json()["choices"][0]
    two = post(random_base, "/v1/chat/completions", body).json()["choices"][0]
    assert one["token_ids"] == two["token_ids"] and one["logprobs"] == two["logprobs"]
    others = [
        post(random_base, "/v1/chat/completions", {**body, "seed": s}).json()["choices"][0]
        for s in (12, 13, 14)
    ]
    assert any(o["token_ids"] != one["token_ids"] for o in others)
    # Omitted max_tokens/temperature/top_p come from the generation config (max_tokens 6).
    short = post(random_base, "/v1/chat/completions", {"messages": USER, **EXTRAS}).json()
    assert short["choices"][0]["finish_reason"] == "length"
    assert len(short["choices"][0]["token_ids"]) == 6
    hot = post(
        random_base, "/v1/chat/completions", {**body, "temperature": 1.0, "top_p": 1.0}
    ).json()["choices"][0]
    assert hot != one, "temperature/top_p change the draws or their log-probs"


def test_stop_strings_max_tokens_and_max_completion_tokens(base):
    body = {"messages": USER, **EXTRAS}
    full = post(base, "/v1/chat/completions", body).json()["choices"][0]
    stopped = post(base, "/v1/chat/completions", {**body, "stop": ["that"]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == "that"
    assert "that" not in stopped["message"]["content"]
    assert full["token_ids"][: len(stopped["token_ids"])] == stopped["token_ids"]
    for key in ("max_tokens", "max_completion_tokens"):
        cut = post(base, "/v1/chat/completions", {**body, key: 4}).json()["choices"][0]
        assert cut["finish_reason"] == "length" and cut["token_ids"] == full["token_ids"][:4]


def test_n_choices_non_stream_and_stream(base):
    body = {"messages": USER, "n": 2, "seed": 1, **EXTRAS}
    reply = post(base, "/v1/chat/completions", body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in reply["choices"])
    chunks = sse_chunks(post(base, "/v1/chat/completions", {**body, "stream": True}).text)
    for index in (0, 1):
        ids = [
            t
            for c in chunks
            for ch in c["choices"]
            if ch["index"] == index
            for t in (ch.get("token_ids") or [])
        ]
        assert ids == reply["choices"][index]["token_ids"]


def test_tool_choice_none_and_no_tools_give_plain_text(base):
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        reply = post(base, "/v1/chat/completions", {"messages": USER, **extra}).json()
        choice = reply["choices"][0]
        assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "stop"
        assert "<tool_call>" not in (choice["message"]["content"] or "")


def test_completions_with_token_id_and_string_prompts(base, client):
    prompt_ids = post(base, "/tokenize", {"messages": USER, "tools": TOOLS}).json()["tokens"]
    reply = post(
        base, "/v1/completions", {"prompt": prompt_ids, "logprobs": 1, "seed": 2, **EXTRAS}
    ).json()
    [choice] = reply["choices"]
    assert reply["object"] == "text_completion" and reply["id"].startswith("cmpl-")
    assert choice["prompt_token_ids"] == prompt_ids
    assert (
        choice["token_ids"][-1]
        == post(base, "/tokenize", {"prompt": "<|im_end|>"}).json()["tokens"][0]
    )
    assert "<tool_call>" in choice["text"], "the same policy turn as chat, unparsed"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert (
        len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == len(choice["token_ids"])
    )
    assert all(
        list(d)[0] == tok
        for d, tok in zip(logprobs["top_logprobs"], logprobs["tokens"], strict=True)
    )
    text = post(base, "/detokenize", {"tokens": prompt_ids}).json()["prompt"]
    by_text = client.completions.create(model="tiny", prompt=text, seed=2, extra_body=EXTRAS)
    assert by_text.choices[0].model_extra["token_ids"] == choice["token_ids"]
    chunks = sse_chunks(
        post(
            base, "/v1/completions", {"prompt": prompt_ids, "seed": 2, "stream": True, **EXTRAS}
        ).text
    )
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_ground_truth_equals_what_was_returned(base):
    httpx.delete(f"{base}/tokcap/ground_truth")
    body = {"messages": USER, "tools": TOOLS, "logprobs": True, "n": 2, **EXTRAS}
    reply = post(base, "/v1/chat/completions", body).json()
    records = httpx.get(f"{base}/tokcap/ground_truth").json()
    assert len(records) == 2
    for record, choice in zip(records, reply["choices"], strict=True):
        assert record["request_id"] == reply["id"] and record["choice_index"] == choice["index"]
        assert record["prompt_token_ids"] == reply["prompt_token_ids"]
        assert record["token_ids"] == choice["token_ids"]
        assert record["logprobs"] == [e["logprob"] for e in choice["logprobs"]["content"]]
        assert record["tool_calls"] == choice["message"]["tool_calls"]
        assert record["content"] == choice["message"]["content"]


def test_errors_use_vllm_error_body(base):
    for body in (
        {"messages": []},
        {"messages": USER, "top_logprobs": 2},
        {"messages": USER, "max_tokens": 200_000},
        {"messages": USER, "stream_options": {}},
    ):
        response = post(base, "/v1/chat/completions", body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert (
        "maximum context length"
        in post(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 200_000}).json()[
            "error"
        ]["message"]
    )
    assert post(base, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(base, "/tokenize", {"prompt": "a", "messages": USER}).status_code == 400


@pytest.fixture(scope="module")
def legacy_base(tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "script.yaml"
    script.write_text(
        "entries:\n"
        "  - match: crash\n    error: {status: 503, message: engine overloaded}\n"
        "  - match: boom\n    error: 500\n"
        "default:\n  text: fine\n"
    )
    settings = EngineSettings(script_path=str(script), token_id_fields=False, ground_truth=True)
    with serve_app(create_app(settings)) as url:
        yield url


def test_scripted_errors_answer_in_vllm_error_body(legacy_base):
    response = post(
        legacy_base,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "please crash"}]},
    )
    assert response.status_code == 503
    assert response.json()["error"] == {
        "message": "engine overloaded",
        "type": "ServiceUnavailable",
        "param": None,
        "code": 503,
    }
    boom = post(
        legacy_base,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "boom"}], "stream": True},
    )
    assert boom.status_code == 500 and boom.json()["error"]["type"] == "InternalServerError"
    assert httpx.get(f"{legacy_base}/tokcap/ground_truth").json() == [], "nothing was sampled"


def test_without_token_ids_answers_like_older_vllm(legacy_base):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, **EXTRAS}
    reply = post(legacy_base, "/v1/chat/completions", body).json()
    assert "prompt_token_ids" not in reply and "token_ids" not in reply["choices"][0]
    assert reply["choices"][0]["message"]["content"] == "fine"
    ids = [int(e["token"].split(":")[1]) for e in reply["choices"][0]["logprobs"]["content"]]
    truth = httpx.get(f"{legacy_base}/tokcap/ground_truth").json()[-1]
    assert ids == truth["token_ids"], "log-prob tokens still carry the ids"
    tokenized = post(legacy_base, "/tokenize", {"messages": body["messages"]}).json()["tokens"]
    assert tokenized == truth["prompt_token_ids"], "/tokenize gives the prompt ids instead"
    chunks = sse_chunks(post(legacy_base, "/v1/chat/completions", {**body, "stream": True}).text)
    assert not any(
        "prompt_token_ids" in c or any("token_ids" in ch for ch in c["choices"]) for c in chunks
    )
    completion = post(legacy_base, "/v1/completions", {"prompt": tokenized, **EXTRAS}).json()
    assert "token_ids" not in completion["choices"][0]
