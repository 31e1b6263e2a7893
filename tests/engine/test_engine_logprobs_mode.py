"""``logprobs_mode`` and top-k: which distribution the returned log-probs come from.

vLLM's ``raw_logprobs`` (its default) reports the model's log-probs before temperature,
top-k and top-p; ``processed_logprobs`` reports the distribution actually sampled from. The
two agree only when sampling changes nothing (temperature 1, no top-k, no top-p), which is
what the front end's start-up probe relies on to tell them apart.
"""

from __future__ import annotations

import math
import random

import httpx
import pytest

from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app
from tokcap_devtools.engine.sampler import FLOOR, PseudoModel

USER = [{"role": "user", "content": "run echo hello"}]
EXTRAS = {"logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True}


def chat(base: str, **fields) -> dict:
    body = {"messages": USER, **EXTRAS, **fields}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    reply.raise_for_status()
    return reply.json()["choices"][0]


def logprobs(choice: dict) -> list[float]:
    return [entry["logprob"] for entry in choice["logprobs"]["content"]]


@pytest.fixture(scope="module")
def bases():
    """A raw and a processed engine, both with the random policy (sampled words too)."""
    common = {"policy": "random", "seed": 3}
    with (
        serve_app(create_app(EngineSettings(logprobs_mode="raw_logprobs", **common))) as raw,
        serve_app(create_app(EngineSettings(logprobs_mode="processed_logprobs", **common))) as cut,
    ):
        yield raw, cut


def test_modes_differ_below_temperature_one_and_agree_at_one(bases):
    raw, processed = bases
    for fields in ({"temperature": 0.5}, {"temperature": 1.0, "top_k": 20}):
        a, b = chat(raw, seed=9, **fields), chat(processed, seed=9, **fields)
        assert a["token_ids"] == b["token_ids"], "the mode changes what is reported, not drawn"
        assert logprobs(a) != logprobs(b)
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert logprobs(chat(raw, seed=9, **neutral)) == logprobs(chat(processed, seed=9, **neutral))


def test_raw_logprobs_do_not_depend_on_sampling_parameters():
    with serve_app(
        create_app(EngineSettings(logprobs_mode="raw_logprobs", ground_truth=True))
    ) as base:
        cold = chat(base, temperature=0.5, top_p=0.8, top_k=7)
        hot = chat(base, temperature=1.0)
        assert cold["token_ids"] == hot["token_ids"] and logprobs(cold) == logprobs(hot)
        [truth] = httpx.get(f"{base}/tokcap/ground_truth").json()[-1:]
        assert truth["logprobs"] == logprobs(hot), "the ground truth is what was returned"


def test_generation_config_top_k_applies_when_the_request_omits_it():
    config = {"temperature": 1.0, "top_p": 1.0, "top_k": 3, "max_tokens": None}
    with serve_app(create_app(EngineSettings(generation_config=config))) as base:
        pinned = chat(base, top_logprobs=6)
        for entry in pinned["logprobs"]["content"]:
            values = [t["logprob"] for t in entry["top_logprobs"]]
            assert [v > FLOOR for v in values] == [True] * 3 + [False] * 3
        open_ = chat(base, top_logprobs=6, top_k=-1)
        assert all(
            t["logprob"] > FLOOR for e in open_["logprobs"]["content"] for t in e["top_logprobs"]
        )
        assert logprobs(open_) != logprobs(pinned)


@pytest.mark.parametrize("top_k", [1, 2, 17, 4099])
def test_pseudo_model_top_k_keeps_k_tokens_and_normalizes(top_k):
    model = PseudoModel(211)
    for context in ([1, 2], [3, 4, 5], [200]):
        step = model.step(context, 42, temperature=0.7, top_p=1.0, top_k=top_k, top_logprobs=211)
        kept = [lp for _, lp in step.top if lp > FLOOR]
        assert len(kept) == min(top_k, 211)
        assert sum(math.exp(lp) for lp in kept) == pytest.approx(1.0, abs=1e-9)
        raw = model.step(context, 42, temperature=0.7, top_p=0.5, top_k=top_k, raw=True)
        assert raw == model.step(context, 42, temperature=1.0, top_p=1.0)


def test_pseudo_model_samples_within_top_k_and_reports_raw_on_request():
    model = PseudoModel(301)
    allowed = list(range(0, 301, 3))
    tight = {"temperature": 0.6, "top_p": 1.0, "top_k": 4, "top_logprobs": 4}
    loose = {"temperature": 0.9, "top_p": 0.7, "top_k": 0, "top_logprobs": 4}
    raw_of: dict[int, float] = {}
    drawn = set()
    for draw in range(400):
        for params in (tight, loose):
            step = model.sample([9, 9], allowed, random.Random(draw), **params)
            raw = model.sample([9, 9], allowed, random.Random(draw), **params, raw=True)
            assert raw.token_id == step.token_id, "the mode changes what is reported, not drawn"
            assert [t for t, _ in raw.top] == [t for t, _ in step.top]
            assert raw_of.setdefault(raw.token_id, raw.logprob) == raw.logprob
            if params is tight:
                drawn.add(step.token_id)
    best_four = {t for t, _ in model.sample([9, 9], allowed, random.Random(0), **tight).top}
    assert drawn <= best_four and len(drawn) > 1
