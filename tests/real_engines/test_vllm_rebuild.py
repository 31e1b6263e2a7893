"""vLLM rollouts through the trainer's side (issue 23): the worker, samples, inspect, report.

Two streamed tool loops run through the front end on a private Redis (its unix socket) to
vLLM itself. A real ``tokcap worker`` rebuilds each from its job and publishes the result;
that result must equal the in-process rebuild of the same record (token arrays and
metrics); ``training_samples`` gives one sample whose ids are the chain's;
``tokcap inspect`` and ``tokcap report`` read those rollouts as a user runs them.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from api.settings import ServerSettings
from capture import training_samples
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from tests.e2e.conftest import ROOT, redis_socket, worker, worker_delivery
from tests.e2e.test_claude_code_e2e import rebuild
from tests.real_engines.log_probs import assert_log_probs_vary
from tests.real_engines.recording_proxy import recording_proxy
from tests.real_engines.test_engines import PINNED, answer, anthropic_loop, base
from tests.support.frontend import front_end
from transports.redis import RedisTokenStore

__all__ = ["redis_socket", "worker", "worker_delivery"]
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
# What may differ between two builds of one rollout: when and how long each took.
TIMING = ("rebuild_seconds", "built_at", "freeze_seconds", "build_seconds")


def redis_settings(upstream: str, url: str) -> ServerSettings:
    sink = "transports.redis:RedisTokenSink"
    capture = TokenIdCaptureConfig(enabled=True, sink=sink, sink_kwargs={"url": url})
    return ServerSettings(upstream=upstream, capture=capture, sampling_overrides=PINNED)


async def in_process(url: str, record: dict[str, Any]) -> dict[str, Any]:
    store = RedisTokenStore(url=url)
    try:
        await finalize_rollout_token_capture(record, store)
    finally:
        await store.close()
    return record


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    metrics = {k: v for k, v in record["_ng_token_capture"].items() if k not in TIMING}
    return {"output": record["response"]["output"], "metrics": metrics}


def tokcap(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tokcap.cli", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_worker_samples_inspect_and_report_on_vllm_rollouts(
    vllm: str, redis_socket: str, worker: Any, tmp_path: Path
) -> None:
    records = []
    with (
        recording_proxy(vllm) as proxy,
        front_end(redis_settings(proxy.url, redis_socket)) as front,
    ):
        for n in range(2):
            rollout = f"vllm-rebuild-{n}"
            replies = anthropic_loop(base(front, rollout), stream=True)
            records.append({"_ng_rollout_id": rollout, "response": {"output": answer(replies[-1])}})
    sampled = [(s["prompt_token_ids"], s["token_ids"], s["logprobs"]) for s in proxy.sampled]
    published_records = []
    # Before the worker retires it: the rollout's two calls, as the user's command shows them.
    shown = tokcap("inspect", "vllm-rebuild-0", "--url", redis_socket, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["calls"] == 2
    for record in records:
        local = asyncio.run(in_process(redis_socket, copy.deepcopy(record)))
        published = asyncio.run(rebuild(redis_socket, copy.deepcopy(record)))
        published_records.append(published)
        assert comparable(published) == comparable(local)
        assert published["mask_sample"] is False and published["_ng_token_capture"]["chains"] == 1
        (sample,) = training_samples(published)
        carriers = [i for i in published["response"]["output"] if "generation_token_ids" in i]
        for carrier in carriers:  # each delivered call is one of vLLM's replies, exactly
            delivered = [carrier[k] for k in ("prompt_token_ids", "generation_token_ids")]
            assert (*map(list, delivered), carrier["generation_log_probs"]) in sampled
            assert_log_probs_vary(carrier["generation_log_probs"], "a delivered call")
        last = carriers[-1]
        assert sample.n_calls == 2
        assert sample.input_ids == last["prompt_token_ids"] + last["generation_token_ids"]
        assert sum(sample.loss_mask) == sum(len(c["generation_token_ids"]) for c in carriers)
    # The results as a trainer keeps them (read off the stream and acknowledged): JSON lines.
    lines = [json.dumps(record, default=list) + "\n" for record in published_records]
    (tmp_path / "results.jsonl").write_text("".join(lines))
    report = tokcap("report", str(tmp_path / "results.jsonl"), "--json")
    assert report.returncode == 0, report.stderr
    figures = json.loads(report.stdout)
    assert figures["rollouts"] == 2 and figures["masked"] == 0 and figures["rebuilt"] == 2
