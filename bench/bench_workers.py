"""Rollouts rebuilt per second by 1 and 2 rebuild worker processes (not a test).

A private redis-server (AOF, appendfsync always) on a free port holds synthetic tool-using
rollouts (each call's prompt extends the previous prompt + generation with tool output).
For each worker count the rollouts are written fresh, the workers are started and have
joined the consumer group, then every job is submitted at once; the clock runs from the
first submit until the last job is acked. Worker start-up is not counted.

    .venv/bin/python bench/bench_workers.py [--rollouts 40] [--turns 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from capture.records import TokenEntry
from tests.support.rollouts import growing_rollout
from tokcap_devtools.processes import Service
from tokcap_devtools.redis_server import RedisServer
from transports.rebuild.jobs import RebuildQueue
from transports.rebuild.results import decode_result, ensure_group
from transports.redis import RedisTokenStore
from transports.redis.keys import stream_names


def rollout_entries(rollout_id: str, args: argparse.Namespace) -> list[TokenEntry]:
    final = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": f"done {rollout_id}"}],
    }
    return growing_rollout(
        rollout_id,
        args.turns,
        system_tokens=args.system,
        generated_per_turn=args.gen,
        tool_tokens_per_turn=args.tool,
        final_item=final,
    )


async def populate(url: str, prefix: str, rollout_ids: list[str], args) -> None:
    store = RedisTokenStore(url=url, key_prefix=prefix)
    try:

        async def one(rollout_id: str) -> None:
            for entry in rollout_entries(rollout_id, args):
                await store.put(entry)

        await asyncio.gather(*(one(rollout_id) for rollout_id in rollout_ids))
    finally:
        await store.close()


async def measure(url: str, workers: int, args, log_dir: str, trial: int = 0) -> dict[str, float]:
    prefix = f"bench{workers}t{trial}"
    jobs, results, dead = stream_names(prefix)
    rollout_ids = [f"r{workers}t{trial}-{n:04d}" for n in range(args.rollouts)]
    await populate(url, prefix, rollout_ids, args)
    client = aioredis.Redis.from_url(url)
    await ensure_group(client, jobs, "rebuild")
    procs: list[Service] = []
    try:
        for n in range(workers):
            procs.append(
                Service(
                    f"w{workers}-{n}",
                    "tokcap.commands.worker",
                    [
                        "--url",
                        url,
                        "--key-prefix",
                        prefix,
                        "--consumer",
                        f"w{n}",
                        "--concurrency",
                        str(args.concurrency),
                        "--block-ms",
                        "50",
                        "--log-level",
                        "warning",
                    ],
                    Path(log_dir),
                )
            )
        while len(await client.xinfo_consumers(jobs, "rebuild")) < workers:
            if any(proc.proc.poll() is not None for proc in procs):
                sys.exit(f"a worker exited early; see {log_dir}")
            await asyncio.sleep(0.05)
        async with RebuildQueue(client=client, stream=jobs) as queue:
            started = time.perf_counter()
            for rollout_id in rollout_ids:
                await queue.submit(
                    {
                        "_ng_rollout_id": rollout_id,
                        "reward": 1.0,
                        "response": {
                            "output": [
                                {
                                    "type": "message",
                                    "role": "assistant",
                                    "content": [
                                        {"type": "output_text", "text": f"done {rollout_id}"}
                                    ],
                                }
                            ]
                        },
                    }
                )
        while True:
            done = await client.xlen(results)
            pending = (await client.xpending(jobs, "rebuild"))["pending"]
            if done >= args.rollouts and pending == 0 and await client.xlen(jobs) == 0:
                break
            if any(proc.proc.poll() is not None for proc in procs):
                sys.exit(f"a worker exited early; see {log_dir}")
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
        result_bytes = await client.memory_usage(results) or 0
        entries = await client.xrange(results)
        masked = [f for _, f in entries if f[b"masked"] == b"1"]
        if masked:
            reasons = decode_result("0-0", masked[0])["_ng_token_capture"].get("mask_reasons")
            print(f"{len(masked)} masked with {workers} worker(s), e.g.: {reasons}")
        return {
            "workers": workers,
            "seconds": elapsed,
            "rate": args.rollouts / elapsed,
            "dead": await client.xlen(dead),
            "masked": len(masked),
            "result_kib": result_bytes / args.rollouts / 1024,
        }
    finally:
        for proc in procs:
            proc.stop()
        await client.aclose()


async def main_async(args: argparse.Namespace) -> None:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tokcap-bench-") as tmp:
        server = RedisServer(Path(tmp)).start()
        url = server.url
        try:
            final = args.system + args.turns * (args.gen + args.tool)
            console.print(
                f"{args.rollouts} rollouts x {args.turns} turns (final context "
                f"{final} tokens), {os.cpu_count()} cores, concurrency "
                f"{args.concurrency} per worker"
            )
            # Alternate the two set-ups and keep each one's median run, so a burst of other
            # work on the shared cores does not land on one side only.
            runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
            for trial in range(args.trials):
                for workers in (1, 2):
                    runs[workers].append(await measure(url, workers, args, tmp, trial))
            rows = [sorted(runs[w], key=lambda row: row["rate"])[args.trials // 2] for w in (1, 2)]
        finally:
            server.stop()
    table = Table(title="rebuild workers")
    for column in ("workers", "seconds", "rollouts/s", "result KiB/rollout", "masked", "dead"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["workers"]),
            f"{row['seconds']:.2f}",
            f"{row['rate']:.1f}",
            f"{row['result_kib']:.0f}",
            str(row["masked"]),
            str(row["dead"]),
        )
    console.print(table)
    console.print(f"median of {args.trials} alternating runs each")
    console.print(
        f"speed-up 2 vs 1 workers: {rows[1]['rate'] / rows[0]['rate']:.2f}x "
        f"(load average now {os.getloadavg()[0]:.1f}; other work on the cores "
        "lowers it)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--system", type=int, default=500, help="system prompt tokens")
    parser.add_argument("--gen", type=int, default=20, help="generated tokens per turn")
    parser.add_argument("--tool", type=int, default=30, help="tool output tokens per turn")
    parser.add_argument("--concurrency", type=int, default=2, help="jobs at once per worker")
    parser.add_argument("--trials", type=int, default=5, help="alternating runs per set-up")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
