"""The store and the rebuild queue on a 3-master Redis Cluster against one Redis (not a test).

Run: ``.venv/bin/python -m bench.bench_cluster [--rounds 2]``. It starts, in temp dirs on
127.0.0.1, one redis-server and a cluster of 3 masters with 1 replica each (every node with
AOF and ``appendfsync always``), and stops them by PID at the end. Rounds alternate between
the two targets, in the same run on the same machine; figures are medians over rounds:

- durable puts/s: ``--procs`` processes x ``--rollouts`` rollouts at once, each rollout
  putting its ``--turns`` calls in order (bench_capture's synthetic rollout), durability
  ``fsync`` on both (on the cluster, every master proves it); the clock runs from a common
  start until the last put returns;
- rebuilt rollouts/s: ``--jobs`` rollouts written, then ``--workers`` ``tokcap worker``
  processes (concurrency 4; on the cluster ``--cluster --shards 3``) started, every job
  submitted at once, the clock running until the last result is on the results streams.

The ratio cluster / single is printed for both. On a small machine every node shares the
same cores, so the point is that the cluster scales out without loss, not a speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_capture import FINAL_ANSWER, synthetic_rollout
from bench.bench_redis import child_load, run_together
from tokcap_devtools.processes import stop_process
from tokcap_devtools.redis_cluster import LocalCluster
from tokcap_devtools.redis_server import RedisServer
from transports.rebuild.jobs import RebuildQueue, open_client
from transports.redis import RedisTokenStore
from transports.redis import keys as k

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SHARDS = 3


class Target:
    """Where a round runs: one Redis, or the cluster (with its shard count)."""

    def __init__(self, name: str, url: str, cluster: bool) -> None:
        self.name, self.url, self.cluster = name, url, cluster
        self.shards = CLUSTER_SHARDS if cluster else 1

    def flags(self) -> list[str]:
        return ["--cluster", "--shards", str(self.shards)] if self.cluster else []


# -- durable puts/s, one child process per load process ---------------------------------


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def puts_per_s(target: Target, prefix: str, args: argparse.Namespace) -> float:
    flag = "1" if target.cluster else "0"
    replies = run_together(
        args.procs,
        lambda n: _child(target.url, flag, f"{prefix}p{n}", str(args.rollouts), str(args.turns)),
    )
    seconds = max(r["ended"] for r in replies) - min(r["started"] for r in replies)
    return sum(r["puts"] for r in replies) / seconds


# -- rebuilt rollouts/s, with tokcap worker processes -----------------------------------


def finished(rollout_id: str) -> dict[str, Any]:
    return {"_ng_rollout_id": rollout_id, "response": {"output": [FINAL_ANSWER]}}


async def _written(target: Target, prefix: str, rollout_ids: list[str], turns: int) -> None:
    async with RedisTokenStore(url=target.url, cluster=target.cluster, key_prefix=prefix) as store:
        for n, rollout_id in enumerate(rollout_ids):
            await asyncio.gather(*(store.put(e) for e in synthetic_rollout(rollout_id, turns, n)))


async def _rebuilt_in(target: Target, prefix: str, rollout_ids: list[str]) -> float:
    """Submit every job at once; seconds until every result is on the results streams."""
    streams = k.shard_streams(k.stream_names(prefix), target.shards, tagged=target.cluster)
    jobs = k.stream_names(prefix).jobs
    client = open_client(target.url, target.cluster)
    async with RebuildQueue(
        client=client, stream=jobs, shards=target.shards, cluster=target.cluster
    ) as queue:
        for s in streams:  # the workers have joined every shard's group
            while not await client.exists(s.jobs):
                await asyncio.sleep(0.05)
        started = time.monotonic()
        for rollout_id in rollout_ids:
            await queue.submit(finished(rollout_id))
        while sum([await client.xlen(s.results) for s in streams]) < len(rollout_ids):
            await asyncio.sleep(0.01)
        seconds = time.monotonic() - started
    await client.aclose()
    return seconds


def rebuilt_per_s(target: Target, prefix: str, args: argparse.Namespace) -> float:
    rollout_ids = [f"job-{n}" for n in range(args.jobs)]
    asyncio.run(_written(target, prefix, rollout_ids, args.turns))
    command = [sys.executable, "-m", "tokcap.commands.worker", "--key-prefix", prefix]
    command += ["--concurrency", "4", "--block-ms", "100", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKCAP_REDIS_URL": target.url}
    workers = [
        subprocess.Popen([*command, *target.flags()], env=env, cwd=ROOT)
        for _ in range(args.workers)
    ]
    try:
        seconds = asyncio.run(_rebuilt_in(target, prefix, rollout_ids))
    finally:
        for worker in workers:
            stop_process(worker)
    return len(rollout_ids) / seconds


# -- the run ----------------------------------------------------------------------------


def run(targets: list[Target], args: argparse.Namespace) -> None:
    puts: dict[str, list[float]] = {t.name: [] for t in targets}
    rebuilt: dict[str, list[float]] = {t.name: [] for t in targets}
    for number in range(args.rounds):
        for target in targets:
            puts[target.name].append(puts_per_s(target, f"put{number}", args))
            rebuilt[target.name].append(rebuilt_per_s(target, f"reb{number}", args))
            print(
                f"round {number + 1} {target.name}: {puts[target.name][-1]:.0f} puts/s, "
                f"{rebuilt[target.name][-1]:.1f} rebuilt rollouts/s",
                flush=True,
            )
    print()
    print(
        f"durable puts/s ({args.procs} procs x {args.rollouts} rollouts x {args.turns} calls, "
        f"appendfsync always) and rebuilt rollouts/s ({args.jobs} rollouts of {args.turns} "
        f"calls, {args.workers} workers x 4), medians of {args.rounds} rounds, {os.cpu_count()} "
        "cores shared by every process:"
    )
    medians = {}
    for target in targets:
        medians[target.name] = (
            statistics.median(puts[target.name]),
            statistics.median(rebuilt[target.name]),
        )
        put_rate, rebuild_rate = medians[target.name]
        print(f"  {target.name:>28}: {put_rate:.0f} puts/s, {rebuild_rate:.1f} rollouts/s")
    (single, cluster) = (medians[t.name] for t in targets)
    print(
        f"  cluster / single: puts {cluster[0] / single[0]:.2f}x, "
        f"rebuilds {cluster[1] / single[1]:.2f}x"
    )


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tokcap-bench-cluster-") as tmp:
        single = RedisServer(Path(tmp) / "single")
        single.data_dir.mkdir()
        cluster = LocalCluster(Path(tmp) / "cluster")
        try:
            single.start()
            cluster.start()
            targets = [
                Target("one Redis", single.url, cluster=False),
                Target("cluster, 3 masters + 3 replicas", cluster.url, cluster=True),
            ]
            run(targets, args)
        finally:
            cluster.stop()
            single.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        url, flag, prefix, rollouts, turns = sys.argv[2:]
        reply = asyncio.run(child_load(url, prefix, int(rollouts), int(turns), flag == "1"))
        print(json.dumps(reply), flush=True)
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per target")
    parser.add_argument("--procs", type=int, default=4, help="put processes")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per put process")
    parser.add_argument("--turns", type=int, default=10, help="calls per rollout")
    parser.add_argument("--jobs", type=int, default=200, help="rollouts rebuilt per round")
    parser.add_argument("--workers", type=int, default=2, help="tokcap worker processes")
    main(parser.parse_args())
