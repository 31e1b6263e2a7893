"""Each engine adapter reads its engine's own reply shapes, pinned by fixture files.

The fixtures (``tests/support/fixtures/engines``, versions and sources in their README) are
written from vLLM 0.10.2's and SGLang 0.5.17/0.5.23's protocol definitions. A consistent
reply is read whole; each way a reply can be wrong for capture (a placeholder or null
log-prob, a missing id field, the two id sources disagreeing, counts off) marks the ids
unusable instead of trusting half of them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from api.engine import FAMILIES, family_of_models, sglang, vllm
from api.engine.clamp import prompt_length_in

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "engines"
PROMPT = [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


# -- vLLM 0.10.2 ----------------------------------------------------------------------------


def test_vllm_chat_reads_top_level_prompt_and_per_choice_ids() -> None:
    reply = fixture("vllm-0.10.2-chat.json")
    generation = vllm.read_chat(reply)
    assert generation.ids_problem is None
    assert generation.prompt_token_ids == reply["prompt_token_ids"]
    assert generation.generation_token_ids == reply["choices"][0]["token_ids"]
    assert generation.generation_log_probs == [
        item["logprob"] for item in reply["choices"][0]["logprobs"]["content"]
    ]
    assert generation.text == reply["choices"][0]["message"]["content"]


def test_vllm_placeholder_log_prob_is_missing_not_a_value() -> None:
    generation = vllm.read_chat(fixture("vllm-0.10.2-chat-placeholder.json"))
    assert "placeholder -9999.0" in generation.ids_problem
    assert generation.generation_log_probs is None and generation.prompt_token_ids is None


def test_vllm_ids_of_another_engine_are_not_read() -> None:
    """SGLang's per-choice fields are not where vLLM puts its ids: nothing is trusted."""
    generation = vllm.read_chat(fixture("sglang-0.5.23-chat.json"))
    assert generation.ids_problem is not None and "token_id:N" in generation.ids_problem


def test_vllm_token_in_completion_reads_per_choice_ids() -> None:
    reply = fixture("vllm-0.10.2-completions-tokens.json")
    generation = vllm.read_tokens(reply, PROMPT)
    assert generation.ids_problem is None
    assert generation.prompt_token_ids == PROMPT
    assert generation.generation_token_ids == reply["choices"][0]["token_ids"]
    assert generation.text == "Hello! How can I help?"


def test_vllm_token_in_prompt_must_be_the_one_sent() -> None:
    generation = vllm.read_tokens(fixture("vllm-0.10.2-completions-tokens.json"), PROMPT[1:])
    assert "not the prompt ids sent" in generation.ids_problem


def test_vllm_token_in_request_asks_for_ids_and_log_probs() -> None:
    path, body = vllm.tokens_body(PROMPT, "m", {"max_tokens": 16, "temperature": 1.0})
    assert path == "/v1/completions" and body["prompt"] == PROMPT
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["logprobs"] == 0 and body["max_tokens"] == 16 and body["stream"] is False


# -- SGLang 0.5.17 / 0.5.23 -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang-0.5.23-chat.json", "sglang-0.5.17-chat.json"])
def test_sglang_chat_reads_per_choice_ids_checked_against_the_triples(name: str) -> None:
    reply = fixture(name)
    choice = reply["choices"][0]
    generation = sglang.read_chat(reply)
    assert generation.ids_problem is None
    assert generation.prompt_token_ids == choice["prompt_token_ids"]
    assert generation.generation_token_ids == choice.get(
        "response_token_ids", choice.get("token_ids")
    )
    assert generation.generation_log_probs == [
        t[0] for t in choice["meta_info"]["output_token_logprobs"]
    ]
    assert generation.stop_reason == choice["matched_stop"]


def test_sglang_null_log_prob_is_missing() -> None:
    reply = fixture("sglang-0.5.23-chat.json")
    choice = reply["choices"][0]
    choice["logprobs"]["content"][2]["logprob"] = None
    choice["meta_info"]["output_token_logprobs"][2][0] = None
    generation = sglang.read_chat(reply)
    assert "is null" in generation.ids_problem and generation.generation_log_probs is None


def sglang_reply(change: Any) -> str | None:
    reply = fixture("sglang-0.5.23-chat.json")
    change(reply["choices"][0], reply)
    return sglang.read_chat(reply).ids_problem


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda c, r: c.pop("response_token_ids"), "no response_token_ids"),
        (lambda c, r: c.pop("prompt_token_ids"), "no prompt_token_ids"),
        (lambda c, r: c.pop("meta_info"), "no meta_info.output_token_logprobs"),
        (lambda c, r: c["response_token_ids"].pop(), "disagree"),
        (lambda c, r: c["meta_info"]["output_token_logprobs"][0].__setitem__(1, 7), "disagree"),
        (lambda c, r: c["logprobs"]["content"][0].__setitem__("logprob", -0.5), "disagree"),
        (lambda c, r: r["usage"].__setitem__("prompt_tokens", 8), "usage.prompt_tokens"),
        (lambda c, r: c["prompt_token_ids"].__setitem__(0, -3), "not an integer >= 0"),
    ],
    ids=[
        "no-response-ids",
        "no-prompt-ids",
        "no-meta-info",
        "ids-cut",
        "triple-id-differs",
        "log-prob-differs",
        "prompt-count",
        "negative-id",
    ],
)
def test_sglang_replies_that_cannot_be_captured(change: Any, expected: str) -> None:
    problem = sglang_reply(change)
    assert problem is not None and expected in problem


def test_sglang_generate_reads_output_ids_and_triples() -> None:
    reply = fixture("sglang-0.5.23-generate.json")
    generation = sglang.read_tokens(reply, PROMPT)
    assert generation.ids_problem is None
    assert generation.generation_token_ids == reply["output_ids"]
    assert generation.finish_reason == "stop" and generation.stop_reason == 151645
    wrong = copy.deepcopy(reply)
    wrong["meta_info"]["prompt_tokens"] = 10
    assert "usage.prompt_tokens" in sglang.read_tokens(wrong, PROMPT).ids_problem


def test_sglang_token_in_request_is_native_generate() -> None:
    path, body = sglang.tokens_body(PROMPT, "m", {"max_tokens": 16, "temperature": 0.5})
    assert path == "/generate" and body["input_ids"] == PROMPT
    assert body["sampling_params"] == {
        "max_new_tokens": 16,
        "temperature": 0.5,
        "skip_special_tokens": False,
    }
    assert body["return_logprob"] is True and body["stream"] is False


def test_sglang_chat_request_asks_for_both_id_sources() -> None:
    body, overridden = sglang.SGLang().chat_body(
        {"messages": [], "stream": True}, "m", {"top_k": -1}
    )
    assert body["return_token_ids"] and body["return_meta_info"] and body["logprobs"]
    assert body["stream"] is False and body["top_k"] == -1 and overridden == ("top_k",)


# -- telling them apart, and the context-length refusals ------------------------------------


def test_the_family_comes_from_owned_by() -> None:
    assert family_of_models([{"id": "m", "owned_by": "vllm"}]) == "vllm"
    assert family_of_models([{"id": "m", "owned_by": "sglang"}]) == "sglang"
    assert family_of_models([{"id": "m", "owned_by": "someone"}]) is None
    assert set(FAMILIES) == {"vllm", "sglang"}


@pytest.mark.parametrize(
    "message, length",
    [
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum "
            "context length is 32768 tokens and your request has 1200 input tokens "
            "(32000 > 32768 - 1200). None",
            1200,
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens (1000 in the messages, 4000 in the completion).",
            1000,
        ),
        (
            "Requested token count exceeds the model's maximum context length of 4096 tokens. "
            "You requested a total of 5000 tokens: 900 tokens from the input messages and "
            "4100 tokens for the completion.",
            900,
        ),
        ("upstream: something else went wrong", None),
    ],
    ids=["vllm-0.10.2", "vllm-older", "sglang-0.5.23", "other"],
)
def test_the_prompt_length_an_engine_names_when_it_refuses(message: str, length: int | None):
    assert prompt_length_in(message) == length
