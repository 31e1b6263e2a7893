"""Redis store figures beside the file store's, on bench_capture's synthetic rollout (not a test).

Run: ``.venv/bin/python -m bench.bench_redis [--baseline /tmp/base-tree]`` (starts a private
redis-server with AOF and ``appendfsync always`` in a temp dir, unless ``REDIS_URL`` is set).

Prints bench_capture's table with a ``redis`` row per rollout length (stored bytes are Redis
``MEMORY USAGE`` of the rollout's key), then the put of one 27,000-token entry (the turn
that brings the rollout to 27,000 prompt tokens, into a rollout holding the earlier turns),
timed for both stores in alternation so both see the same disk and the same neighbours.

Then two figures of the Redis put alone, each for this tree and, with ``--baseline``, for
another checkout (the commit before a change) in the same run on the same server. Each
tree's code runs in child processes of its own (``PYTHONPATH`` names the tree), started and
stopped by PID:
- put p50 of that 27,000-token entry beside a bare ``HSET`` of the same fields and bytes
  the put wrote (read back from the hash), from the same process and client library;
- durable puts/s with 4 processes x 64 rollouts at once, each rollout putting its calls in
  order, the clock running from a common start until the last put returns.
The "this" tree's children run whatever is checked out there, uncommitted edits included.
Each tree's entries carry their prompts as that tree's front end hands them to the store:
packed (``PackedIds``) where the tree has them; ``--prompts lists`` gives every tree lists.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from bench.bench_capture import (
    STORE_KINDS,
    StoreKind,
    bench_store,
    print_table,
    synthetic_rollout,
)
from tokcap_devtools.processes import stop_process
from tokcap_devtools.redis_server import RedisServer
from transports.redis import RedisTokenStore
from transports.redis.keys import rollout_key

PUT_TURN = 50  # 2,000 system tokens + 50 turns x 500 = 27,000 prompt tokens
THIS_TREE = Path(__file__).resolve().parents[1]
LOAD_PROCESSES, LOAD_ROLLOUTS = 4, 64


def redis_kind(url: str) -> StoreKind:
    """A StoreKind whose scratch dir names a key prefix of its own on the server at ``url``."""

    def prefix(scratch: Path) -> str:
        return "bench" + hashlib.blake2b(str(scratch).encode(), digest_size=6).hexdigest()

    async def open_store(scratch: Path) -> RedisTokenStore:
        return RedisTokenStore(url=url, key_prefix=prefix(scratch))

    async def stored_bytes(store: Any, scratch: Path, rollout_id: str) -> int:
        with redis.Redis.from_url(url) as client:
            return client.memory_usage(rollout_key(prefix(scratch), rollout_id), samples=0)

    return StoreKind("redis", open_store, stored_bytes)


async def put_27k(kinds: list[StoreKind], trials: int) -> dict[str, float]:
    """p50 (ms) of the 27,000-token put per store, trials alternating between stores."""
    times: dict[str, list[float]] = {kind.name: [] for kind in kinds}
    with tempfile.TemporaryDirectory(
        prefix="tokcap-bench-", dir=os.environ.get("BENCH_DIR")
    ) as tmp:
        stores = {kind.name: await kind.open(Path(tmp) / kind.name) for kind in kinds}
        for trial in range(trials):
            entries = synthetic_rollout(f"put27k-{trial}", PUT_TURN + 1, seed=trial)
            assert len(entries[PUT_TURN].prompt_token_ids) == 27_000
            for name, store in stores.items():
                for entry in entries[:PUT_TURN]:
                    await store.put(entry.model_copy(update={"rollout_id": f"{name}-{trial}"}))
                last = entries[PUT_TURN].model_copy(update={"rollout_id": f"{name}-{trial}"})
                start = time.perf_counter()
                await store.put(last)
                times[name].append((time.perf_counter() - start) * 1000)
        for store in stores.values():
            await store.close()
    return {name: statistics.median(values) for name, values in times.items()}


# -- the Redis put alone, run by each tree's code in a child process -----------------------

PROMPTS_ENV = "TOKCAP_BENCH_PROMPTS"  # "packed" (default) or "lists", set for the children


def as_front_end_hands(entry: Any) -> Any:
    """The entry as this tree's front end hands it to a store: its prompt packed where the
    tree has ``PackedIds`` (done before any clock starts, as the id check does it)."""
    if os.environ.get(PROMPTS_ENV, "packed") != "packed":
        return entry
    try:
        from capture.codec.packed import PackedIds
    except ImportError:  # a tree before packed prompts: its front end handed lists
        return entry
    return entry.model_copy(update={"prompt_token_ids": PackedIds.of(entry.prompt_token_ids)})


async def child_put(url: str, prefix: str, trials: int) -> dict[str, Any]:
    """Per trial: the 27,000-token put, and a bare HSET of what it wrote, in turn first."""
    store = RedisTokenStore(url=url, key_prefix=prefix)
    client = aioredis.Redis.from_url(url)
    put_ms: list[float] = []
    hset_ms: list[float] = []
    written: dict[bytes, bytes] = {}

    async def bare(trial: int) -> None:
        start = time.perf_counter()
        await client.hset(f"{prefix}:bare:{trial}", mapping=written)
        hset_ms.append((time.perf_counter() - start) * 1000)

    for trial in range(trials):
        rollout_id = f"put27k-{trial}"
        entries = [
            as_front_end_hands(entry)
            for entry in synthetic_rollout(rollout_id, PUT_TURN + 1, seed=trial)
        ]
        for entry in entries[:PUT_TURN]:
            await store.put(entry)
        if written and trial % 2:
            await bare(trial)
        key = rollout_key(prefix, rollout_id)
        before = await client.hgetall(key)
        start = time.perf_counter()
        await store.put(entries[PUT_TURN])
        put_ms.append((time.perf_counter() - start) * 1000)
        after = await client.hgetall(key)
        written = {name: value for name, value in after.items() if before.get(name) != value}
        if not trial % 2:
            await bare(trial)
    await store.close()
    await client.aclose()
    size = sum(len(name) + len(value) for name, value in written.items())
    return {"put_ms": put_ms, "hset_ms": hset_ms, "fields": len(written), "bytes": size}


async def child_load(
    url: str, prefix: str, rollouts: int, turns: int, cluster: bool = False
) -> dict[str, Any]:
    """``rollouts`` rollouts at once, each putting its calls in order, after a "go" line.

    ``cluster`` is passed only when set, so a baseline tree from before Cluster runs this too.
    """
    work = [
        [as_front_end_hands(entry) for entry in synthetic_rollout(f"load-{n}", turns, seed=n)]
        for n in range(rollouts)
    ]
    on_cluster = {"cluster": True} if cluster else {}
    store = RedisTokenStore(url=url, key_prefix=prefix, **on_cluster)
    await store.check()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def one(entries: list[Any]) -> None:
        for entry in entries:
            await store.put(entry)

    started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
    cpu = time.process_time()
    await asyncio.gather(*(one(entries) for entries in work))
    ended = time.monotonic()
    cpu = time.process_time() - cpu
    await store.close()
    return {"puts": rollouts * turns, "started": started, "ended": ended, "cpu_s": cpu}


def _child(tree: Path, *args: str, stdin: int | None = None) -> subprocess.Popen:
    """This file's child mode, importing the code under test from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        env=env,
        cwd=tree,
        stdin=stdin,
        stdout=subprocess.PIPE,
        text=True,
    )


def _reply(proc: subprocess.Popen) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench child {proc.pid} exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def run_put(tree: Path, url: str, prefix: str, trials: int) -> dict[str, Any]:
    proc = _child(tree, "put", url, prefix, str(trials))
    try:
        return _reply(proc)
    finally:
        stop_process(proc)


def run_together(count: int, start: Callable[[int], subprocess.Popen]) -> list[dict[str, Any]]:
    """``count`` load children (``start(n)``): each says it is ready, then all are told to
    go at once; their replies. Every child is stopped by PID, also on failure."""
    procs: list[subprocess.Popen] = []
    try:
        for n in range(count):
            procs.append(start(n))
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"bench child {proc.pid} did not get ready")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return [_reply(proc) for proc in procs]
    finally:
        for proc in procs:
            stop_process(proc)


def run_load(tree: Path, url: str, prefix: str, turns: int) -> dict[str, float]:
    """Durable puts/s of LOAD_PROCESSES processes x LOAD_ROLLOUTS rollouts, one common start."""
    replies = run_together(
        LOAD_PROCESSES,
        lambda n: _child(
            tree, "load", url, f"{prefix}p{n}", str(LOAD_ROLLOUTS), str(turns), stdin=-1
        ),
    )
    seconds = max(r["ended"] for r in replies) - min(r["started"] for r in replies)
    puts = sum(r["puts"] for r in replies)
    cpu_ms = sum(r["cpu_s"] for r in replies) * 1000 / puts
    return {"puts": puts, "seconds": seconds, "rate": puts / seconds, "cpu_ms": cpu_ms}


def compare_puts(url: str, trees: dict[str, Path], trials: int, rounds: int, turns: int) -> None:
    """The put figures of every tree, alternating between trees round by round."""
    put_ms: dict[str, list[float]] = {name: [] for name in trees}
    hset_ms: dict[str, list[float]] = {name: [] for name in trees}
    load: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    written = ""
    for number in range(rounds):
        for name, tree in trees.items():
            prefix = f"cmp{number}{name}"
            got = run_put(tree, url, prefix, trials)
            put_ms[name] += got["put_ms"]
            hset_ms[name] += got["hset_ms"]
            written = f"{got['fields']} fields, {got['bytes']} bytes"
        for name, tree in trees.items():
            load[name].append(run_load(tree, url, f"load{number}{name}", turns))
    print()
    bare = statistics.median([ms for values in hset_ms.values() for ms in values])
    print(
        f"put of the 27,000-token entry (adds 500 tokens) vs a bare HSET of what it wrote "
        f"({written}), appendfsync always; {rounds} rounds x {trials} trials per tree:"
    )
    for name in trees:
        p50 = statistics.median(put_ms[name])
        own = statistics.median(hset_ms[name])
        print(
            f"  {name:>8}: put p50 {p50:.2f} ms, its interleaved bare HSET p50 {own:.2f} ms: "
            f"put / HSET = {p50 / own:.2f}x (against all trees' HSET {bare:.2f} ms: "
            f"{p50 / bare:.2f}x)"
        )
    print(
        f"durable puts/s, {LOAD_PROCESSES} processes x {LOAD_ROLLOUTS} rollouts x {turns} calls "
        f"(context 2,000 to {2_000 + 500 * (turns - 1):,} tokens), median of {rounds} runs:"
    )
    rates = {}
    for name in trees:
        runs = sorted(load[name], key=lambda run: run["rate"])
        middle = runs[len(runs) // 2]
        rates[name] = middle["rate"]
        print(
            f"  {name:>8}: {middle['rate']:.0f} puts/s ({middle['puts']} puts in "
            f"{middle['seconds']:.2f} s; client CPU {middle['cpu_ms']:.2f} ms per put); "
            "all runs: " + ", ".join(f"{run['rate']:.0f}" for run in load[name])
        )
    if "baseline" in rates:
        print(f"  this tree / baseline = {rates['this'] / rates['baseline']:.2f}x")
    print("targets: put p50 <= 1.5x the bare HSET; puts/s >= 2x the baseline")


async def main(url: str, args: argparse.Namespace) -> None:
    if not args.skip_table:
        kinds = [STORE_KINDS["file"], redis_kind(url)]
        rows = [await bench_store(kind, n) for kind in kinds for n in args.turns]
        print_table(rows)
        p50 = await put_27k(kinds, args.trials)
        print()
        print(
            f"put p50 of one 27,000-token entry ({args.trials} trials): "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in p50.items())
            + f"; file / redis = {p50['file'] / p50['redis']:.2f}x"
        )
    trees = {"this": THIS_TREE}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    compare_puts(url, trees, args.trials, args.rounds, args.load_turns)


def child_main(argv: list[str]) -> None:
    mode, url, prefix, *rest = argv
    if mode == "put":
        result = asyncio.run(child_put(url, prefix, int(rest[0])))
    else:
        result = asyncio.run(child_load(url, prefix, int(rest[0]), int(rest[1])))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2:])
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--trials", type=int, default=21)
    parser.add_argument("--baseline", help="another checkout to compare with (its root)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per tree")
    parser.add_argument("--load-turns", type=int, default=20, help="calls per load rollout")
    parser.add_argument("--skip-table", action="store_true", help="only the put figures")
    parser.add_argument(
        "--prompts",
        choices=("packed", "lists"),
        default="packed",
        help="prompts as each tree's front end hands them (packed where it can), or lists",
    )
    args = parser.parse_args()
    os.environ[PROMPTS_ENV] = args.prompts
    if os.environ.get("REDIS_URL"):
        asyncio.run(main(os.environ["REDIS_URL"], args))
    else:
        with tempfile.TemporaryDirectory(prefix="tokcap-bench-redis-") as data_dir:
            server = RedisServer(Path(data_dir)).start()
            try:
                asyncio.run(main(server.url, args))
            finally:
                server.stop()
