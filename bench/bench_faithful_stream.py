"""When a streamed faithful call shows the harness its first words (issue 35, item 7).

Starts a paced tokcap engine (Qwen3 vocabulary; ``--first-token-s`` to the first token,
``--token-s`` per token after it; a reply of thinking, text and a tool call) and two
capturing front ends on it, text and faithful prompts, as child processes on 127.0.0.1.
Each call is a streamed Anthropic Messages call read as raw server-sent events. Per mode,
and for the engine's own chat stream (the direct baseline, measured in the same run):

- first: seconds to the first content delta (direct: the first chunk with content);
- final: seconds to the final event (``message_stop``; direct: ``[DONE]``).

Before faithful replies were relayed, a faithful stream sent its content only once the
whole reply was parsed, so its first delta came at its final event: ``final`` is that
baseline. Calls alternate between the modes so machine noise is shared. A figure, never a
test assertion.

    .venv/bin/python -m bench.bench_faithful_stream --calls 20   # from the repository root
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.bench_faithful_latency import SCRIPT, TOOLS, front_end
from tests.support.servers import free_port, run_process

MODES = ("direct", "text", "faithful")


@contextlib.contextmanager
def engine(tmp: Path, first_s: float, token_s: float) -> Iterator[str]:
    script = tmp / "script.yaml"
    script.write_text(SCRIPT)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokcap_devtools.engine.cli", "--port", str(port)]
    cmd += ["--tokenizer", "qwen3", "--script", str(script), "--log-level", "warning"]
    cmd += ["--first-token-s", str(first_s), "--token-s", str(token_s)]
    with run_process(cmd, ready_url=url + "/health"):
        yield url


def streamed(client: httpx.Client, url: str, n: int, direct: bool) -> tuple[float, float]:
    """(seconds to the first content, seconds to the end) of one streamed call: to the
    engine's chat route (``direct``), else to a front end's Messages route ``url``."""
    ask = [{"role": "user", "content": f"List the files, call {n}."}]
    if direct:
        url += "/v1/chat/completions"
        tools = [
            {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
            for t in TOOLS
        ]
        body = {"model": "tokcap-engine", "messages": ask, "max_tokens": 200, "stream": True}
        body["tools"] = tools
        content = re.compile(r'"(?:reasoning_)?content": ?"[^"]')  # a chunk with content
    else:
        body = {"model": "m", "max_tokens": 200, "messages": ask, "tools": TOOLS, "stream": True}
        content = re.compile("content_block_delta")
    started = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as reply:
        for line in reply.iter_lines():
            if first is None and content.search(line):
                first = time.perf_counter() - started
    end = time.perf_counter() - started
    return (first if first is not None else end), end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--first-token-s", type=float, default=0.3)
    parser.add_argument("--token-s", type=float, default=0.03)
    args = parser.parse_args(argv)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        upstream = stack.enter_context(engine(Path(tmp), args.first_token_s, args.token_s))
        urls = {"direct": upstream}
        for mode in MODES[1:]:
            urls[mode] = stack.enter_context(front_end(mode, Path(tmp), upstream))[0]
        client = stack.enter_context(httpx.Client(timeout=120))
        for n in range(args.calls + 1):
            for mode in MODES:
                measured = streamed(client, urls[mode], n, mode == "direct")
                if n:  # the first call of each pays the connections and lazy set-up
                    times[mode].append(measured)
    print(
        f"{args.calls} streamed calls a mode; engine {args.first_token_s} s + {args.token_s} s/token"
    )
    direct_first = statistics.median(first for first, _ in times["direct"])
    for mode in MODES:
        first = statistics.median(f for f, _ in times[mode])
        final = statistics.median(e for _, e in times[mode])
        print(
            f"{mode:>8}: first content p50 {first:.3f} s ({first / direct_first:.2f}x direct), "
            f"final event p50 {final:.3f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
