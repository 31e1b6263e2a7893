"""The real Claude Code CLI, end to end: capture, rebuild job, rebuilt record.

The CLI runs in a loopback-only network namespace against the front end (configured by
``deploy/tokcap.yaml``, the sink ``transports.redis:RedisTokenSink``) and the tokcap engine
with a scripted policy: a Bash tool call, then a final answer. Redis runs on the host and
is reached over its unix socket. The collector side then turns the CLI's stream-json
transcript into a finished rollout record, submits it with ``RebuildQueue``, and a real
``tokcap worker`` process rebuilds it; the test reads the result from the results stream.
The fixtures (CLI, namespace, Redis, worker) live in ``conftest.py``.

Skips only when npm cannot install the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.claude_code import (
    final_answer,
    netns_command,
    transcript_to_record,
)

ROOT = Path(__file__).resolve().parents[2]
FRONTEND_CONFIG = ROOT / "deploy" / "tokcap.yaml"
PROMPT = "run echo hello"
FINAL_TEXT = "The command printed: hello"
TITLE_TEXT = '{"title": "Run echo hello"}'
DRIVER_TIMEOUT_S = 240.0
RESULT_TIMEOUT_S = 60.0

# Turn 0: a Bash call; turn 1: the answer. The title call (no tools, a <session> block and
# "Write the title" in its one user message) is matched first, so it never takes turn 0.
# Both agent turns think first, as the CLI asks for: the thinking block must come back in
# the next request's history in a form the engine re-renders to the very same ids.
SCRIPT = {
    "entries": [
        {"match": r"Write the title|<session>", "text": TITLE_TEXT},
        {
            "turn": 0,
            "think": "The user wants a shell command run; Bash does that.",
            "text": "I'll run it.",
            "tool_calls": [
                {
                    "name": "Bash",
                    "arguments": {"command": "echo hello", "description": "Print hello"},
                }
            ],
        },
        {"turn": 1, "think": "It printed hello.", "text": FINAL_TEXT},
    ],
    "default": {"text": "Done."},
}

pytestmark = pytest.mark.timeout(600)


def run_driver(
    spec: dict[str, Any], workdir: Path, timeout: float = DRIVER_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``tests.support.claude_code_driver`` in a new network namespace; its summary."""
    spec_path = workdir / "spec.json"
    spec["summary"] = str(workdir / "summary.json")
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen(
        netns_command([sys.executable, "-m", "tests.support.claude_code_driver", str(spec_path)]),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's group: engine, front end, CLI
        output, _ = proc.communicate()
        pytest.fail(f"the driver did not finish within {timeout}s:\n{output[-3000:]}")
    summary_path = Path(spec["summary"])
    assert summary_path.exists(), f"driver exited {proc.returncode} without a summary:\n{output}"
    return json.loads(summary_path.read_text())


def describe(summary: dict[str, Any]) -> str:
    """What to read when a run failed: the error, the CLI's stderr, the servers' logs."""
    parts = [f"error: {summary.get('error')}"]
    claude = summary.get("claude") or {}
    parts.append(
        f"claude exit {claude.get('returncode')}, stderr: {claude.get('stderr', '')[-1500:]}"
    )
    parts.append(
        f"claude result: {json.dumps(next((e for e in claude.get('events', []) if e.get('type') == 'result'), None))[:1500]}"
    )
    for name, server in (summary.get("servers") or {}).items():
        parts.append(f"--- {name} (exit {server['returncode']}) ---\n{server['log_tail'][-2500:]}")
    return "\n".join(parts)


def session_events(summary: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The CLI's events and its result event, once the session ran and ended without error."""
    assert "error" not in summary, describe(summary)
    claude = summary["claude"]
    assert claude["returncode"] == 0 and not claude["timed_out"], describe(summary)
    events = claude["events"]
    result_event = next(e for e in events if e.get("type") == "result")
    assert result_event["is_error"] is False, describe(summary)
    return events, result_event


async def rebuild(redis_url: str, record: dict[str, Any]) -> dict[str, Any]:
    """Submit the record as a job and wait for its rebuilt record on the results stream."""
    from transports.rebuild.jobs import RebuildQueue
    from transports.rebuild.reader import ResultsReader

    async with RebuildQueue(url=redis_url) as queue:
        await queue.submit(record)
    group = f"test-{uuid.uuid4().hex[:8]}"  # a group of its own reads the stream from the start
    async with ResultsReader(url=redis_url, group=group, block_ms=200) as reader:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while time.monotonic() < deadline:
            for result in await reader.read():
                await reader.ack(result)
                if result.get("_ng_rollout_id") == record["_ng_rollout_id"]:
                    return result
    raise AssertionError(f"no result for {record['_ng_rollout_id']} within {RESULT_TIMEOUT_S}s")


async def wait_retired(redis_url: str, rollout_id: str) -> dict[str, Any]:
    """What the store holds once the worker retired the snapshot (it does so after publishing)."""
    from transports.redis import RedisTokenStore

    store = RedisTokenStore(url=redis_url)
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while True:
            state = await store.inspect(rollout_id)
            if state["state"] == "retired" or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.1)
    finally:
        await store.close()


def run_rollout(
    cli: Path,
    redis_url: str,
    workdir: Path,
    *,
    nonessential_traffic: bool,
    wire: str = "vllm",
    model: str = "claude-sonnet-4-5",
    script: dict[str, Any] = SCRIPT,
    engine_args: tuple[str, ...] = (),
    frontend_env: dict[str, str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One CLI rollout through capture and rebuild: (summary, submitted record, result)."""
    rollout_id = f"cc-{uuid.uuid4().hex[:10]}"
    script_path = workdir / "script.yaml"
    script_path.write_text(yaml.safe_dump(script))
    spec = {
        "cli": str(cli),
        "workdir": str(workdir),
        "rollout_id": rollout_id,
        "prompt": PROMPT,
        "model": model,
        "nonessential_traffic": nonessential_traffic,
        "engine_args": [
            "--policy",
            "scripted",
            "--script",
            str(script_path),
            "--seed",
            "7",
            "--ground-truth",
            str(workdir / "ground_truth.jsonl"),
            "--wire",
            wire,
            *engine_args,
        ],
        "frontend_config": str(FRONTEND_CONFIG),
        "frontend_env": {"TOKCAP_REDIS_URL": redis_url, **(frontend_env or {})},
        "claude_timeout": 120.0,
        "env_extra": env_extra or {},
    }
    summary = run_driver(spec, workdir)
    events, _ = session_events(summary)
    assert final_answer(events) == FINAL_TEXT
    # The transcript went through the tool: the Bash call ran and printed hello.
    tool_results = [
        block
        for e in events
        if e.get("type") == "user"
        for block in e["message"]["content"]
        if block.get("type") == "tool_result"
    ]
    assert tool_results and "hello" in json.dumps(tool_results[0]["content"])

    record = transcript_to_record(events, rollout_id, reward=1.0)
    result = asyncio.run(rebuild(redis_url, record))
    # A good build is retired after its result is durable; the tombstone stays for late writers.
    stored = asyncio.run(wait_retired(redis_url, rollout_id))
    assert stored["state"] == "retired" and stored["tombstone"], stored
    return summary, record, result


def token_items(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        item
        for item in result["response"]["output"]
        if isinstance(item, dict) and item.get("generation_token_ids") is not None
    ]


def sampled(summary: dict[str, Any]) -> list[dict[str, Any]]:
    truth = summary["ground_truth"]
    records = truth.get("records", truth) if isinstance(truth, dict) else truth
    assert isinstance(records, list), f"unexpected ground truth: {str(truth)[:500]}"
    return records


def assert_delivers_agent_loop(result: dict[str, Any], agent_calls: list[dict[str, Any]]) -> None:
    """The delivered items are exactly the agent loop's sampled sequences, in order."""
    items = token_items(result)
    assert [item["generation_token_ids"] for item in items] == [
        call["token_ids"] for call in agent_calls
    ]
    # Prompts are the running sequence: each call's prompt as the engine saw it.
    assert [item["prompt_token_ids"] for item in items] == [
        call["prompt_token_ids"] for call in agent_calls
    ]
    for item, call in zip(items, agent_calls, strict=True):
        assert item["generation_log_probs"] == pytest.approx(call["logprobs"])


@pytest.mark.parametrize(
    "wire, model",
    [("vllm", "claude-sonnet-4-5"), ("sglang", "claude-sonnet-4-5"), ("sglang", "qwen3-8b")],
)
def test_claude_code_rollout_is_rebuilt_from_sampled_ids(
    claude_cli: Path,
    netns: None,
    redis_socket: str,
    worker: subprocess.Popen,
    tmp_path: Path,
    wire: str,
    model: str,
) -> None:
    """The same rollout whichever wire the engine speaks (the front end finds it: auto).

    With a model name the CLI does not know (any policy's), it sends ``role: "system"``
    messages mid-conversation; they are translated, never refused.
    """
    summary, record, result = run_rollout(
        claude_cli, redis_socket, tmp_path, nonessential_traffic=False, wire=wire, model=model
    )
    truth = sampled(summary)
    assert len(truth) == 2, "the agent loop is two calls: the Bash call, then the answer"
    assert truth[0]["tool_calls"][0]["function"]["name"] == "Bash"

    metrics = result["_ng_token_capture"]
    assert result.get("mask_sample") is False, metrics
    assert metrics["error"] is None
    assert metrics["chains"] == 1 and metrics["roots"] == 1
    assert metrics["n_calls"] >= 2
    assert metrics["delivered_fraction"] == 1.0
    assert metrics["capture_incomplete"] is False
    assert_delivers_agent_loop(result, truth)
    # Everything else in the record is the collector's, untouched.
    assert result["_ng_rollout_id"] == record["_ng_rollout_id"]
    assert result["reward"] == 1.0
    assert result["harness"]["num_turns"] == record["harness"]["num_turns"]


def test_title_call_is_an_extra_root(
    claude_cli: Path, netns: None, redis_socket: str, worker: subprocess.Popen, tmp_path: Path
) -> None:
    summary, _record, result = run_rollout(
        claude_cli, redis_socket, tmp_path, nonessential_traffic=True
    )
    truth = sampled(summary)
    titles = [call for call in truth if call["content"] == TITLE_TEXT]
    agent_calls = [call for call in truth if call["content"] != TITLE_TEXT]
    assert len(titles) == 1, (
        "without CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC the CLI asks for a title"
    )
    assert len(agent_calls) == 2

    metrics = result["_ng_token_capture"]
    assert result.get("mask_sample") is False, metrics
    assert metrics["n_calls"] == 3
    assert metrics["roots"] >= 2 and metrics["chains"] >= 2
    assert 0 < metrics["delivered_fraction"] < 1
    # The main chain is still the agent loop: the title's tokens are reported, not delivered.
    assert_delivers_agent_loop(result, agent_calls)


# Seven Bash calls, each after thinking, then the answer: the CLI's agent loop on Qwen3.
LONG_SCRIPT = {
    "entries": [
        SCRIPT["entries"][0],
        *(
            {
                "turn": turn,
                "think": f"Step {turn}: the next command shows more; Bash runs it.",
                "text": "" if turn % 2 else f"Running step {turn}.",
                "tool_calls": [
                    {
                        "name": "Bash",
                        "arguments": {
                            "command": "echo hello" if turn == 0 else f"echo step {turn}",
                            "description": f"Print step {turn}",
                        },
                    }
                ],
            }
            for turn in range(7)
        ),
        {"turn": 7, "think": "Every step printed.", "text": FINAL_TEXT},
    ],
    "default": {"text": "Done."},
}
# Qwen3's vocabulary and template, drifting as real serving does.
QWEN3_ENGINE = ("--tokenizer", "qwen3", "--noncanonical-rate", "0.05", "--json-reserialize")
FAITHFUL_ENV = {"TOKCAP_PROMPTS": "faithful", "TOKCAP_RENDERER_TOKENIZER": "qwen3"}


@pytest.mark.parametrize("prompts", ["faithful", "text"])
def test_claude_code_on_qwen3_is_one_chain_with_faithful_prompts(
    claude_cli: Path,
    netns: None,
    redis_socket: str,
    worker: subprocess.Popen,
    tmp_path: Path,
    prompts: str,
) -> None:
    """Seven tool calls with thinking on the Qwen3 engine: faithful prompts keep the CLI's
    rollout one chain with every sampled token; text prompts split it, and say so."""
    summary, _record, result = run_rollout(
        claude_cli,
        redis_socket,
        tmp_path,
        nonessential_traffic=False,
        script=LONG_SCRIPT,
        engine_args=QWEN3_ENGINE,
        frontend_env=FAITHFUL_ENV if prompts == "faithful" else {},
    )
    truth = sampled(summary)
    assert len(truth) == 8, "seven Bash calls, then the answer"
    # (A token-in call's sampled text is not parsed by the engine: look for the markers.)
    assert sum(bool(call["tool_calls"]) or "<tool_call>" in call["text"] for call in truth) == 7
    assert all(call["reasoning"] for call in truth)
    metrics = result["_ng_token_capture"]
    assert metrics["n_calls"] == 8 and metrics["error"] is None, metrics
    if prompts == "faithful":
        assert result.get("mask_sample") is False, metrics
        assert metrics["chains"] == 1 and metrics["roots"] == 1, metrics
        assert metrics["delivered_fraction"] == 1.0
        assert metrics["faithful_fallbacks"] == {}
        assert_delivers_agent_loop(result, truth)
    else:
        # The template re-renders history other than sampled: reported, never delivered wrong.
        assert metrics["chains"] > 1 and metrics["delivered_fraction"] < 1.0, metrics
        if not result.get("mask_sample"):
            delivered = [item["generation_token_ids"] for item in token_items(result)]
            assert delivered == [call["token_ids"] for call in truth[-len(delivered) :]]


def test_a_call_slower_than_the_clis_timeouts_completes_without_a_resend(
    claude_cli: Path, netns: None, redis_socket: str, worker: subprocess.Popen, tmp_path: Path
) -> None:
    """Each call takes 14 s at the engine; the CLI gives up on a response not begun within
    8 s (API_TIMEOUT_MS) and on a stream silent for 10 s (its byte idle watchdog's floor).
    The front end opens the stream after 2 s and pings every 2 s: the session completes,
    each call sampled once (no resend), delivered exactly."""
    summary, _record, result = run_rollout(
        claude_cli,
        redis_socket,
        tmp_path,
        nonessential_traffic=False,
        engine_args=("--first-token-s", "14"),
        frontend_env={"TOKCAP_KEEPALIVE_S": "2"},
        env_extra={"API_TIMEOUT_MS": "8000", "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000"},
    )
    truth = sampled(summary)
    assert len(truth) == 2, "each of the loop's two calls sampled once: nothing was resent"
    assert result.get("mask_sample") is False, result["_ng_token_capture"]
    assert result["_ng_token_capture"]["delivered_fraction"] == 1.0
    assert_delivers_agent_loop(result, truth)
