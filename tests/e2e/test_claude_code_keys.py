"""Keys with the real Claude Code CLI (issue 14): the rollout token as ANTHROPIC_API_KEY.

The front end runs as ``tokcap serve`` with ``deploy/tokcap.yaml`` and an auth secret from
``TOKCAP_AUTH_SECRET``; the collector hands the CLI its rollout's token the way a Gym agent
would, as ``ANTHROPIC_API_KEY``. With its own token the rollout is captured and rebuilt as
without keys; with another rollout's token the CLI is refused (401, Anthropic's
``authentication_error``) and nothing is captured. No key shows in the servers' logs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from capture import rollout_token
from tests.e2e.test_claude_code_e2e import (
    FINAL_TEXT,
    FRONTEND_CONFIG,
    PROMPT,
    SCRIPT,
    assert_delivers_agent_loop,
    describe,
    rebuild,
    run_driver,
    sampled,
)
from tests.support.claude_code import final_answer, transcript_to_record
from transports.redis import RedisTokenStore

SECRET = "e2e-auth-secret-" + uuid.uuid4().hex

pytestmark = pytest.mark.timeout(600)


def drive(cli: Path, redis_url: str, workdir: Path, rollout_id: str, key: str) -> dict[str, Any]:
    """One CLI run on ``rollout_id``'s captured path with ``key`` as ANTHROPIC_API_KEY."""
    script_path = workdir / "script.yaml"
    script_path.write_text(yaml.safe_dump(SCRIPT))
    spec = {
        "cli": str(cli),
        "workdir": str(workdir),
        "rollout_id": rollout_id,
        "prompt": PROMPT,
        "model": "claude-sonnet-4-5",
        "nonessential_traffic": False,
        "engine_args": [
            "--policy",
            "scripted",
            "--script",
            str(script_path),
            "--seed",
            "7",
            "--ground-truth",
            str(workdir / "ground_truth.jsonl"),
        ],
        "frontend_config": str(FRONTEND_CONFIG),
        "frontend_env": {"TOKCAP_REDIS_URL": redis_url, "TOKCAP_AUTH_SECRET": SECRET},
        "claude_timeout": 120.0,
        "env_extra": {"ANTHROPIC_API_KEY": key},
    }
    summary = run_driver(spec, workdir)
    assert "error" not in summary, describe(summary)
    return summary


def stored_calls(redis_url: str, rollout_id: str) -> int:
    async def peek() -> int:
        store = RedisTokenStore(url=redis_url)
        try:
            return len(await store.peek(rollout_id))
        finally:
            await store.close()

    return asyncio.run(peek())


def assert_no_key_in_logs(summary: dict[str, Any], *keys: str) -> None:
    logs = json.dumps(summary["servers"])
    for key in keys:
        assert key not in logs, "a key was written to a server's log"


def test_claude_code_with_its_rollout_token_is_captured_and_rebuilt(
    claude_cli: Path, netns: None, redis_socket: str, worker: subprocess.Popen, tmp_path: Path
) -> None:
    rollout_id = f"cc-key-{uuid.uuid4().hex[:8]}"
    token = rollout_token(SECRET, rollout_id)
    summary = drive(claude_cli, redis_socket, tmp_path, rollout_id, token)
    claude = summary["claude"]
    assert claude["returncode"] == 0 and not claude["timed_out"], describe(summary)
    assert final_answer(claude["events"]) == FINAL_TEXT, describe(summary)
    assert_no_key_in_logs(summary, SECRET, token)

    record = transcript_to_record(claude["events"], rollout_id, reward=1.0)
    result = asyncio.run(rebuild(redis_socket, record))
    metrics = result["_ng_token_capture"]
    assert result.get("mask_sample") is False, metrics
    assert metrics["delivered_fraction"] == 1.0 and metrics["capture_incomplete"] is False
    assert_delivers_agent_loop(result, sampled(summary))


def test_claude_code_with_another_rollouts_token_is_refused(
    claude_cli: Path, netns: None, redis_socket: str, tmp_path: Path
) -> None:
    rollout_id = f"cc-key-{uuid.uuid4().hex[:8]}"
    foreign = rollout_token(SECRET, rollout_id + "-other")
    summary = drive(claude_cli, redis_socket, tmp_path, rollout_id, foreign)
    claude = summary["claude"]
    result = next((e for e in claude["events"] if e.get("type") == "result"), None)
    refused = claude["returncode"] != 0 or (result is not None and result.get("is_error"))
    assert refused, describe(summary)
    assert final_answer(claude["events"]) != FINAL_TEXT
    shown = json.dumps(claude["events"]) + claude["stderr"]
    assert "401" in shown or "authentication" in shown.lower() or "api key" in shown.lower(), (
        describe(summary)
    )
    assert sampled(summary) == [], "the engine was never called"
    assert stored_calls(redis_socket, rollout_id) == 0
    assert_no_key_in_logs(summary, SECRET, foreign)
