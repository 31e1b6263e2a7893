"""Redis store figures beside the file store's, on bench_capture's synthetic rollout (not a test).

Run: ``.venv/bin/python bench/bench_redis.py`` (starts a private redis-server with AOF and
``appendfsync always`` in a temp dir, unless ``REDIS_URL`` is set).

Prints bench_capture's table with a ``redis`` row per rollout length (stored bytes are Redis
``MEMORY USAGE`` of the rollout's key), then the put of one 27,000-token entry (the turn
that brings the rollout to 27,000 prompt tokens, into a rollout holding the earlier turns),
timed for both stores in alternation so both see the same disk and the same neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.bench_capture import (
    STORE_KINDS,
    StoreKind,
    bench_store,
    print_table,
    synthetic_rollout,
)
from tokcap.redis_server import RedisServer
from transports.redis import RedisTokenStore
from transports.redis.keys import rollout_key

PUT_TURN = 50  # 2,000 system tokens + 50 turns x 500 = 27,000 prompt tokens


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


async def main(url: str, turns: list[int], trials: int) -> None:
    kinds = [STORE_KINDS["file"], redis_kind(url)]
    rows = [await bench_store(kind, n) for kind in kinds for n in turns]
    print_table(rows)
    p50 = await put_27k(kinds, trials)
    print()
    print(
        f"put p50 of one 27,000-token entry ({trials} trials): "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in p50.items())
        + f"; file / redis = {p50['file'] / p50['redis']:.2f}x"
    )
    print(
        "targets: redis put p50 <= 1.0 ms and >= 3x faster than the file store; "
        "redis bytes <= 1.5x the raw final context at 200 turns"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--trials", type=int, default=21)
    args = parser.parse_args()
    if os.environ.get("REDIS_URL"):
        asyncio.run(main(os.environ["REDIS_URL"], args.turns, args.trials))
    else:
        with tempfile.TemporaryDirectory(prefix="tokcap-bench-redis-") as data_dir:
            server = RedisServer(Path(data_dir)).start()
            try:
                asyncio.run(main(server.url, args.turns, args.trials))
            finally:
                server.stop()
