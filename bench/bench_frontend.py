"""Added latency of the capturing front end over a direct engine call, same run.

Starts the tokcap engine and the front end (file store, fsync on) as child processes on
127.0.0.1 and alternates two kinds of non-streamed call with a ~16,000-token prompt: the
engine directly (chat completions with the capture parameters), and the front end on the
capture path (Anthropic Messages, translated, forwarded, ids captured and durably put).
Prints p50/p95 of both and of the difference. A figure, never a test assertion.

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
            client.post(engine + "/v1/chat/completions", json=direct_body).raise_for_status()
            client.post(url, json=front_body).raise_for_status()  # warm-up both paths
            direct, captured = [], []
            for _ in range(args.calls):
                start = time.perf_counter()
                client.post(engine + "/v1/chat/completions", json=direct_body).raise_for_status()
                direct.append(time.perf_counter() - start)
                start = time.perf_counter()
                client.post(url, json=front_body).raise_for_status()
                captured.append(time.perf_counter() - start)
            prompt_tokens = client.post(engine + "/tokenize", json={"model": "tokcap-engine", "messages": direct_body["messages"]}).json()["count"]
    added = [c - d for c, d in zip(captured, direct, strict=True)]
    d50, d95 = percentiles(direct)
    c50, c95 = percentiles(captured)
    a50, a95 = percentiles(added)
    print(f"prompt {prompt_tokens} tokens, {args.calls} call pairs, max_tokens {args.max_tokens}")
    print(f"direct engine:        p50 {d50:.2f} ms  p95 {d95:.2f} ms")
    print(f"front end (captured): p50 {c50:.2f} ms  p95 {c95:.2f} ms")
    print(f"added per call:       p50 {a50:.2f} ms  p95 {a95:.2f} ms  (target <= 2 ms p50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
