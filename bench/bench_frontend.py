"""Added latency of the capturing front end over a direct engine call, same run.

Starts the tokcap engine and the front end (file store, fsync on) as child processes on
127.0.0.1 and alternates three kinds of non-streamed call with a ~16,000-token prompt: the
engine directly (chat completions with the capture parameters), the front end on the
capture path (Anthropic Messages, translated, forwarded, ids captured and durably put), and
the same front end on an untagged path (the same work without the capture), so the hop and
the capture are told apart. Prints p50/p95 of each and of the per-round differences, and
the CPU each server process spent per call (less sensitive to a busy machine than the
wall clock). A figure, never a test assertion.

``--steps`` runs each front end under ``bench/frontend_steps.py`` and prints the thread CPU
of each step of a captured call (parse, translate, traits, engine body, send/receive, decode,
read ids, entry, pack and hash, store put, intent, reply), what no step covers (HTTP server
and client protocols, middleware, event loop, thread hops) and the process's CPU during the
call; these totals are measured in the server, per call, and name the steps, but the
probes add their own cost. The figures above are each process's schedstat (every thread,
nanoseconds; no probes).

``--shape claude-code`` sends a request shaped as the Claude Code CLI sends one mid-loop
(its tools, system blocks and tool rounds) instead of one long user message.

``--baseline-src DIR`` also runs an engine and a front end from another checkout of the
sources (say ``git worktree add /tmp/base <commit>``) with the same interpreter, and
interleaves its calls with this tree's, so a change is measured against its baseline in
one run, with after/before ratios. ``--loop``/``--http`` pick uvicorn's event loop and
HTTP parser for this tree's servers (default: uvloop and httptools).

    .venv/bin/python -m bench.bench_frontend --calls 50     # from the repository root

Issue 35, item 3 (``--steps --calls 200``, 2 cores shared with other test runs, so only the
ratios travel): a captured call's process CPU went from 5.94 to 5.76 ms against the
session's baseline (46766bf), 6.40 to 6.04 against main just before the change, 7.15 to
6.75 on a machine at load 12; -4 to -6 %. The steps that changed (ms, first run): parse
0.18 to 0.12, request traits 0.67 to 0.56, read ids + checks 0.52 to 0.45. The rest stayed:
engine send/receive (aiohttp) 0.97, decode 0.38, pack + hash 0.29, store put 0.47, intent
0.39 (each with an fsync), the event loop's rest 1.7 (uvicorn, FastAPI, asyncio, the
client's protocol) and the pool hops 0.23. An untagged call costs 3.95 ms, so about 4 ms of
a captured call is serving at all, and the goal of 2 ms needs that floor changed. Measured
in a scratch tree, none kept: a minimal HTTP/1.1 client in place of aiohttp saves 0.45 ms,
an intent appended without its own fsync (the entry's fsync of the same log covers it
before any reply) 0.2, opening digests remembered per message text 0.3 (a bench repeats
one opening); with all three a call costs 4.6 ms.

The next session (``--steps``, against c8d1564 in the same run; ms of process CPU a
captured call): the text shape at 16k tokens 3.87 -> 3.36 (request traits 0.47 -> 0.06,
the facts of a rollout's opening texts kept; intent 0.26 -> 0.13, no fsync of its own),
the Claude Code shape at 15.6k tokens 3.45 -> 3.32 (parse 0.29 -> 0.19: only the depth is
walked), a 210-token call 1.75 -> 1.64. What is left is serving at all: an untagged call
costs 2.55 ms at 16k tokens, of which about 0.45 is uvicorn, FastAPI and aiohttp moving
the bytes (a bare proxy of the same bodies) and 0.6 the engine's 16k prompt ids (JSON
decode, checks, packing); the rest is spread over many small steps, none above 0.1 ms.

The session after (schedstat CPU of the front end per call, against ab8c7f4 in the same
run, 400 rounds): the prompt ids read packed off the reply's bytes (``api.engine.reply_ids``)
2.90 -> 2.65 ms a captured call (decode 0.28 -> 0.42 with the read, checks 0.29 -> 0.08),
untagged 2.14 -> 1.89; with a rollout's last list reused (this bench repeats one prompt,
so all of it) 2.88 -> 2.29. A 210-token call: 1.64 -> 1.57 (FastAPI's request handler and
telemetry checks skipped, model routes first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from api.dialects import anthropic
from api.engine.vllm import CHAT_PARAMS as CAPTURE_PARAMS
from bench.bench_engine import prompt_of
from bench.frontend_steps import PROBES
from tests.support.servers import free_port, run_process

CONFIG = """
model_server:
  model: tokcap-engine
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: {dir}
"""
KINDS = ("direct", "untagged", "captured")
STEPS_SCRIPT = str(Path(__file__).with_name("frontend_steps.py"))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


FIXTURE = Path(__file__).resolve().parent.parent / "tests/support/fixtures"
RECORDED = FIXTURE / "claude_code_messages_request.json"
TOOLS = 24  # the CLI sends about 25
ROUND_CHARS = 2400  # a tool result of about 600 tokens


def claude_code_body(tokens: int, max_tokens: int) -> dict[str, Any]:
    """A request shaped as the Claude Code CLI sends one mid-loop, grown with the corpus to
    about ``tokens`` tokens: its recorded system blocks and first message, ``TOOLS`` tools
    with its Bash tool's schema (a quarter of the text in their descriptions), then tool
    rounds (a reply with a tool call, its result). Every element a real body has, in the
    numbers it has them: the text-only body holds one long string instead."""
    recorded = json.loads(RECORDED.read_text())
    recorded = recorded.get("body", recorded)
    text = prompt_of(tokens)
    quarter = len(text) // 4
    bash = recorded["tools"][0]
    share = quarter // TOOLS
    tools = [
        {**bash, "name": f"Tool{n}", "description": text[n * share : (n + 1) * share]}
        for n in range(TOOLS)
    ]
    messages = [recorded["messages"][0]]
    rest = text[quarter:]
    for n, at in enumerate(range(0, len(rest), ROUND_CHARS)):
        call = {"type": "tool_use", "id": f"toolu_{n:04d}", "name": "Tool0", "input": {}}
        call["input"] = {"command": f"cat part-{n}.txt", "description": f"Show part {n}"}
        messages.append(
            {"role": "assistant", "content": [{"type": "text", "text": "Next part."}, call]}
        )
        result = {"type": "tool_result", "tool_use_id": call["id"]}
        result["content"] = rest[at : at + ROUND_CHARS]
        messages.append({"role": "user", "content": [result]})
    body = {key: recorded[key] for key in ("system", "metadata", "thinking") if key in recorded}
    return {
        **body,
        "model": "claude-sonnet-4-5",
        "max_tokens": max_tokens,
        "tools": tools,
        "messages": messages,
    }


def bodies_of(shape: str, tokens: int, max_tokens: int) -> tuple[dict, dict]:
    """(the direct engine's chat body, the front end's Messages body) of one shape."""
    if shape == "claude-code":
        front_body = claude_code_body(tokens, max_tokens)
        chat = anthropic.to_chat(front_body)
    else:
        messages = [{"role": "user", "content": prompt_of(tokens)}]
        front_body = {"model": "claude-sonnet-4-5", "max_tokens": max_tokens, "messages": messages}
        chat = {"messages": messages}
    direct_body = {**chat, "model": "tokcap-engine", "max_tokens": max_tokens, **CAPTURE_PARAMS}
    return direct_body, front_body


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return statistics.median(ordered) * 1000, p95 * 1000


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of a process so far, in nanoseconds' resolution (Linux
    schedstat); the tick counters of /proc/<pid>/stat (10 ms) where it is unavailable."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return tick_cpu_seconds(pid)
    return total / 1e9


def tick_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc; 0 where it is unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@contextlib.contextmanager
def servers(
    name: str,
    tmp: Path,
    bodies: tuple[dict, dict],
    src: str | None,
    server_args: list[str],
    steps: Path | None = None,
) -> Iterator[dict[str, tuple[str, dict, int]]]:
    """An engine and a front end; yields {kind: (url, body, pid of the server doing the work)}.
    With ``steps``, the front end runs under the step probes and writes them there on exit."""
    config = tmp / f"{name}.yaml"
    config.write_text(CONFIG.format(dir=tmp / f"captures-{name}"))
    # Another checkout: its sources only, never this tree's (no current directory on sys.path).
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": src} if src else None
    engine_port, front_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    front = f"http://127.0.0.1:{front_port}"
    engine_cmd = [
        sys.executable,
        "-m",
        "tokcap_devtools.engine.cli",
        "--port",
        str(engine_port),
        *server_args,
    ]
    serve = [STEPS_SCRIPT, str(steps)] if steps else ["-m", "tokcap.commands.serve"]
    front_cmd = [
        sys.executable,
        *serve,
        "--config",
        str(config),
        "--upstream",
        engine,
        "--port",
        str(front_port),
        "--log-level",
        "warning",
        *server_args,
    ]
    direct_body, front_body = bodies
    with (
        run_process(engine_cmd, ready_url=engine + "/health", env=env) as engine_proc,
        run_process(front_cmd, ready_url=front + "/health", env=env) as front_proc,
    ):
        yield {
            "direct": (engine + "/v1/chat/completions", direct_body, engine_proc.pid),
            "untagged": (f"{front}/v1/messages", front_body, front_proc.pid),
            "captured": (
                f"{front}/ng-rollout/bench-{name}/training-token-capture/v1/messages",
                front_body,
                front_proc.pid,
            ),
        }


def measure(
    client: httpx.Client, setups: dict[str, dict[str, tuple[str, dict, int]]], calls: int
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], float]]:
    """Wall times per (setup, kind), and mean server CPU seconds per call, interleaved."""
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], float] = {}
    for name, paths in setups.items():
        for kind, (url, body, _) in paths.items():
            for _ in range(3):
                client.post(url, json=body).raise_for_status()  # warm-up every path
            times[name, kind], cpu[name, kind] = [], 0.0
    for _ in range(calls):
        for name, paths in setups.items():
            for kind, (url, body, pid) in paths.items():
                cpu_before = cpu_seconds(pid)
                start = time.perf_counter()
                client.post(url, json=body).raise_for_status()
                times[name, kind].append(time.perf_counter() - start)
                time.sleep(0.002)  # the server's bookkeeping after the reply counts too
                cpu[name, kind] += cpu_seconds(pid) - cpu_before
    return times, {key: total / calls for key, total in cpu.items()}


def rows(times: dict[str, list[float]]) -> list[tuple[str, list[float]]]:
    return [
        ("direct engine", times["direct"]),
        ("front end, untagged", times["untagged"]),
        ("front end, captured", times["captured"]),
        ("added: captured - direct", diff(times["captured"], times["direct"])),
        ("added: untagged - direct", diff(times["untagged"], times["direct"])),
        ("added: captured - untagged", diff(times["captured"], times["untagged"])),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--baseline-src",
        default=None,
        help="another checkout's root to run and compare against, same run",
    )
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    parser.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto")
    parser.add_argument(
        "--steps", action="store_true", help="probe each front end: CPU per step of a call"
    )
    parser.add_argument(
        "--shape",
        choices=["text", "claude-code"],
        default="text",
        help="one long user message, or a Claude Code CLI request mid-loop (tools, rounds)",
    )
    args = parser.parse_args(argv)
    direct_body, front_body = bodies_of(args.shape, args.prompt_tokens, args.max_tokens)
    bodies = (direct_body, front_body)
    server_args = ["--loop", args.loop, "--http", args.http]
    with tempfile.TemporaryDirectory() as tmp:
        probes = {"before": Path(tmp) / "steps-before.json", "this": Path(tmp) / "steps-this.json"}
        with contextlib.ExitStack() as stack:
            setups: dict[str, Any] = {}
            if args.baseline_src:
                src = os.path.abspath(args.baseline_src)
                steps = probes["before"] if args.steps else None
                setups["before"] = stack.enter_context(
                    servers("before", Path(tmp), bodies, src, [], steps)
                )
            steps = probes["this"] if args.steps else None
            setups["after" if args.baseline_src else "this"] = stack.enter_context(
                servers("this", Path(tmp), bodies, None, server_args, steps)
            )
            client = stack.enter_context(httpx.Client(timeout=120))
            times, cpu = measure(client, setups, args.calls)
            engine = next(iter(setups.values()))["direct"][0].rsplit("/v1/", 1)[0]
            prompt_tokens = client.post(
                engine + "/tokenize",
                json={
                    key: direct_body[key]
                    for key in ("model", "messages", "tools")
                    if key in direct_body
                },
            ).json()["count"]
        # The servers have exited, so the probes have written their files.
        found = [
            json.loads(probes[name].read_text())
            for name in ("before", "this")
            if args.steps and probes[name].exists()  # "before" only with a baseline
        ]
    print(
        f"{args.shape} prompt {prompt_tokens} tokens, {args.calls} interleaved rounds, "
        f"max_tokens {args.max_tokens}, loop {args.loop}, http {args.http}"
    )
    print_latency(times, cpu, list(setups))
    if args.steps:
        print_steps(dict(zip(setups, found, strict=True)))
    print("target: captured - direct <= 2 ms p50")
    return 0


def print_latency(
    times: dict[tuple[str, str], list[float]], cpu: dict[tuple[str, str], float], names: list[str]
) -> None:
    """p50/p95 of each kind and of the differences, per setup, and the CPU per call."""
    table = {name: rows({kind: times[name, kind] for kind in KINDS}) for name in names}
    header = "".join(f"  {name + ' p50':>12s} {'p95':>8s}" for name in names)
    ratio = "  after/before p50" if len(names) == 2 else ""
    print(f"{'ms':28s}{header}{ratio}")
    for index, (label, _) in enumerate(table[names[0]]):
        cells, p50s = "", []
        for name in names:
            p50, p95 = percentiles(table[name][index][1])
            cells += f"  {p50:12.2f} {p95:8.2f}"
            p50s.append(p50)
        if ratio:
            cells += f"  {p50s[1] / p50s[0]:17.2f}" if p50s[0] > 0 else f"  {'-':>17s}"
        print(f"{label:28s}{cells}")
    print("server CPU per call, ms (the engine for direct, the front end otherwise):")
    for name in names:
        print(f"  {name:8s}" + "".join(f"  {kind} {cpu[name, kind] * 1000:6.2f}" for kind in KINDS))


def print_steps(found: dict[str, dict[str, Any]]) -> None:
    """Thread CPU per step of a captured call, per setup, then what no step covers: on the
    event loop's thread (HTTP server and client, middleware, the loop) and on the others
    (the thread pool's hops), and the process's CPU during the call."""
    names = list(found)
    captured = {name: found[name]["captured"] for name in names}
    calls = {name: max(captured[name]["calls"], 1) for name in names}

    def per_call(name: str, seconds: float) -> float:
        return seconds * 1000 / calls[name]

    order = dict.fromkeys(step for _, _, step, _ in PROBES)  # the order a call runs them
    steps = [step for step in order if any(step in captured[n]["seconds"] for n in names)]
    print("captured call, front end CPU per step, ms" + "".join(f"  {n:>8s}" for n in names))

    def line(label: str, values: dict[str, float]) -> None:
        print(f"  {label:44s}" + "".join(f"  {per_call(n, values[n]):8.3f}" for n in names))

    for step in steps:
        line(step, {n: captured[n]["seconds"].get(step, 0.0) for n in names})
    sums = {n: sum(captured[n]["seconds"].values()) for n in names}
    off_loop = {n: captured[n]["off_loop"] for n in names}
    loop = {n: captured[n]["totals"]["loop thread"] for n in names}
    process = {n: captured[n]["totals"]["process"] for n in names}
    line("sum of the steps", sums)
    line(
        "rest on the loop (server, client, middleware)",
        {n: loop[n] - (sums[n] - off_loop[n]) for n in names},
    )
    line(
        "rest on other threads (pool hops)", {n: process[n] - loop[n] - off_loop[n] for n in names}
    )
    line("total: process CPU during the call", process)
    untagged = {n: found[n]["untagged"] for n in names}
    print(
        f"  {'untagged call, process CPU during the call':44s}"
        + "".join(
            f"  {u['totals'].get('process', 0.0) * 1000 / max(u['calls'], 1):8.3f}"
            for u in untagged.values()
        )
    )


def diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
