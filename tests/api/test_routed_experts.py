"""MoE routed experts captured with the ids, end to end (issue 25).

The tokcap engine serves as an MoE (``--routed-experts``) on vLLM's wire (a ``.npy`` per
choice) or SGLang's (flat int32 in ``meta_info``); the front end, with
``model_server.routed_experts`` on, captures each call's routes beside its ids. What is
delivered is checked against the engine's ground truth: every delivered call's routes
equal those of the ids it read, in the carrier items and in ``training_samples``, for
streamed and whole calls, text and faithful prompts. A reply without routes is not captured,
and its rollout is masked.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest

from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from capture.codec.views import json_default
from capture.routes import Routes
from capture.samples import training_samples
from tests.support.fault_loops import Rollout, Tally, final_record, harness_client, run_loops
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    engine_server,
    file_store_settings,
    finalize,
    freeze,
    front_end,
)
from tokcap_devtools.engine.routing import MoeShape, routes_of

MOE = MoeShape(layers=6, top_k=4, experts=40)
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
CASES = [
    ("vllm", "text", True),
    ("vllm", "text", False),
    ("vllm", "faithful", True),
    ("sglang", "text", True),
    ("sglang", "faithful", False),
]


def settings(upstream: str, store: Path, prompts: str, **server: Any) -> ServerSettings:
    renderer = {"tokenizer": "qwen3"} if prompts == "faithful" else {}
    return file_store_settings(
        upstream, store, sampling_overrides=PINNED, prompts=prompts, renderer=renderer, **server
    )


def drive(front: str, rollout: Rollout, stream: bool) -> None:
    async def loops() -> None:
        async with harness_client(Tally()) as http:
            await run_loops(front, [rollout], http, stream=stream)

    asyncio.run(loops())


def expected(prompt: Any, generation: Any) -> numpy.ndarray:
    return routes_of([*prompt, *generation], MOE)


@pytest.mark.parametrize(("wire", "prompts", "stream"), CASES)
def test_each_delivered_call_carries_the_routes_of_the_ids_it_read(
    wire: str, prompts: str, stream: bool, tmp_path: Path
) -> None:
    store = tmp_path / "captures"
    engine_kw: dict[str, Any] = {"wire": wire, "moe": MOE}
    if prompts == "faithful":
        engine_kw["tokenizer_path"] = "qwen3"
    moe = {"layers": MOE.layers, "top_k": MOE.top_k, "experts": MOE.experts}
    with engine_server(**engine_kw) as engine:
        front_settings = settings(engine, store, prompts, routed_experts=True, moe=moe)
        with front_end(front_settings) as front:
            rollout = Rollout(f"routes-{wire}-{prompts}-{stream}", 3)
            drive(front, rollout, stream)
            truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert rollout.error is None and len(rollout.answered) == 3
    snapshot = freeze(store, rollout.rollout_id)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)
    for entry in snapshot.entries:
        want = expected(entry.prompt_token_ids, entry.generation_token_ids)
        assert (entry.routed_experts.to_numpy() == want).all()
    record, build = finalize(store, rollout.rollout_id, final_record(rollout)["response"]["output"])
    assert_one_contiguous_chain(build, record, 3)
    # Through JSON, as the results stream carries them: one compact object per carrier.
    record = json.loads(json.dumps(record, default=json_default))
    carriers = [i for i in record["response"]["output"] if "generation_token_ids" in i]
    for item in carriers:
        routes = Routes.coerce(item["routed_experts"])
        want = expected(item["prompt_token_ids"], item["generation_token_ids"])
        assert (routes.to_numpy() == want).all()
    [sample] = training_samples(record)
    rows = sample.routed_experts.to_numpy()
    assert rows.shape == (len(sample.input_ids), MOE.layers, MOE.top_k)
    assert (rows[:-1] == routes_of(sample.input_ids, MOE)).all()


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
def test_a_reply_without_routes_is_not_captured_and_its_rollout_is_masked(
    wire: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Routes on at the front end, but the engine is no MoE (or was started without the
    flag): the harness is still answered, and no call is delivered without its routes."""
    store = tmp_path / "captures"
    moe = {"layers": MOE.layers, "top_k": MOE.top_k}
    with engine_server(wire=wire) as engine:
        with front_end(settings(engine, store, "text", routed_experts=True, moe=moe)) as front:
            rollout = Rollout(f"no-routes-{wire}", 2)
            drive(front, rollout, stream=False)
    assert rollout.error is None and rollout.answered
    snapshot = freeze(store, rollout.rollout_id)
    assert snapshot.incomplete and not snapshot.entries
    assert "the engine returned no routed_experts" in caplog.text
    record, build = finalize(store, rollout.rollout_id, final_record(rollout)["response"]["output"])
    assert build.masked and training_samples(record) == []


def test_routes_of_another_shape_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose routes do not have the configured shape: not captured."""
    store = tmp_path / "captures"
    with engine_server(moe=MOE) as engine:
        moe = {"layers": MOE.layers + 1, "top_k": MOE.top_k}
        with front_end(settings(engine, store, "text", routed_experts=True, moe=moe)) as front:
            rollout = Rollout("wrong-shape", 1)
            drive(front, rollout, stream=False)
    snapshot = freeze(store, rollout.rollout_id)
    assert snapshot.incomplete and not snapshot.entries
    assert "model_server.moe says 7 x 4" in caplog.text


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
def test_the_probe_refuses_an_engine_without_routes_and_accepts_one_with(
    wire: str, tmp_path: Path
) -> None:
    moe = {"layers": MOE.layers, "top_k": MOE.top_k, "experts": MOE.experts}
    with engine_server(wire=wire) as engine:
        with pytest.raises(EngineRefused, match="--enable-return-routed-experts"):
            asyncio.run(probe(settings(engine, tmp_path, "text", routed_experts=True, moe=moe)))
    with engine_server(wire=wire, moe=MOE) as engine:
        report = asyncio.run(
            probe(settings(engine, tmp_path, "text", routed_experts=True, moe=moe))
        )
        assert report.family == wire
