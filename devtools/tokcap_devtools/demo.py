"""``tokcap demo``: the whole pipeline on this machine, with nothing but the install.

It starts one tokcap engine on the real Qwen3 vocabulary and chat template that now and then
samples a segmentation other than the tokenizer's canonical one, as real engines do, and
two front ends in front of it: one with faithful prompts, one with text prompts (the
README's two prompt modes). The rebuild workers run over a private redis-server (or,
without redis-server, the file store and an in-process rebuild). It drives multi-turn
tool-using rollouts through the official ``anthropic`` SDK, streamed as Claude Code streams
(``demo_harness``), spread over training steps (rollout ids ``step{N}.demo{n}-...``) with
the policy version one step behind, as an asynchronous trainer runs. It rebuilds them,
checks every delivered id against what the engine sampled, and prints per rollout what was
delivered beside what re-tokenizing the transcript would have got, then a summary line
(``demo_rows``). One more rollout's harness edits its final answer, so no call produced it:
that rollout is masked, and the table says why. Last it writes ``tokcap report``'s views of
the rebuilt records, the trend over the steps among them, to a directory it names
(``demo_report``): what a training run is watched by, on rollouts just made.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.progress import Progress

from tokcap_devtools.demo_harness import MODEL, TASKS, drive
from tokcap_devtools.demo_report import OUT_DEFAULT, write_report
from tokcap_devtools.demo_rows import Row, check, json_rows, notes, summary, table
from tokcap_devtools.processes import Service, free_port
from tokcap_devtools.redis_server import RedisServer, redis_server_binary

SERVINGS = ("faithful", "text")  # the front ends' prompts modes, in the README's words
CURRENT_VERSION_KEY = "_ng_current_policy_version"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rollouts", type=int, default=20, help="rollouts to run, faithful and text in turn"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="training steps the rollouts are spread over"
    )
    parser.add_argument("--workers", type=int, default=2, help="rebuild worker processes")
    parser.add_argument(
        "--store",
        choices=["auto", "redis", "file"],
        default="auto",
        help="auto: Redis when redis-server is installed, else the file store",
    )
    parser.add_argument(
        "--noncanonical-rate",
        "--lossy-rate",  # its name before the serving was named by its prompts mode
        dest="noncanonical_rate",
        type=float,
        default=0.1,
        help="per-token chance that the engine samples a non-canonical segmentation",
    )
    parser.add_argument(
        "--edited",
        type=int,
        default=1,
        help="extra rollouts whose harness edits its final answer, so they are masked",
    )
    parser.add_argument("--max-turns", type=int, default=6, help="tool rounds per rollout")
    parser.add_argument("--seed", type=int, default=7, help="the engine's sampling seed")
    parser.add_argument("--workdir", default=None, help="keep logs and data here")
    parser.add_argument(
        "--out",
        default=OUT_DEFAULT,
        help="write the report, its PNGs and the rebuilt records into this directory",
    )
    parser.add_argument("--json", action="store_true", help="print the per-rollout rows as JSON")


@dataclass
class Backend:
    """Where captures go and how rollouts get rebuilt."""

    kind: str
    capture_block: dict[str, Any]
    redis: RedisServer | None = None
    store_dir: Path | None = None
    services: list[Service] = field(default_factory=list)


def _frontend_config(
    path: Path, upstream: str, capture_block: dict[str, Any], serving: str
) -> Path:
    prompts: dict[str, Any] = {"prompts": serving}
    if serving == "faithful":  # the front end renders prompts on the engine's vocabulary
        prompts["renderer"] = {"tokenizer": "qwen3"}
    document = {
        "model_server": {
            **prompts,
            "upstream": upstream,
            "model": MODEL,
            # A harness sends no top_p and sometimes a temperature: pin sampling here.
            "sampling_overrides": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 512},
        },
        "token_id_capture": {"enabled": True, "rebuild_response": True, **capture_block},
    }
    path.write_text(yaml.safe_dump(document))
    return path


def _start_backend(kind: str, workdir: Path, workers: int) -> Backend:
    if kind == "redis":
        server = RedisServer(workdir / "redis")
        server.data_dir.mkdir(exist_ok=True)
        server.start()
        backend = Backend(
            "redis",
            {"sink": "transports.redis:RedisTokenSink", "sink_kwargs": {"url": server.url}},
            redis=server,
        )
        for n in range(workers):
            worker = Service(
                f"worker-{n}",
                "tokcap.commands.worker",
                ["--url", server.url, "--concurrency", "4", "--log-level", "warning"],
                workdir,
            )
            backend.services.append(worker)
        return backend
    store_dir = workdir / "captures"
    return Backend("file", {"dir": str(store_dir)}, store_dir=store_dir)


def _start_engine(workdir: Path, backend: Backend, args: argparse.Namespace) -> str:
    """The engine both front ends call; returns its URL."""
    port = free_port()
    engine = Service(
        "engine",
        "tokcap_devtools.engine.cli",
        [
            *("--host", "127.0.0.1", "--port", str(port), "--model", MODEL),
            *("--policy", "random", "--tokenizer", "qwen3", "--seed", str(args.seed)),
            *("--noncanonical-rate", str(args.noncanonical_rate)),
            "--ground-truth",  # the demo compares every delivered id with what was sampled
        ],
        workdir,
    )
    backend.services.append(engine)
    url = f"http://127.0.0.1:{port}"
    engine.wait_ready(url + "/health")
    return url


def _start_fronts(workdir: Path, backend: Backend, engine_url: str) -> dict[str, str]:
    """A front end per serving, each with its prompts mode, started together (they load
    their tokenizers at once); returns their URLs by serving."""
    started = {}
    for serving in SERVINGS:
        port = free_port()
        config = _frontend_config(
            workdir / f"frontend-{serving}.yaml", engine_url, backend.capture_block, serving
        )
        front = Service(
            f"frontend-{serving}",
            "tokcap.commands.serve",
            ["--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            workdir,
        )
        backend.services.append(front)
        started[serving] = (front, f"http://127.0.0.1:{port}")
    for front, url in started.values():
        front.wait_ready(url + "/health")
    return {serving: url for serving, (_, url) in started.items()}


async def _rebuild(
    backend: Backend, records: list[dict[str, Any]], progress: Progress
) -> list[dict[str, Any]]:
    """Rebuilt records, by rollout id: through the worker pool, or in this process."""
    task = progress.add_task("rebuilding", total=len(records))
    if backend.kind == "file":
        from capture import (
            FileTokenStore,
            finalize_rollout_token_capture,
            retire_rollout_token_capture,
        )

        store = FileTokenStore(backend.store_dir)
        try:
            for record in records:
                built = await finalize_rollout_token_capture(record, store)
                await retire_rollout_token_capture(built.rollout_id, store, built)
                progress.advance(task)
        finally:
            await store.close()
        return records
    from transports.rebuild.jobs import RebuildQueue
    from transports.rebuild.reader import ResultsReader

    assert backend.redis is not None
    async with RebuildQueue(url=backend.redis.url) as queue:
        for record in records:
            await queue.submit(record)
    rebuilt: dict[str, dict[str, Any]] = {}
    async with ResultsReader(url=backend.redis.url, group="demo", block_ms=500) as reader:
        deadline = asyncio.get_running_loop().time() + 120
        while len(rebuilt) < len(records):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"only {len(rebuilt)} of {len(records)} rollouts were rebuilt")
            for result in await reader.read():
                rebuilt[result["_ng_rollout_id"]] = result
                await reader.ack(result)  # the demo's "trainer" keeps it in memory
                progress.advance(task)
    return [rebuilt[r["_ng_rollout_id"]] for r in records]


def _plan(args: argparse.Namespace) -> list[tuple[int, str, bool]]:
    """(step, serving, harness edits its answer) per rollout: faithful and text in turn, then
    the editing harness on faithful serving; the steps in order, as many rollouts each as
    the count allows."""
    plan = [("faithful" if n % 2 == 0 else "text", False) for n in range(args.rollouts)]
    plan += [("faithful", True)] * args.edited
    return [(n * args.steps // len(plan), *kind) for n, kind in enumerate(plan)]


async def _set_version(fronts: dict[str, str], step: int) -> None:
    """The weights step ``step`` samples with: the step before's, one step off-policy as an
    asynchronous trainer runs (it trains step N on version N while the engines sample N+1)."""
    async with httpx.AsyncClient(timeout=30) as client:
        for url in fronts.values():
            answer = await client.put(
                url + "/tokcap/policy_version", json={"version": str(max(step - 1, 0))}
            )
            answer.raise_for_status()


async def _drive_all(
    args: argparse.Namespace, engine_url: str, fronts: dict[str, str], progress: Progress
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Drive every planned rollout, one at a time; returns its rows and finished records."""
    plan = _plan(args)
    driving = progress.add_task("driving rollouts (anthropic SDK, streaming)", total=len(plan))
    rows, records, step_now = [], [], None
    for n, (step, serving, edits_answer) in enumerate(plan):
        if step != step_now:
            await _set_version(fronts, step)
            step_now = step
        rollout_id = f"step{step}.demo{n}-{uuid.uuid4().hex[:4]}"
        record, turns = await drive(
            fronts[serving], rollout_id, TASKS[n % len(TASKS)], args.max_turns, edits_answer
        )
        record[CURRENT_VERSION_KEY] = str(step)  # the version the trainer is at for this step
        records.append(record)
        # Rollouts run one at a time, so the engine's log since the last one is this one.
        async with httpx.AsyncClient(base_url=engine_url, timeout=30) as engine:
            truth = (await engine.get("/tokcap/ground_truth")).json()
            await engine.delete("/tokcap/ground_truth")
        rows.append(Row(rollout_id, step, serving, turns, edits_answer, truth=truth))
        progress.advance(driving)
    return rows, records


async def _run_rollouts(
    args: argparse.Namespace, workdir: Path, backend: Backend, console: Console
) -> list[Row]:
    """Start the serving, drive and rebuild every rollout, and check what was delivered."""
    with Progress(console=console, transient=True) as progress:
        starting = progress.add_task("starting the engine and front ends", total=2)
        engine_url = _start_engine(workdir, backend, args)
        progress.advance(starting)
        fronts = _start_fronts(workdir, backend, engine_url)
        progress.advance(starting)
        # The front ends' start-up probes sampled too; the rollouts' ground truth starts now.
        httpx.delete(engine_url + "/tokcap/ground_truth", timeout=30).raise_for_status()
        rows, records = await _drive_all(args, engine_url, fronts, progress)
        rebuilt = await _rebuild(backend, records, progress)
    for row, record in zip(rows, rebuilt, strict=True):
        row.record = record
    with httpx.Client(base_url=engine_url, timeout=30) as engine:
        for row in rows:
            check(row, engine)
    return rows


async def _main(args: argparse.Namespace, workdir: Path, console: Console) -> int:
    kind = args.store
    if kind == "auto":
        kind = "redis" if redis_server_binary() else "file"
    backend = _start_backend(kind, workdir, args.workers)
    try:
        rows = await _run_rollouts(args, workdir, backend, console)
    finally:
        for service in reversed(backend.services):
            service.stop()
        if backend.redis is not None:
            backend.redis.stop()
    # With --json, stdout holds the rows alone; what a person reads goes to stderr.
    said = Console(stderr=True, width=console.width) if args.json else console
    if args.json:
        console.print_json(json_rows(rows))
    else:
        console.print(table(rows, "Redis + worker pool" if kind == "redis" else "file store"))
        console.print(notes(rows), highlight=False)
    said.print(summary(rows), highlight=False)
    said.print(write_report([row.record for row in rows], Path(args.out)), highlight=False)
    # Every delivered rollout carries the sampled ids; a masked one delivered nothing.
    return 0 if all(r.ids_exact is not False for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.steps < 1 or args.edited < 0:
        print(
            "tokcap demo: --rollouts and --steps must be 1 or more, --edited 0 or more",
            file=sys.stderr,
        )
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_main(args, workdir, console))
    with tempfile.TemporaryDirectory(prefix="tokcap-demo-") as tmp:
        return asyncio.run(_main(args, Path(tmp), console))
