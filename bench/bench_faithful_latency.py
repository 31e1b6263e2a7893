"""Added latency of faithful prompts over text prompts, per call, from 16k context up.

Starts one tokcap engine (Qwen3 vocabulary, a scripted policy that calls a tool every
turn) and two capturing front ends on it as child processes on 127.0.0.1: one with text
prompts (the engine renders the whole chat), one with faithful prompts (the front end
bridges the new messages onto the previous call's ids and sends ids). Each front end runs
its own tool loop (Anthropic Messages, non-streamed) from a ~16,000-token first message,
~400 tokens more each turn; turns alternate between the two so machine noise is shared.

Prints wall p50/p95 of each, the p50 of the per-turn difference (faithful - text), the
CPU each front end and the engine spent per call, and the difference for the first and
second half of the turns: bridging should cost the new tokens, not the context, so the
difference should not grow with it. A figure, never a test assertion (issue 11).

The front end's CPU is the figure that carries over to a real engine. The wall difference
nets it against the engine's side, and the tokcap engine is no vLLM there: it decodes an
id prompt back into a conversation for its scripted policy, so taking ids costs it about
what rendering the chat does, where vLLM would skip its chat template and tokenizer.

    .venv/bin/python -m bench.bench_faithful_latency --turns 40   # from the repository root
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.bench_engine import prompt_of
from bench.bench_frontend import cpu_seconds, percentiles
from tests.support.servers import free_port, run_process

SCRIPT = """
default:
  think: "short thought"
  text: "Listing."
  tool_calls:
    - name: list_files
      arguments: {path: "src"}
"""
CONFIG = """
model_server:
  model: tokcap-engine
{prompts}
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: {dir}
"""
FAITHFUL = "  prompts: faithful\n  renderer: {name: qwen3, tokenizer: qwen3}"
TOOLS = [
    {
        "name": "list_files",
        "description": "List the files under a path.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
MODES = ("text", "faithful")
WARMUP_TURNS = 2
TARGET_MS = 1.0


@dataclass
class Rollout:
    """One front end's tool loop and what its measured turns cost."""

    url: str
    pid: int
    messages: list[dict]
    wall: list[float] = field(default_factory=list)
    front_cpu: list[float] = field(default_factory=list)
    engine_cpu: list[float] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@contextlib.contextmanager
def front_end(mode: str, tmp: Path, engine: str) -> Iterator[tuple[str, int]]:
    """A front end with its own file store; yields (rollout URL, pid)."""
    config = tmp / f"{mode}.yaml"
    prompts = FAITHFUL if mode == "faithful" else ""
    config.write_text(CONFIG.format(prompts=prompts, dir=tmp / f"captures-{mode}"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "tokcap.commands.serve",
        "--config",
        str(config),
        "--upstream",
        engine,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--skip-probe",
    ]
    with run_process(cmd, ready_url=base + "/health") as proc:
        yield f"{base}/ng-rollout/bench-{mode}/training-token-capture/v1/messages", proc.pid


def next_messages(reply: dict, result: str) -> list[dict]:
    """The reply's content as returned, then a tool result for its tool call."""
    tool_use = next(block for block in reply["content"] if block["type"] == "tool_use")
    return [
        {"role": "assistant", "content": reply["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": result}],
        },
    ]


def turn(
    client: httpx.Client,
    rollout: Rollout,
    mode: str,
    engine_pid: int,
    result: str,
    measured: bool,
) -> None:
    """One call of the loop; the front end's and the engine's CPU are read around it."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "tools": TOOLS,
        "messages": rollout.messages,
    }
    front_before, engine_before = cpu_seconds(rollout.pid), cpu_seconds(engine_pid)
    start = time.perf_counter()
    response = client.post(rollout.url, json=body)
    wall = time.perf_counter() - start
    time.sleep(0.002)  # the servers' bookkeeping after the reply counts too
    front_cpu = cpu_seconds(rollout.pid) - front_before
    engine_cpu = cpu_seconds(engine_pid) - engine_before
    response.raise_for_status()
    reply = response.json()
    rollout.messages.extend(next_messages(reply, result))
    if not measured:
        return
    rollout.wall.append(wall)
    rollout.front_cpu.append(front_cpu)
    rollout.engine_cpu.append(engine_cpu)
    rollout.input_tokens.append(reply["usage"]["input_tokens"])
    how = response.headers.get("x-tokcap-prompt")
    if mode == "faithful" and how != "continued:memory":
        rollout.problems.append(f"turn {len(rollout.wall)}: x-tokcap-prompt {how!r}")


def run(
    client: httpx.Client,
    rollouts: dict[str, Rollout],
    engine_pid: int,
    turns: int,
    listing: str,
) -> None:
    """Warm-up turns, then measured turns, text and faithful alternating."""
    for index in range(WARMUP_TURNS + turns):
        result = f"listing {index}:\n{listing}"
        for mode in MODES:
            measured = index >= WARMUP_TURNS
            turn(client, rollouts[mode], mode, engine_pid, result, measured)


def diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


def ms_per_call(values: list[float]) -> float:
    """The median per call (the mean where schedstat is missing: ticks of 10 ms)."""
    return statistics.median(values) * 1000


def print_wall(text: Rollout, faithful: Rollout) -> float:
    """Wall p50/p95 of each mode and of the per-turn difference; returns that p50."""
    added = diff(faithful.wall, text.wall)
    print(f"{'wall ms':34s} {'p50':>8s} {'p95':>8s}")
    for label, values in (("text", text.wall), ("faithful", faithful.wall)):
        p50, p95 = percentiles(values)
        print(f"  {label:32s} {p50:8.2f} {p95:8.2f}")
    p50, p95 = percentiles(added)
    print(f"  {'faithful - text (per turn)':32s} {p50:8.2f} {p95:8.2f}")
    half = len(added) // 2
    print(
        f"  faithful - text p50, first half {percentiles(added[:half])[0]:.2f} "
        f"(from {faithful.input_tokens[0]} tokens), second half "
        f"{percentiles(added[half:])[0]:.2f} (from {faithful.input_tokens[half]} tokens)"
    )
    return p50


def print_cpu(text: Rollout, faithful: Rollout) -> float:
    """CPU per call of each front end and of the engine; returns the front ends' difference."""
    added = ms_per_call(faithful.front_cpu) - ms_per_call(text.front_cpu)
    half = len(text.front_cpu) // 2
    first = ms_per_call(faithful.front_cpu[:half]) - ms_per_call(text.front_cpu[:half])
    second = ms_per_call(faithful.front_cpu[half:]) - ms_per_call(text.front_cpu[half:])
    print("CPU ms per call (median; per-thread schedstat)")
    print(
        f"  front end: text {ms_per_call(text.front_cpu):.2f}, "
        f"faithful {ms_per_call(faithful.front_cpu):.2f}, faithful - text {added:.2f} "
        f"(first half {first:.2f}, second half {second:.2f})"
    )
    print(
        f"  engine: text {ms_per_call(text.engine_cpu):.2f} (renders the whole chat), "
        f"faithful {ms_per_call(faithful.engine_cpu):.2f} (takes ids)"
    )
    return added


def report(rollouts: dict[str, Rollout]) -> None:
    text, faithful = rollouts["text"], rollouts["faithful"]
    print(
        f"{len(text.wall)} turns each after {WARMUP_TURNS} warm-up, alternating; prompt "
        f"{faithful.input_tokens[0]} -> {faithful.input_tokens[-1]} tokens (faithful), "
        f"{text.input_tokens[0]} -> {text.input_tokens[-1]} (text)"
    )
    wall = print_wall(text, faithful)
    cpu = print_cpu(text, faithful)
    print(f"x-tokcap-prompt other than continued:memory: {len(faithful.problems)}")
    for problem in faithful.problems:
        print(f"  problem: {problem}")
    print(f"target: faithful - text <= {TARGET_MS:g} ms p50 (front end)")
    # The wall difference nets the engine's saving (no chat to render) against the front
    # end's added work; the front end's CPU is that work alone. Both must be within.
    met = wall <= TARGET_MS and cpu <= TARGET_MS and not faithful.problems
    print(
        f"verdict: {'met' if met else 'NOT met'}: wall p50 {wall:+.2f} ms, "
        f"front-end CPU {cpu:+.2f} ms per call"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument(
        "--result-tokens",
        type=int,
        default=460,
        help="tool result size in prompt_of tokens (the shipped BPE; ~370 Qwen3 tokens)",
    )
    args = parser.parse_args(argv)
    first = [{"role": "user", "content": prompt_of(args.prompt_tokens)}]
    listing = prompt_of(args.result_tokens)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        script = Path(tmp) / "script.yaml"
        script.write_text(SCRIPT)
        engine_port = free_port()
        engine = f"http://127.0.0.1:{engine_port}"
        engine_cmd = [
            sys.executable,
            "-m",
            "tokcap_devtools.engine.cli",
            "--port",
            str(engine_port),
            "--tokenizer",
            "qwen3",
            "--script",
            str(script),
        ]
        engine_proc = stack.enter_context(run_process(engine_cmd, ready_url=engine + "/health"))
        rollouts = {}
        for mode in MODES:
            url, pid = stack.enter_context(front_end(mode, Path(tmp), engine))
            rollouts[mode] = Rollout(url, pid, list(first))
        client = stack.enter_context(httpx.Client(timeout=120))
        run(client, rollouts, engine_proc.pid, args.turns, listing)
    report(rollouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
