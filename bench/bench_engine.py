"""How fast the tokcap engine answers: the baseline under the front end's added-latency figure.

Starts the engine on 127.0.0.1 (uvicorn in a thread) and times non-streamed chat calls
with a ~16,000-token prompt, the way the front end calls it (logprobs, token ids). Prints
p50/p95 per call and generated tokens per second. A figure, never a test assertion.

    .venv/bin/python -m bench.bench_engine --calls 50     # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app
from tokcap_devtools.engine.tokenizer import load_tokenizer
from tokcap_devtools.engine.train_tokenizer import CORPUS_PATH


def prompt_of(tokens: int) -> str:
    tokenizer = load_tokenizer()
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tokenizer.encode(corpus)
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    args = parser.parse_args(argv)
    body = {
        "messages": [{"role": "user", "content": prompt_of(args.prompt_tokens)}],
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "n": 1,
    }
    with serve_app(create_app(EngineSettings())) as base, httpx.Client(timeout=60) as client:
        client.post(f"{base}/v1/chat/completions", json=body).raise_for_status()  # warm-up
        latencies, generated = [], 0
        for _ in range(args.calls):
            start = time.perf_counter()
            reply = client.post(f"{base}/v1/chat/completions", json=body).json()
            latencies.append(time.perf_counter() - start)
            generated += reply["usage"]["completion_tokens"]
        prompt_tokens = reply["usage"]["prompt_tokens"]
    latencies.sort()
    p50 = statistics.median(latencies) * 1000
    p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] * 1000
    print(
        f"prompt {prompt_tokens} tokens, {args.calls} calls: "
        f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, "
        f"{generated / sum(latencies):.0f} generated tokens/s end to end"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
