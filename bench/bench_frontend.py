"""Added latency of the capturing front end over a direct engine call, same run.

Starts the tokcap engine and the front end (file store, fsync on) as child processes on
127.0.0.1 and alternates two kinds of non-streamed call with a ~16,000-token prompt: the
engine directly (chat completions with the capture parameters), and the front end on the
capture path (Anthropic Messages, translated, forwarded, ids captured and durably put), and
the same front end on an untagged path (the same work without the capture), so the hop and
the capture are told apart. Prints p50/p95 of each and of the per-pair differences. A
figure, never a test assertion.

    .venv/bin/python -m bench.bench_frontend --calls 50     # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from api.upstream import CAPTURE_PARAMS
from bench.bench_engine import prompt_of
from tests.servers import free_port, run_process

CONFIG = """
model_server:
  model: tokcap-engine
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: {dir}
"""


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return statistics.median(ordered) * 1000, p95 * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    prompt = prompt_of(args.prompt_tokens)
    direct_body = {
        "model": "tokcap-engine",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        **CAPTURE_PARAMS,
    }
    front_body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": args.max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    }
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(CONFIG.format(dir=Path(tmp) / "captures"))
        engine_port, front_port = free_port(), free_port()
        engine = f"http://127.0.0.1:{engine_port}"
        front = f"http://127.0.0.1:{front_port}"
        engine_cmd = [sys.executable, "-m", "api.engine.cli", "--port", str(engine_port)]
        front_cmd = [sys.executable, "-m", "api.serve_cli", "--config", str(config),
                     "--upstream", engine, "--port", str(front_port), "--log-level", "warning"]
        with run_process(engine_cmd, ready_url=engine + "/health"), \
                run_process(front_cmd, ready_url=front + "/health"), \
                httpx.Client(timeout=120) as client:
            url = f"{front}/ng-rollout/bench-1/training-token-capture/v1/messages"
            plain_url = f"{front}/v1/messages"
            paths = {
                "direct": (engine + "/v1/chat/completions", direct_body),
                "untagged": (plain_url, front_body),
                "captured": (url, front_body),
            }
            times: dict[str, list[float]] = {name: [] for name in paths}
            for target, body in paths.values():
                client.post(target, json=body).raise_for_status()  # warm-up every path
            for _ in range(args.calls):
                for name, (target, body) in paths.items():
                    start = time.perf_counter()
                    client.post(target, json=body).raise_for_status()
                    times[name].append(time.perf_counter() - start)
            prompt_tokens = client.post(engine + "/tokenize", json={"model": "tokcap-engine", "messages": direct_body["messages"]}).json()["count"]
    print(f"prompt {prompt_tokens} tokens, {args.calls} rounds, max_tokens {args.max_tokens}")
    rows = [
        ("direct engine", times["direct"]),
        ("front end, untagged", times["untagged"]),
        ("front end, captured", times["captured"]),
        ("added: captured - direct", diff(times["captured"], times["direct"])),
        ("added: untagged - direct", diff(times["untagged"], times["direct"])),
        ("added: captured - untagged", diff(times["captured"], times["untagged"])),
    ]
    for label, values in rows:
        p50, p95 = percentiles(values)
        print(f"{label:28s} p50 {p50:7.2f} ms  p95 {p95:7.2f} ms")
    print("target: captured - direct <= 2 ms p50")
    return 0


def diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
