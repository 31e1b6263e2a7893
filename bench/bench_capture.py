"""Capture and rebuild on a synthetic agent rollout: put latency, bytes stored, freeze+rebuild.

Run: ``.venv/bin/python -m bench.bench_capture`` (``--turns 50 200 --repeat 5``; issue 13:
``--compare /tmp/base13 --turns 50 200 1000 --repeat 3``).

The rollout is what an agent loop sends: a 2,000-token system prompt, then per turn 200
generated and 300 tool-output tokens, ids drawn from a 151,000-token vocabulary (seeded).
Every call re-sends the whole history, so a naive store grows with turns x context.

Each figure is printed next to a baseline measured in the same run, as a ratio, because
absolute times on a shared machine drift:
- put p50 vs a bare write+fsync of the same number of bytes in the same directory;
- stored bytes vs the raw final context (4 bytes per id + 8 bytes per generated log-prob);
- freeze + rebuild vs the decode floor (unpack the final context once, one list per call's
  prompt: the least any reader must do to hand the builder its entries).

``--compare TREE`` (say a ``git worktree add /tmp/base HEAD`` made before a change) measures
the issue-13 figures of this tree and of ``TREE`` in the same run, each in fresh child
processes that import their own tree's ``capture``: CPU per put (``time.process_time``) over
all puts and over the last 10% (the longest contexts), freeze + rebuild time and the peak RSS
of a process that only opens the store, freezes and rebuilds; then the growth exponent of
time and memory between the shortest and the longest rollout (log ratio of the figure / log
ratio of the final context). A tree with ``PackedIds`` also puts a second rollout whose
prompts come packed, as the front end hands them to tokcap's stores ("packed prompts"), and
the CPU of a bare append + fsync from a worker thread, interleaved: the floor of any durable
put made from the event loop.

Another store gets a column by adding a ``StoreKind`` to ``STORE_KINDS`` (say, Redis: an
``open`` that connects to a scratch server and a ``stored_bytes`` that sums MEMORY USAGE of
the rollout's key), or by calling ``bench_store(kind, turns)`` from another script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.build.builder import run_builder
from capture.codec.entries import encode_entry
from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry
from tests.support.rollouts import growing_rollout

SYSTEM_TOKENS = 2_000
GENERATED_PER_TURN = 200
TOOL_PER_TURN = 300
VOCAB = 151_000
FINAL_ANSWER = {
    "type": "message",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "All tests pass.", "annotations": []}],
}
TARGETS = {"put_p50_ms": 2.0, "bytes_ratio": 1.5, "rebuild_ms": {50: 50.0, 200: 200.0}}
# Issue 13: freeze + rebuild time (ms) and peak RSS (MB) by turns; CPU per put (ms).
TARGETS_13 = {"rebuild_ms": {200: 100.0, 1000: 500.0}, "rss_mb": {1000: 150.0}, "put_cpu_ms": 0.25}


@dataclass(frozen=True)
class StoreKind:
    """How to open one kind of store in a scratch place and measure what it holds."""

    name: str
    open: Callable[[Path], Awaitable[Any]]  # scratch dir -> an open sink/source
    stored_bytes: Callable[[Any, Path, str], Awaitable[int]]  # (store, dir, rollout) -> bytes


async def _open_file_store(scratch: Path) -> FileTokenStore:
    return FileTokenStore(scratch / "captures")


async def _file_store_bytes(store: Any, scratch: Path, rollout_id: str) -> int:
    root = scratch / "captures"
    return sum(path.stat().st_size for path in root.iterdir() if path.is_file())


STORE_KINDS: dict[str, StoreKind] = {
    "file": StoreKind("file", _open_file_store, _file_store_bytes),
}


def synthetic_rollout(rollout_id: str, turns: int, seed: int = 0) -> list[TokenEntry]:
    """The agent loop described in the module docstring, as the server would capture it."""
    return growing_rollout(
        rollout_id,
        turns,
        system_tokens=SYSTEM_TOKENS,
        generated_per_turn=GENERATED_PER_TURN,
        tool_tokens_per_turn=TOOL_PER_TURN,
        vocab=VOCAB,
        seed=seed,
        final_item=FINAL_ANSWER,
    )


def raw_final_context_bytes(entries: list[TokenEntry]) -> int:
    """The training payload itself: every id of the final context + generated log-probs."""
    last = entries[-1]
    ids = len(last.prompt_token_ids) + len(last.generation_token_ids)
    generated = sum(len(e.generation_token_ids) for e in entries)
    return 4 * ids + 8 * generated


def new_bytes_per_put(entries: list[TokenEntry]) -> list[int]:
    """Bytes each put adds under block sharing: its body plus the blocks not seen before."""
    seen: set[str] = set()
    sizes = []
    for entry in entries:
        encoded = encode_entry(entry)
        fresh = [(name, block) for name, block in encoded.blocks if name not in seen]
        seen.update(name for name, _ in fresh)
        sizes.append(len(encoded.body) + sum(len(block) for _, block in fresh))
    return sizes


class FsyncBaseline:
    """A bare append + fsync of a given byte count: the floor of any durable put.

    Interleaved with the puts, so both see the same disk and the same neighbours.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / "fsync-baseline.bin"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write_ms(self, size: int) -> float:
        payload = os.urandom(size)
        start = time.perf_counter()
        os.write(self.fd, payload)
        os.fsync(self.fd)
        return (time.perf_counter() - start) * 1000

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


def decode_floor_ms(entries: list[TokenEntry]) -> float:
    """The least a reader must do to hand the builder its entries.

    Unpack the final context once, then give every call its own prompt list (a copy of
    shared int objects, as a store that unpacks each block once does) and its generation.
    """
    last = entries[-1]
    packed = array("I", last.prompt_token_ids + last.generation_token_ids).tobytes()
    generations = [array("I", e.generation_token_ids).tobytes() for e in entries]
    lengths = [len(e.prompt_token_ids) for e in entries]
    start = time.perf_counter()
    context = array("I", packed).tolist()
    for length, generation in zip(lengths, generations, strict=True):
        context[:length]
        array("I", generation).tolist()
    return (time.perf_counter() - start) * 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench_store(kind: StoreKind, turns: int, repeat: int = 5) -> dict[str, Any]:
    """Figures of one store kind at one rollout length (all measured in this call)."""
    rollout_id = f"bench-{kind.name}-{turns}"
    entries = synthetic_rollout(rollout_id, turns)
    final_answer = [dict(entries[-1].output_items[0])]
    with tempfile.TemporaryDirectory(
        prefix="tokcap-bench-", dir=os.environ.get("BENCH_DIR")
    ) as tmp:
        scratch = Path(tmp)
        sizes = new_bytes_per_put(entries)
        baseline = FsyncBaseline(scratch)
        sink = await kind.open(scratch)
        put_ms, baseline_ms = [], []
        try:
            for entry, size in zip(entries, sizes, strict=True):
                await sink.begin_call(rollout_id, entry.model_call_id)
                start = time.perf_counter()
                await sink.put(entry)
                put_ms.append((time.perf_counter() - start) * 1000)
                baseline_ms.append(baseline.write_ms(size))
        finally:
            baseline.close()
        try:
            stored = await kind.stored_bytes(sink, scratch, rollout_id)
        finally:
            await sink.close()

        # The trainer's side: its own source object, as a separate process would have.
        rebuild_ms, freeze_ms, build_ms, floor_ms = [], [], [], []
        for _ in range(repeat):
            floor_ms.append(decode_floor_ms(entries))
            source = await kind.open(scratch)
            try:
                start = time.perf_counter()
                snapshot = await source.freeze(rollout_id)
                frozen = time.perf_counter()
                build = run_builder(snapshot, final_answer=final_answer)
                done = time.perf_counter()
            finally:
                await source.close()
            freeze_ms.append((frozen - start) * 1000)
            build_ms.append((done - frozen) * 1000)
            rebuild_ms.append((done - start) * 1000)
        if build.masked or len(build.main_chain) != turns:
            raise RuntimeError(f"rebuild went wrong: {build.mask_reasons or build.main_chain}")
    raw = raw_final_context_bytes(entries)
    return {
        "store": kind.name,
        "turns": turns,
        "final_context_tokens": len(entries[-1].prompt_token_ids) + GENERATED_PER_TURN,
        "put_p50_ms": statistics.median(put_ms),
        "put_p95_ms": percentile(put_ms, 0.95),
        "fsync_p50_ms": statistics.median(baseline_ms),
        "stored_bytes": stored,
        "raw_bytes": raw,
        "freeze_ms": statistics.median(freeze_ms),
        "build_ms": statistics.median(build_ms),
        "rebuild_ms": statistics.median(rebuild_ms),
        "rebuild_first_ms": rebuild_ms[0],
        "decode_floor_ms": statistics.median(floor_ms),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'store':6} {'turns':>5} {'ctx tok':>8} | {'put p50':>8} {'p95':>7} "
        f"{'fsync':>7} {'x':>5} | {'stored MB':>9} {'raw MB':>7} {'x':>5} | "
        f"{'freeze':>7} {'build':>7} {'f+b':>7} {'floor':>7} {'x':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['store']:6} {r['turns']:>5} {r['final_context_tokens']:>8} | "
            f"{r['put_p50_ms']:>6.2f}ms {r['put_p95_ms']:>5.2f}ms {r['fsync_p50_ms']:>5.2f}ms "
            f"{r['put_p50_ms'] / max(r['fsync_p50_ms'], 1e-9):>5.2f} | "
            f"{r['stored_bytes'] / 1e6:>9.3f} {r['raw_bytes'] / 1e6:>7.3f} "
            f"{r['stored_bytes'] / r['raw_bytes']:>5.2f} | "
            f"{r['freeze_ms']:>5.1f}ms {r['build_ms']:>5.1f}ms {r['rebuild_ms']:>5.1f}ms "
            f"{r['decode_floor_ms']:>5.1f}ms {r['rebuild_ms'] / max(r['decode_floor_ms'], 1e-9):>5.2f}"
        )
    print()
    print(
        "x columns: put p50 / bare write+fsync p50; stored / raw final context "
        "(4 B per id + 8 B per generated log-prob); freeze+build / decode floor."
    )
    for r in rows:
        rebuild_target = TARGETS["rebuild_ms"].get(r["turns"])
        checks = [
            f"put p50 {r['put_p50_ms']:.2f} ms (target <= {TARGETS['put_p50_ms']})",
            f"bytes x{r['stored_bytes'] / r['raw_bytes']:.2f} (target <= {TARGETS['bytes_ratio']})",
        ]
        if rebuild_target:
            checks.append(f"freeze+rebuild {r['rebuild_ms']:.1f} ms (target <= {rebuild_target})")
        print(f"{r['store']} @ {r['turns']} turns: " + "; ".join(checks))


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--stores", nargs="+", default=list(STORE_KINDS), choices=list(STORE_KINDS))
    parser.add_argument("--repeat", type=int, default=5, help="freeze+rebuild repetitions")
    parser.add_argument("--compare", help="a baseline source tree: issue-13 figures of both")
    parser.add_argument("--child", choices=("put", "rebuild"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return await child_main(args)
    if args.compare:
        return compare_main(args)
    rows = []
    for name in args.stores:
        for turns in args.turns:
            rows.append(await bench_store(STORE_KINDS[name], turns, args.repeat))
    print_table(rows)
    return 0


def lazy_rollout(rollout_id: str, turns: int, seed: int = 0) -> Iterator[TokenEntry]:
    """``synthetic_rollout`` one entry at a time (the same draws, hence the same ids), so a
    1,000-turn rollout is never held whole: that alone would be every prompt, 2 GB."""
    import random

    rng = random.Random(f"{seed}-{rollout_id}")
    context = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    for turn in range(turns):
        generation = [rng.randrange(VOCAB) for _ in range(GENERATED_PER_TURN)]
        log_probs = [-rng.random() * 5 for _ in range(GENERATED_PER_TURN)]
        last = turn == turns - 1
        item = FINAL_ANSWER if last else {}
        if not last:
            item = {"type": "function_call", "name": "bash", "call_id": f"t{turn}"}
            item["arguments"] = "{}"
        yield TokenEntry(
            rollout_id=rollout_id,
            model_call_id=f"turn-{turn:05d}",
            model="test-policy",
            prompt_token_ids=list(context),
            generation_token_ids=generation,
            generation_log_probs=log_probs,
            output_items=[item],
            token_item_index=0,
            created_at=1_700_000_000.0 + turn,
        )
        context += generation + [rng.randrange(VOCAB) for _ in range(TOOL_PER_TURN)]


async def child_put(directory: Path, turns: int) -> dict[str, Any]:
    """CPU per put of this tree's file store, writing a rollout for ``child_rebuild``; then,
    where the tree has ``PackedIds``, of a second rollout whose prompts come packed, as the
    front end's id check hands them to tokcap's stores (after, so it does not disturb the
    first figure)."""
    try:
        from capture.codec.packed import PackedIds
    except ImportError:  # a tree before packed prompts
        PackedIds = None  # noqa: N806
    store = FileTokenStore(directory)
    floor = FsyncBaseline(directory)
    cpu_ms: dict[str, list[float]] = {"put": [], "floor": [], "put_packed": []}

    async def put(name: str, entry: TokenEntry) -> None:
        await store.begin_call(entry.rollout_id, entry.model_call_id)
        start = time.process_time()
        await store.put(entry)
        cpu_ms[name].append((time.process_time() - start) * 1000)

    try:
        for entry in lazy_rollout("r", turns):
            # The CPU floor of any durable put from the event loop: a worker thread's
            # append + fsync of about what a call adds (ids, log-probs, body).
            start = time.process_time()
            await asyncio.to_thread(floor.write_ms, 4096)
            cpu_ms["floor"].append((time.process_time() - start) * 1000)
            await put("put", entry)
        for entry in lazy_rollout("p", turns) if PackedIds is not None else ():
            prompt = PackedIds.of(entry.prompt_token_ids)
            await put("put_packed", entry.model_copy(update={"prompt_token_ids": prompt}))
    finally:
        await store.close()
        floor.close()
    figures = {}
    for name, values in cpu_ms.items():
        if values:
            tail = values[-max(1, len(values) // 10) :]
            figures[f"{name}_cpu_p50_ms"] = statistics.median(values)
            figures[f"{name}_cpu_tail_ms"] = statistics.median(tail)
    return figures


async def child_rebuild(directory: Path, turns: int, repeat: int) -> dict[str, Any]:
    """Freeze + rebuild of the stored rollout in a process that does nothing else."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, freeze_ms = [], []
    for _ in range(repeat):
        store = FileTokenStore(directory)
        try:
            start = time.perf_counter()
            snapshot = await store.freeze("r")
            frozen = time.perf_counter()
            build = run_builder(snapshot, final_answer=[FINAL_ANSWER])
            times.append((time.perf_counter() - start) * 1000)
            freeze_ms.append((frozen - start) * 1000)
        finally:
            await store.close()
        if build.masked or len(build.main_chain) != turns:
            raise RuntimeError(f"rebuild went wrong: {build.mask_reasons}")
        del snapshot, build
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "rebuild_ms": statistics.median(times),
        "freeze_ms": statistics.median(freeze_ms),
        "rss_mb": peak,
        "rss_start_mb": before,
    }


def _run_child(tree: Path, args: list[str]) -> dict[str, Any]:
    """This script in a fresh process importing ``tree``'s code (ahead of the editable
    install), so a baseline tree and this one are measured the same way."""
    boot = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    command = [sys.executable, "-c", boot, str(tree), __file__, *args]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"child {args} in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_tree(tree: Path, turns: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokcap-13-", dir=os.environ.get("BENCH_DIR")) as tmp:
        where = ["--dir", str(Path(tmp) / "captures"), "--turns", str(turns)]
        figures = _run_child(tree, ["--child", "put", *where])
        figures |= _run_child(tree, ["--child", "rebuild", *where, "--repeat", str(repeat)])
    return figures | {"context": SYSTEM_TOKENS + turns * (GENERATED_PER_TURN + TOOL_PER_TURN)}


def _exponent(rows: dict[int, dict[str, Any]], key: str) -> float:
    low, high = rows[min(rows)], rows[max(rows)]
    return math.log(high[key] / low[key]) / math.log(high["context"] / low["context"])


def print_comparison(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Each figure of the baseline tree and of this one, side by side, with the targets."""
    names = list(results)
    keys = ("put_cpu_p50_ms", "put_cpu_tail_ms", "freeze_ms", "rebuild_ms", "rss_mb")
    print(f"{'turns':>5} {'ctx':>7} | " + " | ".join(f"{k:>22}" for k in keys))
    print(f"{'':>13} | " + " | ".join(f"{names[0]:>10} {names[-1]:>11}" for _ in keys))
    for turns in results[names[-1]]:
        before, after = results[names[0]][turns], results[names[-1]][turns]
        cells = [f"{before[k]:>10.2f} {after[k]:>11.2f}" for k in keys]
        print(f"{turns:>5} {after['context']:>7} | " + " | ".join(cells))
    for name, rows in results.items():
        if len(rows) > 1:
            print(
                f"{name}: growth exponent {min(rows)}->{max(rows)} turns: time "
                f"{_exponent(rows, 'rebuild_ms'):.2f} (freeze alone "
                f"{_exponent(rows, 'freeze_ms'):.2f}), peak RSS {_exponent(rows, 'rss_mb'):.2f}"
            )
    rows = results[names[-1]]
    for turns, figures in rows.items():
        checks = [
            f"put CPU tail {figures['put_cpu_tail_ms']:.3f} ms (<= {TARGETS_13['put_cpu_ms']})"
        ]
        if "put_packed_cpu_tail_ms" in figures:
            checks.append(
                f"packed prompts: p50 {figures['put_packed_cpu_p50_ms']:.3f}, "
                f"tail {figures['put_packed_cpu_tail_ms']:.3f} ms"
            )
        if "floor_cpu_p50_ms" in figures:
            floor = figures["floor_cpu_p50_ms"]
            checks.append(f"durable-write floor {floor:.3f} ms")
            if "put_packed_cpu_tail_ms" in figures:
                checks.append(
                    f"packed above the floor: p50 {figures['put_packed_cpu_p50_ms'] - floor:.3f}, "
                    f"tail {figures['put_packed_cpu_tail_ms'] - floor:.3f} ms"
                )
        if turns in TARGETS_13["rebuild_ms"]:
            checks.append(
                f"rebuild {figures['rebuild_ms']:.0f} ms (<= {TARGETS_13['rebuild_ms'][turns]:.0f})"
            )
        if turns in TARGETS_13["rss_mb"]:
            checks.append(
                f"peak RSS {figures['rss_mb']:.0f} MB (<= {TARGETS_13['rss_mb'][turns]:.0f})"
            )
        print(f"{names[-1]} @ {turns} turns: " + "; ".join(checks))
    if 200 in rows and 1000 in rows:
        ratio = rows[1000]["rebuild_ms"] / rows[200]["rebuild_ms"]
        limit = rows[1000]["context"] / rows[200]["context"]
        print(f"{names[-1]}: rebuild 1000/200 = {ratio:.1f} (<= context ratio {limit:.1f})")


async def child_main(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if args.child == "put":
        figures = await child_put(directory, args.turns[0])
    else:
        figures = await child_rebuild(directory, args.turns[0], args.repeat)
    print(json.dumps(figures))
    return 0


def compare_main(args: argparse.Namespace) -> int:
    trees = {"baseline": Path(args.compare), "this": Path(__file__).resolve().parents[1]}
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in trees}
    for turns in args.turns:
        for name, tree in trees.items():  # interleaved, so both see the same machine
            results[name][turns] = measure_tree(tree, turns, args.repeat)
            print(f"measured {name} @ {turns} turns: {results[name][turns]}", flush=True)
    print_comparison(results)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
