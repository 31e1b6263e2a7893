"""The engine reply fixtures (tests/support/fixtures/engines) parse and agree with themselves.

The adapters' unit tests check exactly these agreements on real replies (id counts equal
usage counts, one log-prob per generated id, triples carry the generated ids), so a fixture
that broke one would test the wrong thing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "engines"
VLLM_CHAT = ("vllm-0.10.2-chat.json", "vllm-0.10.2-chat-placeholder.json")
SGLANG_CHAT = {
    "sglang-0.5.23-chat.json": "response_token_ids",
    "sglang-0.5.17-chat.json": "token_ids",
}


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def test_every_fixture_is_listed_in_the_readme():
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    names = sorted(path.name for path in FIXTURES.glob("*.json"))
    assert len(names) == 6
    assert all(f"`{name}`" in readme for name in names)


@pytest.mark.parametrize("name", VLLM_CHAT)
def test_vllm_chat_ids_are_top_level_prompt_and_per_choice_generated(name):
    body = load(name)
    [choice] = body["choices"]
    assert body["id"].startswith("chatcmpl-")
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    placeholders = [e for e in content if e["logprob"] == -9999.0]
    assert len(placeholders) == (1 if "placeholder" in name else 0)


def test_vllm_completion_ids_are_per_choice():
    body = load("vllm-0.10.2-completions-tokens.json")
    [choice] = body["choices"]
    assert "prompt_token_ids" not in body
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    ids = choice["token_ids"]
    assert len(ids) == body["usage"]["completion_tokens"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert len(logprobs["token_logprobs"]) == len(ids) == len(logprobs["top_logprobs"])
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(ids))]


@pytest.mark.parametrize("name", sorted(SGLANG_CHAT))
def test_sglang_chat_ids_are_per_choice_with_text_logprobs(name):
    body = load(name)
    [choice] = body["choices"]
    ids_key = SGLANG_CHAT[name]
    assert "prompt_token_ids" not in body and not body["id"].startswith("chatcmpl-")
    assert set(choice) & {"token_ids", "response_token_ids"} == {ids_key}
    ids = choice[ids_key]
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(ids) == body["usage"]["completion_tokens"]
    assert "reasoning_tokens" in body["usage"]
    assert choice["matched_stop"] == ids[-1]
    meta = choice["meta_info"]
    assert meta["id"] == body["id"] and meta["finish_reason"]["matched"] == ids[-1]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        len(choice["prompt_token_ids"]),
        len(ids),
    )
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == ids
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [t[2] for t in triples]
    assert [e["logprob"] for e in content] == [t[0] for t in triples]
    assert not any(e["token"].startswith("token_id:") for e in content)


def test_sglang_generate_output_ids_and_triples_agree():
    body = load("sglang-0.5.23-generate.json")
    meta = body["meta_info"]
    ids = body["output_ids"]
    assert meta["completion_tokens"] == len(ids)
    assert meta["finish_reason"] == {"type": "stop", "matched": ids[-1]}
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    assert all(t[2] is None for t in meta["output_token_logprobs"]), "no return_text_in_logprobs"
