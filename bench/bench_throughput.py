"""One worker's throughput on captured calls at a 16k-token prompt, under load. A figure,
never a test assertion.

``bench_frontend`` sends one call at a time, so every call finds the front end's caches cold
(the engine ran in between), and its CPU per call is a worst case. Here the front end is
the only real work: an engine stand-in (``bench/replay_engine.py``) answers each chat call
at once with the bytes the tokcap engine answered the same request with, and ``--loops``
harness loops, each on a rollout of its own, send the captured Anthropic call back to back
for ``--seconds``. Printed per front end: captured calls per second, the front end's CPU per
call (schedstat, every thread) and the share of a core it used, so ``1000 / ms a call`` is
what one worker carries when it has a core to itself; ``--untagged`` also runs the same
calls off the capture path, to tell serving from capturing. By default each loop repeats one
body on its rollout, so a rollout's next prompt shares every id with its last (the best
case of ``api.engine.reply_ids.SpanMemo``); ``--grow K`` sends rollouts of K calls whose
conversation grows as a tool loop's does, from half of ``--prompt-tokens`` to all of it.
Every call is checked to be a 200; the stand-in's counts show that the engine saw each
distinct request once.

``--baseline-src DIR`` also runs a front end from another checkout (same interpreter, same
stand-in), in alternating rounds with this tree's.

    .venv/bin/python -m bench.bench_throughput --loops 16 --seconds 10   # from the repo root

Issue 35, item 3 (16 loops, 2 rounds of 8 s, 2 cores shared with the client and the
stand-in; CPU ms a captured call, calls/s): the text shape at 16k tokens, against ab8c7f4
in the same run, 2.05 ms (506/s) -> 1.36 ms (773/s); against bdbf551 (ids read packed, no
memo) 1.66 ms (634/s) -> 1.35 ms (784/s), this bench repeating each rollout's prompt (the
memo's best case). The Claude Code shape at 15.6k tokens, 3.02 ms (336/s) -> 1.85 ms (553/s).
At 210 tokens (32 loops): captured 1.01 -> 0.95 ms, untagged 0.40 -> 0.36 ms, so capturing
is about 0.6 ms of a short call. ``--grow 16`` (8k to 16k tokens): 1.68 ms (619/s) -> 1.31 ms
(808/s) against ab8c7f4, 1.44 ms (735/s) -> 1.30 ms (810/s) against bdbf551.
With many rollouts in flight, against 4c3662a (whose chain memo kept 64 rollouts and whose
file store handed each write to a pool): 200 loops 2.11 ms (499/s) -> 1.38 ms (728/s);
1,000 loops 2.31 ms (448/s) -> 1.92 ms (540/s); ``--grow 16`` at 200 loops 1.90 ms (557/s)
-> 1.49 ms (702/s).
The rounds alternate which front end runs first: with "before" always first, a front end
measured 6% slower than its own copy. Against 2b77289, 4 rounds, on a day this machine ran
half as fast: at 300 tokens and 200 loops captured 2.063 ms (491/s) -> 1.856 ms (543/s),
untagged 0.973 -> 0.824 ms; at 16k tokens and 200 loops 2.900 ms (351/s) -> 2.706 ms
(374/s). The same tree against itself: 1.698 and 1.719 ms.
At 210 tokens and 32 loops (b10fe3c, in one run): captured 0.935 ms (1,080/s), untagged
0.405 ms (2,487/s); in another run at 0.90 ms a captured call, 0.62 ms of it on the event
loop and 0.31 ms on the file store's threads (``schedstat`` per thread). Tried in
alternating pairs, fsync off on both sides: the store's writes run on the event loop
instead of the writer thread, 0.859 and 0.799 ms against 0.885 and 0.797, so the hand-offs
cost nothing measurable; fsync on, 0.948 and 0.898 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.bench_engine import prompt_of
from bench.bench_frontend import CONFIG, bodies_of, cpu_seconds
from tests.support.servers import free_port, run_process

REPLAY = str(Path(__file__).with_name("replay_engine.py"))
KINDS = ("captured", "untagged")


@contextlib.contextmanager
def engine_stand_in(tmp: Path) -> Iterator[str]:
    """The tokcap engine behind the replaying stand-in; yields the stand-in's URL."""
    engine_port, replay_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    replay = f"http://127.0.0.1:{replay_port}"
    engine_cmd = [sys.executable, "-m", "tokcap_devtools.engine.cli", "--port", str(engine_port)]
    replay_cmd = [sys.executable, REPLAY, "--port", str(replay_port), "--upstream", engine]
    with (
        run_process(engine_cmd, ready_url=engine + "/health"),
        run_process(replay_cmd, ready_url=replay + "/health"),
    ):
        yield replay


@contextlib.contextmanager
def front_end(name: str, tmp: Path, upstream: str, src: str | None) -> Iterator[tuple[str, int]]:
    """A one-worker front end (file store, fsync on) on ``upstream``; yields (URL, PID)."""
    config = tmp / f"{name}.yaml"
    config.write_text(CONFIG.format(dir=tmp / f"captures-{name}"))
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": src} if src else None
    port = free_port()
    cmd = [sys.executable, "-m", "tokcap.commands.serve", "--config", str(config)]
    cmd += ["--upstream", upstream, "--port", str(port), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with run_process(cmd, ready_url=url + "/health", env=env) as proc:
        yield url, proc.pid


async def load(
    front: str,
    name: str,
    bodies: list[bytes],
    loops: int,
    seconds: float,
    captured: bool = True,
) -> int:
    """``loops`` concurrent loops for ``seconds``; the calls answered. Each loop sends the
    bodies in turn on a rollout of its own (untagged: not captured); with more than one
    body (``--grow``) it starts a new rollout after the last, so each call but a rollout's
    first continues the one before."""
    headers = {"content-type": "application/json", "x-api-key": "bench"}
    done = 0

    async def one_loop(session: aiohttp.ClientSession, index: int, until: float) -> None:
        nonlocal done
        step, rollout = 0, 0
        while True:  # at least one call, then as many as fit before ``until``
            prefix = f"/ng-rollout/{name}-{index}-{rollout}/training-token-capture"
            url = f"{front}{prefix if captured else ''}/v1/messages"
            async with session.post(url, data=bodies[step], headers=headers) as reply:
                await reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"{url}: {reply.status} {(await reply.read())[:600]!r}")
            done += 1
            step = (step + 1) % len(bodies)
            rollout += 1 if step == 0 and len(bodies) > 1 else 0
            if time.monotonic() >= until:
                return

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        until = time.monotonic() + seconds
        await asyncio.gather(*(one_loop(session, index, until) for index in range(loops)))
    return done


def grown_bodies(tokens: int, steps: int, max_tokens: int) -> list[dict[str, Any]]:
    """A conversation growing as a tool loop's does: half of ``tokens`` in its first
    message, then per step a short reply and a user turn of ``tokens / (2 * steps)``."""
    first = prompt_of(tokens // 2)
    chunk = prompt_of(tokens // (2 * steps))
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    bodies = []
    for step in range(steps):
        if step:
            messages = [
                *messages,
                {"role": "assistant", "content": f"Read part {step}."},
                {"role": "user", "content": f"Part {step}:\n{chunk}"},
            ]
        bodies.append(
            {"model": "claude-sonnet-4-5", "max_tokens": max_tokens, "messages": messages}
        )
    return bodies


def round_of(
    front: tuple[str, int], name: str, bodies: list[bytes], args: Any, captured: bool
) -> dict[str, float]:
    url, pid = front
    # Warm: each body through once, so the stand-in keeps every reply; then each rollout seen.
    for body in bodies:
        asyncio.run(load(url, f"{name}-warm", [body], 1, 0.0, captured))
    asyncio.run(load(url, name, bodies, args.loops, 1.0, captured))
    cpu, started = cpu_seconds(pid), time.perf_counter()
    calls = asyncio.run(load(url, name, bodies, args.loops, args.seconds, captured))
    wall, used = time.perf_counter() - started, cpu_seconds(pid) - cpu
    return {"calls_s": calls / wall, "ms_call": used * 1000 / calls, "core": used / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shape", choices=["text", "claude-code"], default="text")
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--untagged", action="store_true", help="also untagged calls (no capture)")
    parser.add_argument(
        "--grow", type=int, default=0, help="rollouts of this many calls, each prompt longer"
    )
    args = parser.parse_args(argv)
    if args.grow:
        front_bodies = grown_bodies(args.prompt_tokens, args.grow, args.max_tokens)
    else:
        front_bodies = [bodies_of(args.shape, args.prompt_tokens, args.max_tokens)[1]]
    bodies = [httpx.Request("POST", "http://x", json=body).content for body in front_bodies]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        replay = stack.enter_context(engine_stand_in(Path(tmp)))
        fronts: dict[str, tuple[str, int]] = {}
        if args.baseline_src:
            src = os.path.abspath(args.baseline_src)
            fronts["before"] = stack.enter_context(front_end("before", Path(tmp), replay, src))
        name = "after" if args.baseline_src else "this"
        fronts[name] = stack.enter_context(front_end(name, Path(tmp), replay, None))
        for round_index in range(args.rounds):
            # Each round in the other order: run first or second, a front end measured 6%
            # apart from its own copy (before 2026-12-06 every round ran "before" first).
            order = list(fronts.items())
            for name, front in order[::-1] if round_index % 2 else order:
                for kind in KINDS if args.untagged else KINDS[:1]:
                    results.setdefault(f"{name}, {kind}", []).append(
                        round_of(front, f"{name}{round_index}", bodies, args, kind == "captured")
                    )
        stats = httpx.get(replay + "/replay/stats").json()
    shape = f"growing over {args.grow} calls" if args.grow else args.shape
    print(
        f"{shape}, bodies {len(bodies[0])}-{len(bodies[-1])} bytes, {args.loops} loops, "
        f"{args.rounds} rounds of {args.seconds:g} s; engine stand-in: "
        f"{stats['replayed']} replayed, {stats['passed']} passed to the engine"
    )
    print(f"{'front end':18s} {'calls/s':>9s} {'CPU ms a call':>14s} {'core used':>10s}  (medians)")
    for name, rounds in results.items():
        calls_s = statistics.median(r["calls_s"] for r in rounds)
        ms_call = statistics.median(r["ms_call"] for r in rounds)
        core = statistics.median(r["core"] for r in rounds)
        print(f"{name:18s} {calls_s:9.1f} {ms_call:14.3f} {core:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
