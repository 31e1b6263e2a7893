"""Faithful prompts end to end: official-SDK tool loops on the real Qwen3 template.

The engine (``tokcap engine --tokenizer qwen3``) renders chat requests with the
``renderers`` Qwen3 renderer, as a served Qwen3 would, and samples non-canonically (5% of
tokens) with compact tool-call JSON, thinking on most turns. In text mode every re-rendered
prompt drifts from the sampled ids and the rollout splits; in faithful mode the front end
builds the prompts itself and every rollout is one chain, checked against the engine's
ground truth. Loops cover all three dialects, streamed and not.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from tests.support.dialect_loops import Figures, Harness, judge, loops_for, run_loops, write_script
from tests.support.fault_loops import GroundTruth
from tests.support.frontend import engine_server, file_store_settings, front_end
from tests.support.servers import free_port, run_process
from transports.redis import RedisTokenStore

FAITHFUL = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}


def qwen3_engine(tmp_path: Path, **knobs: Any) -> dict[str, Any]:
    """A Qwen3 engine that drifts the way real serving does, logging what it samples."""
    return {
        "tokenizer_path": "qwen3",
        "script_path": write_script(tmp_path / "script.yaml"),
        "ground_truth_path": str(tmp_path / "truth.jsonl"),
        "noncanonical_rate": 0.05,
        "json_reserialize": True,
        "seed": 5,
        **knobs,
    }


async def _judged(source: Any, loops: list, truth_path: Path) -> Figures:
    try:
        return await judge(source, loops, GroundTruth(truth_path))
    finally:
        await source.close()


def _run(harness: Harness, loops: list) -> list:
    return asyncio.run(run_loops(harness, loops))


def test_faithful_loops_are_one_chain_with_every_sampled_token(tmp_path: Path) -> None:
    engine = qwen3_engine(tmp_path)
    with engine_server(**engine) as engine_url:
        settings = file_store_settings(engine_url, tmp_path / "store", **FAITHFUL)
        with front_end(settings) as front:
            harness = Harness([front])
            loops = _run(harness, loops_for("faithful", 6))
            metrics = httpx.get(front + "/metrics").text
    figures = asyncio.run(
        _judged(FileTokenStore(tmp_path / "store"), loops, Path(engine["ground_truth_path"]))
    )
    print(figures.row("faithful, qwen3, all knobs"))
    assert figures.errors == [] and figures.wrong == []
    assert figures.one_chain == figures.rollouts == 6
    assert figures.delivered_share == 1.0
    calls = sum(len(loop.replies) for loop in loops)
    assert harness.prompts == {"root": 6, "continued:memory": calls - 6}
    assert 'tokcap_faithful_prompts_total{kind="root"} 6.0' in metrics
    assert "tokcap_faithful_fallbacks_total{" not in metrics


def test_text_mode_reports_the_split_and_never_delivers_wrong(tmp_path: Path) -> None:
    engine = qwen3_engine(tmp_path)
    with engine_server(**engine) as engine_url:
        with front_end(file_store_settings(engine_url, tmp_path / "store")) as front:
            loops = _run(Harness([front]), loops_for("text", 6))
    figures = asyncio.run(
        _judged(FileTokenStore(tmp_path / "store"), loops, Path(engine["ground_truth_path"]))
    )
    print(figures.row("text, qwen3, all knobs"))
    assert figures.errors == [] and figures.wrong == []
    assert figures.one_chain < figures.rollouts  # the drift is real: chains split
    assert figures.delivered_share < 1.0


def test_front_ends_sharing_a_redis_store_continue_each_others_calls(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Calls alternate between two front ends: each continues the other's, through Redis."""
    engine = qwen3_engine(tmp_path)
    capture = TokenIdCaptureConfig(
        enabled=True,
        sink="transports.redis:RedisTokenSink",
        sink_kwargs={"url": redis_url, "key_prefix": redis_prefix},
    )
    with engine_server(**engine) as engine_url:
        settings = ServerSettings(upstream=engine_url, capture=capture, **FAITHFUL)
        with front_end(settings) as first, front_end(settings) as second:
            harness = Harness([first, second])
            loops = _run(harness, loops_for("two-fronts", 6))
    source = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    figures = asyncio.run(_judged(source, loops, Path(engine["ground_truth_path"])))
    assert figures.errors == [] and figures.wrong == []
    assert figures.one_chain == figures.rollouts == 6
    calls = sum(len(loop.replies) for loop in loops)
    assert harness.prompts == {"root": 6, "continued:store": calls - 6}


def test_tokcap_serve_with_two_workers_keeps_rollouts_one_chain(tmp_path: Path) -> None:
    engine = qwen3_engine(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model_server:\n  prompts: faithful\n  renderer: {name: qwen3, tokenizer: qwen3}\n"
        f"env:\n  nemo_gym:\n    token_id_capture:\n      enabled: true\n"
        f"      dir: {tmp_path / 'store'}\n"
    )
    port = free_port()
    front = f"http://127.0.0.1:{port}"
    with engine_server(**engine) as engine_url:
        args = [sys.executable, "-m", "tokcap.cli", "serve", "--config", str(config)]
        args += ["--upstream", engine_url, "--port", str(port), "--workers", "2"]
        with run_process([*args, "--log-level", "warning"], ready_url=front + "/health"):
            # The start-up probe sampled too; the ground truth is the harness's calls.
            httpx.delete(engine_url + "/tokcap/ground_truth").raise_for_status()
            harness = Harness([front])
            loops = _run(harness, loops_for("workers", 12))
    figures = asyncio.run(
        _judged(FileTokenStore(tmp_path / "store"), loops, Path(engine["ground_truth_path"]))
    )
    assert figures.errors == [] and figures.wrong == []
    assert figures.one_chain == figures.rollouts == 12
    # A new connection per call spreads calls over both workers: some continue a call the
    # other worker served, found in the store.
    assert harness.prompts["continued:store"] > 0, harness.prompts
    assert harness.prompts["root"] == 12 and not any("fallback" in k for k in harness.prompts)


def test_a_history_the_front_end_never_served_is_a_counted_fallback(tmp_path: Path) -> None:
    engine = qwen3_engine(tmp_path, noncanonical_rate=0.0)
    rollout = "foreign-history"
    with engine_server(**engine) as engine_url:
        settings = file_store_settings(engine_url, tmp_path / "store", **FAITHFUL)
        with front_end(settings) as front:
            body = {
                "model": "m",
                "max_tokens": 64,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "An answer from elsewhere."},
                    {"role": "user", "content": "finish"},
                ],
            }
            url = f"{front}/ng-rollout/{rollout}/training-token-capture/v1/messages"
            reply = httpx.post(url, json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-tokcap-prompt"] == "fallback:no_match"
            metrics = httpx.get(front + "/metrics").text
    assert 'tokcap_faithful_fallbacks_total{reason="no_match"} 1.0' in metrics
    record = {"_ng_rollout_id": rollout, "response": {"output": []}}
    store = FileTokenStore(tmp_path / "store")
    build = asyncio.run(finalize_rollout_token_capture(record, store))
    assert build.metrics["faithful_fallbacks"] == {"no_match": 1}


def test_the_probe_refuses_an_engine_whose_vocabulary_is_not_the_renderers(
    tmp_path: Path,
) -> None:
    with engine_server() as engine_url:  # the shipped BPE, not Qwen3's vocabulary
        settings = ServerSettings(upstream=engine_url, **FAITHFUL)
        with pytest.raises(EngineRefused, match="renderer|vocabulary|token"):
            asyncio.run(probe(settings))
    with engine_server(tokenizer_path="qwen3") as engine_url:
        report = asyncio.run(probe(ServerSettings(upstream=engine_url, **FAITHFUL)))
        assert report.family == "vllm"
