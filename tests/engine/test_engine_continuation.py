"""A prompt that ends inside a reply the engine sampled gets the rest of that reply
(``tokcap_devtools.engine.continuation``), as a model goes on with its own text.

This is what a front end that resumes a cut call sends: the call's prompt and the ids
sampled so far. The rest comes with the log-probs the whole reply had at those positions;
a prompt that extends no reply, or strays from one, is answered afresh.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.frontend import engine_server

PROMPT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine() -> str:
    with engine_server(tokenizer_path="qwen3") as url:
        yield url


def complete(engine: str, prompt: list[int], max_tokens: int = 200) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "logprobs": 0,
        "return_token_ids": True,
    }
    reply = httpx.post(engine + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_a_cut_reply_goes_on_where_it_stopped(engine: str) -> None:
    prompt = httpx.post(engine + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    whole = complete(engine, prompt)
    ids, values = whole["token_ids"], whole["logprobs"]["token_logprobs"]
    assert len(ids) > 6
    rest = complete(engine, prompt + ids[:5])
    assert rest["token_ids"] == ids[5:] and rest["logprobs"]["token_logprobs"] == values[5:]
    assert rest["finish_reason"] == whole["finish_reason"]
    again = complete(engine, prompt + ids[:5] + rest["token_ids"][:1], max_tokens=2)
    assert again["token_ids"] == ids[6:8] and again["finish_reason"] == "length"


def test_a_prompt_that_strays_from_the_reply_is_answered_afresh(engine: str) -> None:
    prompt = httpx.post(engine + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    whole = complete(engine, prompt)["token_ids"]
    strayed = complete(engine, prompt + [whole[0], (whole[1] + 1) % 1000 + 100])["token_ids"]
    assert strayed != whole[2:]
