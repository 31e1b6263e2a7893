"""Throughput of paced tool loops through one front end over 1, 2 and 4 engines, against the
same loops sent straight to the same engines (issue 34). A figure, never a test assertion.

For each engine count, that many paced ``tokcap engine`` processes (``--first-token-s``,
then ``--token-s`` a token) and one ``tokcap serve --workers N`` over all of them (file
store) are started; then, ``--trials`` times in turn, ``--loops`` concurrent OpenAI-Chat
tool loops of ``--turns`` calls run straight to the engines (the baseline: a client-side
round robin by rollout, each rollout's calls on one engine) and through the front end on
the rollouts' capture paths (the pool places each rollout). Each set-up's median trial is
shown: calls/s and generated tokens/s (the engines' ``usage``), and their ratio to the
baseline measured in the same run. Through tokcap, the engines' ground truth says where
each call was sampled: each engine's share of the calls, and how many rollouts had calls
sampled by two engines (the bounded-load rule moved them). The tokcap engine paces every
call on its own, with no batch limit, so the baseline does not grow with the engine count:
the ratio is what the pool costs, on the same cores as the engines and the loops.

    .venv/bin/python -m bench.bench_pool [--loops 100] [--turns 4] [--engines 1 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from bench.bench_serving import answered, turn_body
from tests.support.pool_loops import engine_pool, placement, tokcap_serve

CHAT = "/v1/chat/completions"


@dataclass
class Trial:
    """One set of loops: how long they took, what they got, what went wrong."""

    seconds: float
    calls: int
    tokens: int
    errors: Counter[str]

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def tool_loop(http: aiohttp.ClientSession, url: str, rollout: str, turns: int) -> Trial:
    """One rollout's loop to its end or first error: its calls and generated tokens."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Rollout {rollout}: list the directories one by one."}
    ]
    calls = tokens = 0
    errors: Counter[str] = Counter()
    for turn in range(turns):
        try:
            async with http.post(url, json=turn_body(messages, turn, turns)) as response:
                if response.status != 200:
                    errors[f"{response.status} {(await response.text())[:100]}"] += 1
                    break
                reply = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors[type(exc).__name__] += 1
            break
        message = reply["choices"][0]["message"]
        calls += 1
        tokens += reply["usage"]["completion_tokens"]
        answered(messages, message)
    return Trial(0.0, calls, tokens, errors)


async def run_loops(url_of: Callable[[int, str], str], rollouts: list[str], turns: int) -> Trial:
    """Every rollout's loop at once (``url_of(index, rollout)`` is where its calls go)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started = time.monotonic()
        done = await asyncio.gather(
            *(tool_loop(http, url_of(n, r), r, turns) for n, r in enumerate(rollouts))
        )
        seconds = time.monotonic() - started
    return Trial(
        seconds,
        sum(t.calls for t in done),
        sum(t.tokens for t in done),
        sum((t.errors for t in done), Counter()),
    )


def median(trials: list[Trial]) -> Trial:
    """The trial of median throughput (so a burst of other work on the cores is left out)."""
    return sorted(trials, key=lambda t: t.calls_per_s)[len(trials) // 2]


@dataclass
class Row:
    """One engine count's figures."""

    engines: int
    direct: Trial
    tokcap: Trial
    split: int  # rollouts (of the last tokcap trial) sampled by more than one engine
    shares: list[float]  # each engine's share of that trial's calls, by its ground truth


async def measure(args: argparse.Namespace, tmp: Path, count: int) -> Row:
    """Direct and through tokcap, alternating, on the same ``count`` engines."""
    pace = (args.first_token_s, args.token_s)
    direct: list[Trial] = []
    through: list[Trial] = []
    with engine_pool(tmp, count, pace) as engines:
        urls = [engine.url for engine in engines]
        store = tmp / "store"
        with tokcap_serve(tmp, store, urls, workers=args.workers) as served:
            path = f"{served.url}/ng-rollout/{{}}/training-token-capture{CHAT}"

            def captured(_: int, rollout: str) -> str:
                return path.format(rollout)

            for trial in range(args.trials):
                straight = [f"direct-{count}-{trial}-{n}" for n in range(args.loops)]
                direct.append(
                    await run_loops(lambda n, _: urls[n % count] + CHAT, straight, args.turns)
                )
                pooled = [f"pool-{count}-{trial}-{n}" for n in range(args.loops)]
                through.append(await run_loops(captured, pooled, args.turns))
        truths = {engine.url: engine.truth() for engine in engines}
    placed = await placement(store, pooled, truths)
    sampled = Counter(engine for r in pooled for engine in placed.engines_of(r))
    total = sum(sampled.values()) or 1
    shares = sorted((sampled[url] / total for url in urls), reverse=True)
    return Row(count, median(direct), median(through), len(placed.split()), shares)


def table(rows: list[Row]) -> Table:
    out = Table(title="tool loops through one front end over a pool of engines")
    columns = ("engines", "direct calls/s", "tokcap calls/s", "ratio", "direct tok/s")
    columns += ("tokcap tok/s", "ratio", "errors", "split", "calls per engine")
    for column in columns:
        out.add_column(column, justify="right")
    for row in rows:
        d, t = row.direct, row.tokcap
        errors = d.errors.total() + t.errors.total()
        out.add_row(
            str(row.engines),
            f"{d.calls_per_s:.1f}",
            f"{t.calls_per_s:.1f}",
            f"{t.calls_per_s / d.calls_per_s:.2f}",
            f"{d.tokens_per_s:.0f}",
            f"{t.tokens_per_s:.0f}",
            f"{t.tokens_per_s / d.tokens_per_s:.2f}",
            str(errors),
            str(row.split),
            " / ".join(f"{share:.0%}" for share in row.shares),
        )
    return out


async def main_async(args: argparse.Namespace) -> None:
    console = Console(width=150)
    console.print(
        f"{args.loops} loops x {args.turns} calls, engines paced {args.first_token_s} s to the "
        f"first token then {args.token_s} s a token, tokcap serve --workers {args.workers}, "
        f"{args.trials} alternating trials (median shown), {os.cpu_count()} cores"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokcap-bench-pool-") as scratch:
        for count in args.engines:
            tmp = Path(scratch) / f"engines-{count}"
            tmp.mkdir()
            rows.append(await measure(args, tmp, count))
    console.print(table(rows))
    for row in rows:
        for error, n in (row.direct.errors + row.tokcap.errors).most_common(3):
            console.print(f"  {row.engines} engine(s): {n} x {error}")
    ratios = [row.tokcap.calls_per_s / row.direct.calls_per_s for row in rows]
    console.print(
        f"tokcap / direct calls/s: median {statistics.median(ratios):.2f} (load average now "
        f"{os.getloadavg()[0]:.1f}; the engines, the front end and the loops share the cores)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=100, help="concurrent tool loops")
    parser.add_argument("--turns", type=int, default=4, help="calls per loop")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workers", type=int, default=2, help="tokcap serve workers")
    parser.add_argument("--first-token-s", type=float, default=0.5)
    parser.add_argument("--token-s", type=float, default=0.02)
    parser.add_argument("--trials", type=int, default=3, help="alternating runs per set-up")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
