"""The real Claude Code CLI through tokcap against vLLM and SGLang themselves (issue 23).

The CLI runs in a loopback-only network namespace with the engine, a recording proxy and the
front end beside it (``tests.support.claude_code_driver``); the front end captures on a
private Redis and a real ``tokcap worker`` rebuilds. The scripted turns answer the CLI's
first call with thinking and a hermes tool call to its Bash tool (``ls``), which the CLI
runs; the next call answers. Every delivered call must be exactly one of the engine's
replies, ids and log-probs, in one chain. The front end runs on the compose file's config
with greedy sampling pinned, so the log-probs are the model's own values (``log_probs``).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import claude_cli, netns, redis_socket, worker, worker_delivery
from tests.e2e.test_claude_code_e2e import FRONTEND_CONFIG, rebuild, run_driver, session_events
from tests.real_engines.conftest import (
    SGLANG_MODULE,
    VLLM_MODULE,
    build_model,
    ensure_sglang,
    ensure_vllm,
    sglang_args,
    sglang_env,
    vllm_args,
    vllm_env,
)
from tests.real_engines.log_probs import assert_log_probs_vary
from tests.real_engines.test_engines import PINNED
from tests.support.claude_code import transcript_to_record

__all__ = ["claude_cli", "netns", "redis_socket", "worker", "worker_delivery"]
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
# The CLI's requests carry tens of thousands of tokens of tools and instructions.
CONTEXT = 40960


def token_items(result: dict[str, Any]) -> list[dict[str, Any]]:
    output = result["response"]["output"]
    return [i for i in output if isinstance(i, dict) and i.get("generation_token_ids")]


def greedy_config(folder: Path) -> Path:
    """The compose file's front-end config with the tier's greedy sampling pinned."""
    config = yaml.safe_load(FRONTEND_CONFIG.read_text())
    config["model_server"]["sampling_overrides"] = PINNED
    path = folder / "tokcap.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def engine_process(family: str) -> dict[str, Any]:
    """How the driver starts the engine: its interpreter, module, flags and environment."""
    if family == "vllm":
        python = ensure_vllm()
        args = vllm_args(build_model(python), max_model_len=CONTEXT)
        return {"python": str(python), "module": VLLM_MODULE, "args": args, "env": vllm_env()}
    python = ensure_sglang()
    args = sglang_args(build_model(python), context_length=CONTEXT)
    return {"python": str(python), "module": SGLANG_MODULE, "args": args, "env": sglang_env()}


@pytest.mark.parametrize("family", ["vllm", "sglang"])
def test_the_claude_code_cli_is_captured_as_the_engine_sampled_it(
    claude_cli: Path,
    netns: None,
    redis_socket: str,
    worker: Any,
    family: str,
    tmp_path: Path,
) -> None:
    rollout_id = f"cc-{family}-{uuid.uuid4().hex[:8]}"
    spec = {
        "cli": str(claude_cli),
        "workdir": str(tmp_path),
        "rollout_id": rollout_id,
        "prompt": "List the files here.",
        "model": "claude-sonnet-4-5",
        "nonessential_traffic": False,
        "real_engine": {"family": family, **engine_process(family)},
        "frontend_config": str(greedy_config(tmp_path)),
        "frontend_env": {"TOKCAP_REDIS_URL": redis_socket, "TOKCAP_MODEL": "tiny-qwen3"},
        "claude_timeout": 400.0,
        "env_extra": {"API_TIMEOUT_MS": "600000"},
    }
    summary = run_driver(spec, tmp_path, timeout=900.0)
    events, result_event = session_events(summary)
    assert "The directory holds a.txt." in result_event["result"]
    uses = [
        block
        for e in events
        if e.get("type") == "assistant"
        for block in e["message"]["content"]
        if block.get("type") == "tool_use"
    ]
    assert [use["name"] for use in uses] == ["Bash"], "the hermes parser made the call"
    sampled = summary["ground_truth"]
    record = transcript_to_record(events, rollout_id, reward=1.0)
    result = asyncio.run(rebuild(redis_socket, record))
    capture = result["_ng_token_capture"]
    assert result.get("mask_sample") is False, capture
    assert capture["delivered_fraction"] == 1.0 and capture["chains"] == 1, capture
    items = token_items(result)
    assert len(items) == len(sampled) == 2, (len(items), len(sampled))
    for item in items:
        matches = [
            s
            for s in sampled
            if s["prompt_token_ids"] == item["prompt_token_ids"]
            and s["token_ids"] == item["generation_token_ids"]
            and s["logprobs"] == item["generation_log_probs"]
        ]
        assert len(matches) == 1, "a delivered call is exactly one of the engine's replies"
        assert_log_probs_vary(item["generation_log_probs"], "a delivered call")
