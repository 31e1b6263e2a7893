"""Routed experts on a long synthetic rollout: bytes stored, put, freeze + rebuild, memory.

Run: ``.venv/bin/python -m bench.bench_routes`` (``--turns 200 --layers 48 --top-k 8``).

The rollout is ``bench_capture``'s agent loop (a 2,000-token system prompt, then per turn
200 generated and 300 tool-output tokens: 102k tokens at 200 turns). With routes, every
call carries the routes of every position it read, ``[tokens - 1, layers, top_k]`` uint16,
as an engine sends them: each call's routes start with the previous call's (routes of a
prefix do not change when it is extended). The same rollout is stored without routes in
the same run, as the baseline, each variant in fresh child processes (one puts into a file
store, one only freezes and rebuilds, for a clean peak RSS):

- routes bytes stored (with minus without) / the final context's routes (goal <= 1.5x);
- CPU per put, freeze + rebuild time and peak RSS, with routes against without;
- the same with routes without the prefix (issue 35, item 4): each call after the first
  gets from the engine only the rows after the whole blocks of the previous call's stored
  routes (vLLM's ``routed_experts_prompt_start``) and hands the store ``ChainedRoutes``, as
  the front end does; its CPU per put counts what the front end then does per call (the
  ids compared with the previous call's, the new rows cut into blocks) and the put.

Measured (this 2-core machine, under a test run; one run, all variants, default flags):
CPU per put p50 0.8 ms without routes, 64.7 ms with whole routes, 2.2 ms without the prefix
(at the final 100k-token context: 1.6, 134.5 and 3.2 ms); bytes stored, freeze + rebuild and
peak RSS are the same for whole routes and without the prefix (79.0 MB; 298-303 ms; 470 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy

from api.prompts.route_prefix import prefix_for
from bench.bench_capture import (
    FINAL_ANSWER,
    GENERATED_PER_TURN,
    SYSTEM_TOKENS,
    TOOL_PER_TURN,
    lazy_rollout,
)
from capture.build.builder import run_builder
from capture.codec.route_blocks import ChainedRoutes
from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry
from capture.routes import RouteChain, Routes

EXPERTS = 128


def final_routes(turns: int, layers: int, top_k: int) -> bytes:
    """Routes for every position of the final context (seeded): each call's are a prefix."""
    positions = SYSTEM_TOKENS + turns * (GENERATED_PER_TURN + TOOL_PER_TURN)
    rng = numpy.random.default_rng(0)
    return rng.integers(0, EXPERTS, (positions, layers, top_k), dtype="<u2").tobytes()


class PrefixCalls:
    """What the front end does per call with routes without the prefix: the part of the
    previous call's chain this prompt's ids share, then the new rows cut after it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chain: RouteChain | None = None
        self.previous: list[int] = []

    def routes(self, entry: TokenEntry, whole: bytes, shape: tuple[int, int]) -> ChainedRoutes:
        prompt = entry.prompt_token_ids
        prefix = prefix_for(self.chain, prompt, self.previous)
        start = prefix.rows if prefix else 0
        rows = len(prompt) + len(entry.generation_token_ids) - 1
        row_bytes = shape[0] * shape[1] * 2
        # The rows the engine sends: only those after the prefix cross the wire.
        sent = Routes((whole[start * row_bytes : rows * row_bytes],), rows - start, *shape)
        routes = ChainedRoutes(sent, self.block_size, prefix.names if prefix else ())
        self.chain = routes.chain
        self.previous = [*prompt, *entry.generation_token_ids]
        return routes


async def child_put(
    directory: Path, turns: int, shape: tuple[int, int] | None, prefix: bool = False
) -> dict:
    routes = final_routes(turns, *shape) if shape else b""
    store = FileTokenStore(directory)
    calls = PrefixCalls(store.block_size)
    cpu_ms = []
    try:
        for entry in lazy_rollout("r", turns):
            await store.begin_call(entry.rollout_id, entry.model_call_id)
            start = time.process_time()
            if shape and prefix:
                entry.routed_experts = calls.routes(entry, routes, shape)
            elif shape:
                rows = len(entry.prompt_token_ids) + len(entry.generation_token_ids) - 1
                entry.routed_experts = Routes((routes,), rows, *shape)
            await store.put(entry)
            cpu_ms.append((time.process_time() - start) * 1000)
    finally:
        await store.close()
    stored = sum(path.stat().st_size for path in directory.iterdir() if path.is_file())
    return {
        "put_cpu_p50_ms": statistics.median(cpu_ms),
        "put_cpu_last_ms": statistics.median(cpu_ms[-5:]),  # at the final context
        "stored_bytes": stored,
    }


async def child_rebuild(directory: Path, turns: int, repeat: int, routed: bool) -> dict:
    times = []
    for _ in range(repeat):
        store = FileTokenStore(directory)
        try:
            start = time.perf_counter()
            snapshot = await store.freeze("r")
            build = run_builder(snapshot, final_answer=[FINAL_ANSWER])
            times.append((time.perf_counter() - start) * 1000)
        finally:
            await store.close()
        carriers = [item for item in build.output if "generation_token_ids" in item]
        if build.masked or len(carriers) != turns:
            raise RuntimeError(f"rebuild went wrong: {build.mask_reasons}")
        if routed and any(item.get("routed_experts") is None for item in carriers):
            raise RuntimeError("a delivered call lost its routes")
        last = carriers[-1].get("routed_experts")
        if (
            routed
            and last.to_bytes()
            != final_routes(turns, last.layers, last.top_k)[: last.rows * last.row_bytes]
        ):
            raise RuntimeError("the last call's routes are not the engine's")
        del snapshot, build, carriers
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rebuild_ms": statistics.median(times), "rss_mb": peak}


def _child(args: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.bench_routes", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"child {args} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(
    turns: int, shape: tuple[int, int] | None, repeat: int, prefix: bool = False
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(
        prefix="tokcap-routes-", dir=os.environ.get("BENCH_DIR")
    ) as tmp:
        where = ["--dir", str(Path(tmp) / "captures"), "--turns", str(turns)]
        if shape:
            where += ["--layers", str(shape[0]), "--top-k", str(shape[1])]
        else:
            where += ["--no-routes"]
        figures = _child(["--child", "put", *where, *(["--prefix"] if prefix else [])])
        figures |= _child(["--child", "rebuild", *where, "--repeat", str(repeat)])
    return figures


def report(turns: int, shape: tuple[int, int], repeat: int) -> None:
    without = measure(turns, None, repeat)
    routed = measure(turns, shape, repeat)
    prefixed = measure(turns, shape, repeat, prefix=True)
    # The last call's sequence: the system prompt, every turn before it, its generation.
    positions = SYSTEM_TOKENS + (turns - 1) * (GENERATED_PER_TURN + TOOL_PER_TURN)
    positions += GENERATED_PER_TURN
    final = (positions - 1) * shape[0] * shape[1] * 2
    every_call = sum(
        (SYSTEM_TOKENS + turn * (GENERATED_PER_TURN + TOOL_PER_TURN) + GENERATED_PER_TURN - 1)
        for turn in range(turns)
    )
    every_call *= shape[0] * shape[1] * 2
    routes_stored = routed["stored_bytes"] - without["stored_bytes"]
    print(f"{turns} turns, {positions:,} tokens, routes {shape[0]} layers x top-{shape[1]}")
    print(f"  final context's routes          {final / 1e6:10.1f} MB")
    print(f"  every call's routes, whole      {every_call / 1e6:10.1f} MB")
    print(
        f"  routes stored                   {routes_stored / 1e6:10.1f} MB  "
        f"= x{routes_stored / final:.3f} of the final context's (goal <= 1.5)"
    )
    rows = [
        ("stored (MB)", "stored_bytes", 1e-6),
        ("CPU per put p50 (ms)", "put_cpu_p50_ms", 1.0),
        ("CPU per put, last 5 (ms)", "put_cpu_last_ms", 1.0),
        ("freeze + rebuild (ms)", "rebuild_ms", 1.0),
        ("peak RSS, rebuild (MB)", "rss_mb", 1.0),
    ]
    print(f"  {'':26} {'without':>9} {'whole':>9} {'ratio':>7} {'no prefix':>10} {'ratio':>7}")
    for label, key, scale in rows:
        a, b, c = (figures[key] * scale for figures in (without, routed, prefixed))
        print(f"  {label:26} {a:9.1f} {b:9.1f} {b / a:6.2f}x {c:10.1f} {c / a:6.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="freeze+rebuild repetitions")
    parser.add_argument("--child", choices=("put", "rebuild"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--no-routes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = None if args.no_routes else (args.layers, args.top_k)
    if args.child == "put":
        put = child_put(Path(args.dir), args.turns, shape, args.prefix)
        print(json.dumps(asyncio.run(put)))
    elif args.child == "rebuild":
        figures = child_rebuild(Path(args.dir), args.turns, args.repeat, shape is not None)
        print(json.dumps(asyncio.run(figures)))
    else:
        report(args.turns, (args.layers, args.top_k), args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
