"""Both engine families end to end: the tokcap engine speaking vLLM's or SGLang's wire format.

Through the front end, a streamed Anthropic-SDK tool loop is captured exactly (entries equal
the engine's ground truth, one chain) whichever wire the engine speaks, with the family found
by ``engine: auto``. The client's upstream details (a ``/v1`` base URL, the Bearer key, the
``max_tokens`` clamp, token-in calls) and the start-up probe's refusals run against real
servers too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from api.engine.client import UpstreamClient
from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from capture.config import TokenIdCaptureConfig
from tests.support.corrupting_proxy import corrupting_proxy
from tests.support.fault_loops import Rollout, Tally, harness_client, run_loops, write_script
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    engine_server,
    finalize,
    freeze,
    front_end,
)

WIRES = ["vllm", "sglang"]
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def script(tmp_path: Path) -> str:
    return write_script(tmp_path / "script.yaml")


def capture_settings(upstream: str, store_dir: Path, **server: Any) -> ServerSettings:
    capture = TokenIdCaptureConfig(enabled=True, dir=str(store_dir))
    return ServerSettings(upstream=upstream, capture=capture, **server)


def final_output(rollout: Rollout) -> list[dict[str, Any]]:
    text = "".join(b.text for b in rollout.answered[-1].content if b.type == "text")
    return [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    ]


@pytest.mark.parametrize("wire", WIRES)
def test_a_streamed_tool_loop_is_captured_exactly_on_either_wire(
    wire: str, script: str, tmp_path: Path
) -> None:
    store = tmp_path / "captures"
    with engine_server(wire=wire, script_path=script) as engine:
        with front_end(capture_settings(engine, store, sampling_overrides=PINNED)) as front:
            rollout = Rollout(f"wire-{wire}", 4)

            async def drive() -> None:
                async with harness_client(Tally()) as http:
                    await run_loops(front, [rollout], http)

            asyncio.run(drive())
            truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert rollout.error is None and len(rollout.answered) == 4
    snapshot = freeze(store, rollout.rollout_id)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)
    record, build = finalize(store, rollout.rollout_id, final_output(rollout))
    assert_one_contiguous_chain(build, record, 4)


async def ask(url: str, **client: Any) -> tuple[UpstreamClient, Any]:
    upstream = UpstreamClient(url, **client)
    try:
        generation = await upstream.chat({"messages": HELLO, "max_tokens": 30})
    finally:
        await upstream.close()
    return upstream, generation


@pytest.mark.parametrize("wire", WIRES)
async def test_auto_names_the_family_and_a_v1_base_url_works(wire: str) -> None:
    with engine_server(wire=wire, max_model_len=8192) as engine:
        upstream, generation = await ask(engine + "/v1/")
    assert upstream.engine == wire and upstream.max_model_len == 8192
    assert generation.ids_problem is None and generation.generation_token_ids


@pytest.mark.parametrize("wire", WIRES)
async def test_max_tokens_is_lowered_to_the_room_the_context_leaves(wire: str) -> None:
    with engine_server(wire=wire, max_model_len=2048) as engine:
        # Beyond the window alone: lowered before sending. Beside the prompt: after a refusal.
        for asked in (32000, 2047):
            upstream = UpstreamClient(engine)
            try:
                generation = await upstream.chat({"messages": HELLO, "max_tokens": asked})
            finally:
                await upstream.close()
            assert generation.ids_problem is None
            sent = generation.max_tokens_clamp[1]
            assert generation.max_tokens_clamp[0] == asked
            assert sent + generation.prompt_tokens <= 2048 and sent < asked


@pytest.mark.parametrize("wire", WIRES)
async def test_the_bearer_key_reaches_the_engine_and_never_the_messages(wire: str) -> None:
    with engine_server(wire=wire, api_key="sekrit-key") as engine:
        _, generation = await ask(engine, api_key="sekrit-key")
        assert generation.ids_problem is None
        with pytest.raises(EngineRefused, match="upstream_api_key") as refused:
            await probe(ServerSettings(upstream=engine, engine=wire, sampling_overrides=PINNED))
    assert "sekrit" not in str(refused.value)


@pytest.mark.parametrize("wire", WIRES)
async def test_a_token_in_call_continues_exactly_the_ids_sent(wire: str) -> None:
    with engine_server(wire=wire) as engine:
        upstream = UpstreamClient(engine)
        try:
            first = await upstream.chat({"messages": HELLO, "max_tokens": 30})
            prompt = first.prompt_token_ids + first.generation_token_ids
            generation = await upstream.complete_ids(prompt, {"max_tokens": 12, **PINNED})
        finally:
            await upstream.close()
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert generation.ids_problem is None and generation.prompt_token_ids == prompt
    sampled = [t for t in truth if t["prompt_token_ids"] == prompt]
    assert len(sampled) == 1
    assert sampled[0]["token_ids"] == generation.generation_token_ids
    assert sampled[0]["logprobs"] == generation.generation_log_probs


# -- the start-up probe ---------------------------------------------------------------------


@pytest.mark.parametrize("wire", WIRES)
async def test_the_probe_accepts_a_faithful_engine_and_warns_about_unpinned_keys(wire: str):
    with engine_server(wire=wire) as engine:
        pinned = await probe(ServerSettings(upstream=engine, sampling_overrides=PINNED))
        loose = await probe(ServerSettings(upstream=engine, sampling_overrides={"top_p": 1.0}))
    assert pinned.family == wire and pinned.warnings == []
    assert "temperature, top_k, min_p, repetition_penalty" in loose.warnings[0]


async def test_the_probe_refuses_raw_log_probs_at_another_temperature() -> None:
    cooler = {**PINNED, "temperature": 0.7}
    with engine_server(logprobs_mode="raw_logprobs") as engine:
        with pytest.raises(EngineRefused, match="--logprobs-mode processed_logprobs"):
            await probe(ServerSettings(upstream=engine, sampling_overrides=cooler))
        assert (await probe(ServerSettings(upstream=engine, sampling_overrides=PINNED))).family
    with engine_server(logprobs_mode="processed_logprobs") as engine:
        assert (await probe(ServerSettings(upstream=engine, sampling_overrides=cooler))).family


@pytest.mark.parametrize(
    "mode, expected",
    [("no_token_ids", "vLLM >= 0.10.2"), ("no_logprobs", "--max-logprobs")],
)
async def test_the_probe_refuses_an_engine_without_ids_or_log_probs(mode: str, expected: str):
    with engine_server() as engine, corrupting_proxy(engine, mode) as proxy:
        with pytest.raises(EngineRefused, match=expected):
            await probe(ServerSettings(upstream=proxy.url, sampling_overrides=PINNED))


async def test_an_engine_not_up_yet_is_not_refused() -> None:
    report = await probe(ServerSettings(upstream="http://127.0.0.1:9", sampling_overrides=PINNED))
    assert "probe skipped" in report.warnings[0] and "unreachable" in report.warnings[0]


@pytest.mark.parametrize("wire", WIRES)
async def test_a_token_in_call_without_max_tokens_may_fill_the_context(wire: str, tmp_path) -> None:
    """As a chat call without max_tokens would; not the route's default (SGLang: 128)."""
    script = tmp_path / "script.yaml"
    script.write_text(yaml.safe_dump({"default": {"text": " ".join(["word"] * 300)}}))
    with engine_server(wire=wire, script_path=str(script), max_model_len=4096) as engine:
        upstream = UpstreamClient(engine)
        try:
            first = await upstream.chat({"messages": HELLO, "max_tokens": 5})
            generation = await upstream.complete_ids(first.prompt_token_ids, dict(PINNED))
        finally:
            await upstream.close()
    assert generation.ids_problem is None, generation.ids_problem
    assert generation.finish_reason == "stop"
    assert len(generation.generation_token_ids) > 300
    assert generation.max_tokens_clamp is None
