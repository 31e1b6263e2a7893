"""End to end on the file store, no server: config -> capture -> finalize -> retire.

A three-turn tool-using rollout is captured the way the model server captures it (one
capture context per call, Responses-shaped served responses), then rebuilt into one
contiguous, token-bearing output, handed off durably, and retired; the tombstone then
refuses a late writer, also through a freshly built sink.
"""

from __future__ import annotations

import json
import os

import pytest

from capture import (
    FileTokenStore,
    MaskFractionGuard,
    capture_base_url,
    finalize_rollout_token_capture,
    retire_rollout_token_capture,
    rollout_id_from_run_body,
)
from capture.build.projection import flat_ids_and_mask
from capture.codec.views import json_default
from capture.config import agent_opted_in, load_capture_config
from capture.context import begin_call, capture_call, capture_tokens
from capture.delivery import MaskFractionExceeded
from capture.errors import RolloutFrozenError
from capture.rollout_ids import split_capture_path
from tests.support.contiguity import contiguity_errors

SERVER = "http://127.0.0.1:8000"
SYSTEM_AND_USER = list(range(1, 51))
TOOL_OUTPUTS = [list(range(200, 220)), list(range(220, 230))]
# What each turn samples, and the Responses item it is served as.
TURNS = [
    (
        list(range(100, 110)),
        {
            "type": "function_call",
            "call_id": "fc_1",
            "name": "bash",
            "arguments": '{"command": "ls"}',
        },
    ),
    (
        list(range(110, 120)),
        {
            "type": "function_call",
            "call_id": "fc_2",
            "name": "bash",
            "arguments": '{"command": "cat notes.txt"}',
        },
    ),
    (
        list(range(120, 128)),
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "All done."}],
        },
    ),
]


def write_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKCAP_FLOW_DIR", str(tmp_path / "captures"))
    path = tmp_path / "gym.yaml"
    path.write_text(
        """
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: ${oc.env:TOKCAP_FLOW_DIR}
      max_mask_fraction: 0.5
responses_api_agents:
  claude_code_agent:
    token_id_capture: true
"""
    )
    return path


def served_turns():
    """(served response, prompt, generation) per turn; each prompt extends the last."""
    prompt = list(SYSTEM_AND_USER)
    turns = []
    for index, (generation, item) in enumerate(TURNS):
        response = {
            "id": f"resp_{index}",
            "model": "policy",
            "output": [
                {"type": "reasoning", "summary": []},
                {
                    **item,
                    "prompt_token_ids": list(prompt),
                    "generation_token_ids": generation,
                    "generation_log_probs": [-0.01 * (t % 7) for t in generation],
                },
            ],
        }
        turns.append((response, list(prompt), generation))
        prompt = prompt + generation + (TOOL_OUTPUTS[index] if index < len(TOOL_OUTPUTS) else [])
    return turns


def harness_record(body):
    """The text transcript the harness hands back, without any token ids."""
    return {
        **body,
        "response": {
            "id": "resp_harness",
            "output": [
                {
                    "type": "function_call",
                    "call_id": "fc_1",
                    "name": "bash",
                    "arguments": '{"command":"ls"}',
                },
                {"type": "function_call_output", "call_id": "fc_1", "output": "notes.txt"},
                {
                    "type": "function_call",
                    "call_id": "fc_2",
                    "name": "bash",
                    "arguments": '{"command":"cat notes.txt"}',
                },
                {"type": "function_call_output", "call_id": "fc_2", "output": "hello"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "All done."}],
                },
            ],
        },
    }


async def capture_rollout(sink, rollout_id, turns):
    """Serve each turn the way the server does: route, intent, capture."""
    path = capture_base_url(SERVER, rollout_id).removeprefix(SERVER) + "/v1/responses"
    routed_id, captured, api_path = split_capture_path(path)
    assert (routed_id, captured, api_path) == (rollout_id, True, "/v1/responses")
    for response, _, _ in turns:
        async with capture_call(routed_id, sink) as call:
            await begin_call()
            assert await capture_tokens(response) is not None
            assert call.entry is not None and not call.incomplete


def hand_off(tmp_path, record):
    """The durable handoff between finalize and retire: an fsynced JSON line (the token
    arrays are views of the chain's sequence, written as lists by ``json_default``)."""
    with open(tmp_path / "results.jsonl", "a") as results:
        results.write(json.dumps(record, default=json_default) + "\n")
        results.flush()
        os.fsync(results.fileno())


async def test_three_turn_rollout_from_config_to_tombstone(tmp_path, monkeypatch):
    config_path = write_config(tmp_path, monkeypatch)
    config = load_capture_config(config_path)
    assert agent_opted_in(config_path, "claude_code_agent")
    assert not agent_opted_in(config_path, "other_agent")
    sink = config.build_sink()
    assert isinstance(sink, FileTokenStore)
    assert sink.dir == (tmp_path / "captures").resolve()

    body = {"_ng_task_index": 5, "_ng_rollout_index": 2}
    rollout_id = rollout_id_from_run_body(body)
    assert rollout_id == "5-2"
    turns = served_turns()
    await capture_rollout(sink, rollout_id, turns)
    info = await sink.inspect(rollout_id)
    assert (info["state"], info["calls"], info["pending_intents"]) == ("open", 3, 0)

    record = harness_record(body)
    built = await finalize_rollout_token_capture(record, sink)
    assert built.ok and not built.masked and built.error is None
    assert record["mask_sample"] is False
    metrics = record["_ng_token_capture"]
    assert metrics["n_calls"] == 3 and metrics["chains"] == 1 and metrics["roots"] == 1
    assert metrics["capture_incomplete"] is False
    assert metrics["delivered_fraction"] == 1.0
    assert metrics["generated_tokens_delivered"] == 28 == metrics["generated_tokens_captured"]

    output = record["response"]["output"]
    assert contiguity_errors(output) == []
    carriers = [item for item in output if "generation_token_ids" in item]
    assert [item["type"] for item in carriers] == ["function_call", "function_call", "message"]
    for item, (_, prompt, generation) in zip(carriers, turns, strict=True):
        assert item["prompt_token_ids"] == prompt
        assert item["generation_token_ids"] == generation
    assert [item["name"] for item in carriers[:2]] == ["bash", "bash"]
    assert carriers[2]["content"][0]["text"] == "All done."
    ids, mask = flat_ids_and_mask(output)
    final_prompt, final_generation = turns[-1][1], turns[-1][2]
    assert ids == final_prompt + final_generation
    generated = {t for _, _, generation in turns for t in generation}
    assert mask == [1 if t in generated else 0 for t in ids]
    assert sum(mask) == 28

    guard = MaskFractionGuard(config.max_mask_fraction, min_samples=1)
    guard.observe_record(record)
    assert guard.fraction == 0.0

    hand_off(tmp_path, record)
    assert await retire_rollout_token_capture(rollout_id, sink, built) is True
    info = await sink.inspect(rollout_id)
    assert info["state"] == "retired" and info["tombstone"] is True

    late_response = turns[-1][0]
    async with capture_call(rollout_id, sink) as late:
        assert await capture_tokens(late_response) is None
    assert late.incomplete and "RolloutFrozenError" in late.error
    reopened = config.build_sink()
    with pytest.raises(RolloutFrozenError):
        await reopened.put(
            {
                "rollout_id": rollout_id,
                "model_call_id": "late",
                "prompt_token_ids": [1],
                "generation_token_ids": [2],
                "generation_log_probs": [-0.1],
            }
        )
    with pytest.raises(RolloutFrozenError):
        await reopened.begin_call(rollout_id, "late-2")
    await reopened.close()
    await sink.close()
    saved = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    assert saved["mask_sample"] is False and len(saved["response"]["output"]) == len(output)


async def test_lost_call_masks_and_is_never_retired(tmp_path, monkeypatch):
    sink = load_capture_config(write_config(tmp_path, monkeypatch)).build_sink()
    body = {"_ng_rollout_id": "lost-call-1"}
    turns = served_turns()
    await capture_rollout(sink, "lost-call-1", turns[:2])
    async with capture_call("lost-call-1", sink):
        await begin_call()  # dispatched, then the server died before the reply
    record = harness_record(body)
    original_output = json.loads(json.dumps(record["response"]["output"], default=json_default))
    built = await finalize_rollout_token_capture(record, sink)
    assert built.masked and not built.ok
    assert record["mask_sample"] is True
    assert record["_ng_token_capture"]["capture_incomplete"] is True
    assert record["response"]["output"] == original_output
    assert await retire_rollout_token_capture("lost-call-1", sink, built) is False
    assert (await sink.inspect("lost-call-1"))["state"] == "frozen"
    guard = MaskFractionGuard(0.5, min_samples=2)
    guard.observe(False)
    guard.observe_record(record)  # 1 of 2 masked: at the limit, not above it
    with pytest.raises(MaskFractionExceeded, match="above max_mask_fraction"):
        guard.observe_record(record)  # 2 of 3
    await sink.close()
