"""The tokcap engine speaking SGLang 0.5.23 (``wire="sglang"``) over real HTTP on 127.0.0.1.

Ids must sit where SGLang puts them (per choice, ``response_token_ids``; ``output_ids`` from
``/generate``) and equal what the engine sampled (its ground truth), and the engine must
refuse what SGLang refuses, with SGLang's error bodies.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "run echo hello"}]
IDS = {"return_token_ids": True, "return_meta_info": True, "logprobs": True}


@pytest.fixture(scope="module")
def base():
    with serve_app(
        create_app(EngineSettings(wire="sglang", model="tiny", ground_truth=True))
    ) as url:
        yield url


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30)


def last_truth(base: str, count: int = 1) -> list[dict]:
    return httpx.get(f"{base}/tokcap/ground_truth", timeout=30).json()[-count:]


def test_chat_ids_are_per_choice_and_equal_the_ground_truth(base):
    reply = post(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, **IDS}).json()
    [truth] = last_truth(base)
    [choice] = reply["choices"]
    assert not reply["id"].startswith("chatcmpl-") and truth["request_id"] == reply["id"]
    assert "prompt_token_ids" not in reply and "token_ids" not in choice
    assert choice["prompt_token_ids"] == truth["prompt_token_ids"]
    assert choice["response_token_ids"] == truth["token_ids"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "Bash"
    meta = choice["meta_info"]
    assert meta["id"] == reply["id"]
    assert meta["finish_reason"] == {"type": "stop", "matched": truth["token_ids"][-1]}
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == truth["token_ids"]
    assert [t[0] for t in triples] == truth["logprobs"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [t[2] for t in triples], "tokens are text"
    assert not any(e["token"].startswith("token_id:") for e in content)
    assert [e["logprob"] for e in content] == truth["logprobs"]
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        len(truth["prompt_token_ids"]),
        len(truth["token_ids"]),
    )
    assert 0 < usage["reasoning_tokens"] < usage["completion_tokens"]
    assert reply["metadata"] == {"weight_version": "default"}


def test_chat_without_id_flags_has_no_id_fields(base):
    reply = post(base, "/v1/chat/completions", {"messages": USER, "logprobs": True}).json()
    [choice] = reply["choices"]
    assert not {"prompt_token_ids", "response_token_ids", "token_ids", "meta_info"} & set(choice)
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == last_truth(base)[0]["token_ids"][-1], "the end token's id"
    only_prompt = post(
        base, "/v1/chat/completions", {"messages": USER, "return_prompt_token_ids": True}
    ).json()["choices"][0]
    assert "prompt_token_ids" in only_prompt and "response_token_ids" not in only_prompt
    stopped = post(base, "/v1/chat/completions", {"messages": USER, "stop": ["run"]}).json()
    assert stopped["choices"][0]["matched_stop"] == "run"


def test_top_logprobs_are_the_best_first_and_minus_inf_is_null(base):
    body = {"messages": USER, "logprobs": True, "top_logprobs": 3, "top_p": 0.5}
    content = post(base, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == entry["token"]
        values = [t["logprob"] for t in tops]
        assert values[0] is not None and all(v is None or v <= values[0] for v in values)
    assert any(t["logprob"] is None for e in content for t in e["top_logprobs"]), (
        "tokens outside the top-p nucleus have -inf, written as null"
    )


def test_generate_with_input_ids_equals_the_ground_truth(base):
    chat = post(base, "/v1/chat/completions", {"messages": USER, "return_token_ids": True}).json()
    prompt_ids = chat["choices"][0]["prompt_token_ids"]
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 500}}
    reply = post(base, "/generate", {**body, "return_logprob": True}).json()
    [truth] = last_truth(base)
    assert (
        truth["prompt_token_ids"] == prompt_ids and truth["request_id"] == reply["meta_info"]["id"]
    )
    assert reply["output_ids"] == truth["token_ids"]
    assert reply["output_ids"] == chat["choices"][0]["response_token_ids"], "the same answer"
    assert reply["text"].endswith(chat["choices"][0]["message"]["content"]), "no parser here"
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": truth["token_ids"][-1]}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        len(prompt_ids),
        len(truth["token_ids"]),
    )
    assert [t[:2] for t in meta["output_token_logprobs"]] == [
        [lp, i] for lp, i in zip(truth["logprobs"], truth["token_ids"], strict=True)
    ]
    assert all(t[2] is None for t in meta["output_token_logprobs"])
    texts = post(
        base, "/generate", {**body, "return_logprob": True, "return_text_in_logprobs": True}
    )
    assert all(isinstance(t[2], str) for t in texts.json()["meta_info"]["output_token_logprobs"])
    short = post(
        base, "/generate", {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 2}}
    )
    assert short.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert "output_token_logprobs" not in short.json()["meta_info"]


def test_streams_refuse_id_flags_and_carry_no_ids(base):
    for flag in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
        refused = post(base, "/v1/chat/completions", {"messages": USER, "stream": True, flag: True})
        assert refused.status_code == 400
        assert refused.json() == {
            "object": "error",
            "message": f"{flag} is not supported with streaming on /v1/chat/completions. "
            f"Please set stream=false when using {flag}=true.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    stream = post(base, "/v1/chat/completions", {"messages": USER, "stream": True}).text
    assert stream.endswith("data: [DONE]\n\n") and "token_ids" not in stream


def test_info_routes_and_no_version_route(base):
    assert httpx.get(f"{base}/version").status_code == 404
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["owned_by"] == "sglang" and card["max_model_len"] == 131072
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(base + path).json()
        assert info["version"] == "0.5.23" and info["context_length"] == 131072
    for path in ("/get_model_info", "/model_info"):
        assert httpx.get(base + path).json()["model_path"] == "tiny"


def test_errors_use_sglang_bodies_and_words(base):
    chat = post(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 200_000})
    assert chat.status_code == 400
    error = chat.json()
    assert error["object"] == "error" and error["code"] == 400
    assert error["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 131072 tokens. "
        "You requested a total of "
    )
    native = post(
        base, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 131071}}
    )
    assert native.status_code == 400
    assert native.json()["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 131072 tokens. "
        "You requested a total of 131073 tokens: 2 tokens from the input messages and 131071 "
        "tokens for the completion. Please reduce the number of tokens in the input messages "
        "or the completion to fit within the limit."
    )
    assert post(base, "/v1/chat/completions", {"messages": []}).json()["object"] == "error"
    assert post(base, "/generate", {"sampling_params": {}}).status_code == 400


def test_vllm_wire_uses_vllm_0_10_2_context_words():
    with serve_app(create_app(EngineSettings(max_model_len=64))) as url:
        prompt = post(url, "/tokenize", {"messages": USER}).json()["count"]
        over = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 60})
        assert over.status_code == 400
        assert over.json()["error"]["message"] == (
            f"'max_tokens' or 'max_completion_tokens' is too large: 60. This model's maximum "
            f"context length is 64 tokens and your request has {prompt} input tokens "
            f"(60 > 64 - {prompt})."
        )
        long = [{"role": "user", "content": "word " * 80}]
        count = post(url, "/tokenize", {"messages": long}).json()["count"]
        alone = post(url, "/v1/chat/completions", {"messages": long})
        assert alone.json()["error"]["message"] == (
            f"This model's maximum context length is 64 tokens. However, your request has "
            f"{count} input tokens. Please reduce the length of the input messages."
        )


def test_both_wires_sample_and_log_the_same_sequences(base):
    body = {"messages": USER, "tools": TOOLS, "n": 2, "seed": 4, "logprobs": True}
    httpx.delete(f"{base}/tokcap/ground_truth", timeout=30)
    sglang = post(base, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    sglang_truth = last_truth(base, 2)
    with serve_app(create_app(EngineSettings(model="tiny", ground_truth=True))) as vllm_base:
        vllm = post(vllm_base, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
        vllm_truth = last_truth(vllm_base, 2)
    assert [r["choice_index"] for r in sglang_truth] == [0, 1]
    assert [r["request_id"] for r in sglang_truth] == [sglang["id"]] * 2
    for key in ("prompt_token_ids", "token_ids", "logprobs", "content", "reasoning"):
        assert [r[key] for r in sglang_truth] == [r[key] for r in vllm_truth], key
    functions = [[c["function"] for c in r["tool_calls"]] for r in sglang_truth]
    assert functions == [[c["function"] for c in r["tool_calls"]] for r in vllm_truth]
    assert [c["response_token_ids"] for c in sglang["choices"]] == [
        c["token_ids"] for c in vllm["choices"]
    ]


def test_without_token_ids_answers_like_sglang_before_0_5_17():
    settings = EngineSettings(wire="sglang", token_id_fields=False)
    with serve_app(create_app(settings)) as url:
        reply = post(url, "/v1/chat/completions", {"messages": USER, **IDS}).json()
    [choice] = reply["choices"]
    assert "prompt_token_ids" not in choice and "response_token_ids" not in choice
    assert [t[1] for t in choice["meta_info"]["output_token_logprobs"]], "ids only in meta_info"
