"""``tokcap demo``: the whole pipeline on this machine, with nothing but the install.

It starts the tokcap engine twice (faithful serving, and lossy serving whose sampled
segmentation is sometimes not canonical), a front end in front of each, and the rebuild
workers over a private redis-server (or, without redis-server, the file store and an
in-process rebuild). It then drives multi-turn tool-using rollouts through the official
``anthropic`` SDK with streaming, as Claude Code would, rebuilds them, and prints per
rollout what was delivered beside what a re-tokenization of the transcript would have got.
One more rollout's harness edits its final answer, so no call produced it: that rollout is
masked, and the table says why, as it flags every rollout that delivered less than half of
what was sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from capture import capture_base_url
from tokcap_devtools.processes import Service, free_port
from tokcap_devtools.redis_server import RedisServer, redis_server_binary

MODEL = "tokcap-engine"
SYSTEM = "You are a careful agent. Use the tools, then answer."
TOOLS = [
    {
        "name": "list_files",
        "description": "List the files in a directory.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
    {
        "name": "word_count",
        "description": "Count the words of a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file": {"type": "string"}},
            "required": ["file"],
        },
    },
]
TASKS = [
    "Which files are in the project, and how long is the README?",
    "Count the words of the design notes.",
    "List the source directory and summarise what you find.",
    "Find the longest file in the docs folder.",
    "Check whether the tests directory has a conftest file.",
    "How many words are in the changelog?",
]
# Below this delivered fraction most sampled tokens did not reach the trainer: flagged.
LOW_DELIVERY = 0.5
LOW_MARK = "!"
EDIT_NOTE = "\n\n(Checked by the harness.)"  # what the editing harness adds to its answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts to run (default 6)")
    parser.add_argument("--workers", type=int, default=2, help="rebuild worker processes")
    parser.add_argument(
        "--store",
        choices=["auto", "redis", "file"],
        default="auto",
        help="auto: Redis when redis-server is installed, else the file store",
    )
    parser.add_argument(
        "--lossy-rate",
        type=float,
        default=0.1,
        help="non-canonical segmentation rate of the lossy engine (default 0.1)",
    )
    parser.add_argument(
        "--edited",
        type=int,
        default=1,
        help="extra rollouts whose harness edits its final answer, so they are masked (default 1)",
    )
    parser.add_argument("--max-turns", type=int, default=6, help="tool rounds per rollout")
    parser.add_argument("--seed", type=int, default=7, help="the engine's sampling seed")
    parser.add_argument("--workdir", default=None, help="keep logs and data here")
    parser.add_argument("--json", action="store_true", help="print the per-rollout rows as JSON")


@dataclass
class Backend:
    """Where captures go and how rollouts get rebuilt."""

    kind: str
    capture_block: dict[str, Any]
    redis: RedisServer | None = None
    store_dir: Path | None = None
    services: list[Service] = field(default_factory=list)


@dataclass
class Row:
    rollout_id: str
    serving: str
    turns: int
    edits_answer: bool = False  # the harness changed its final answer before returning it
    record: dict[str, Any] = field(default_factory=dict)
    ids_exact: bool | None = False  # None: nothing was delivered (masked)
    retokenized_wrong: int = 0
    sampled_tokens: int = 0
    truth: list[dict[str, Any]] = field(default_factory=list)  # what the engine sampled


def _frontend_config(path: Path, upstream: str, capture_block: dict[str, Any]) -> Path:
    document = {
        "model_server": {
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


def _start_serving(
    name: str, workdir: Path, backend: Backend, engine_args: list[str]
) -> tuple[str, str]:
    """Start an engine and a front end in front of it; returns (engine url, front-end url)."""
    engine_port, front_port = free_port(), free_port()
    engine = Service(
        f"engine-{name}",
        "tokcap_devtools.engine.cli",
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(engine_port),
            "--model",
            MODEL,
            "--policy",
            "random",
            "--ground-truth",  # the demo compares every delivered id with what was sampled
            *engine_args,
        ],
        workdir,
    )
    backend.services.append(engine)
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine.wait_ready(engine_url + "/health")
    config = _frontend_config(workdir / f"frontend-{name}.yaml", engine_url, backend.capture_block)
    front = Service(
        f"frontend-{name}",
        "tokcap.commands.serve",
        ["--config", str(config), "--host", "127.0.0.1", "--port", str(front_port)],
        workdir,
    )
    backend.services.append(front)
    front_url = f"http://127.0.0.1:{front_port}"
    front.wait_ready(front_url + "/health")
    # The front end's start-up probe sampled too; the rollouts' ground truth starts now.
    httpx.delete(engine_url + "/tokcap/ground_truth", timeout=30).raise_for_status()
    return engine_url, front_url


def _run_tool(name: str, arguments: dict[str, Any]) -> str:
    """Deterministic stand-ins for real tools: the harness side of the loop."""
    text = json.dumps(arguments, sort_keys=True)
    if name == "list_files":
        return "README.md\nsrc/\ndocs/\ntests/conftest.py\n" + text
    return f"{len(text) * 7} words in {arguments.get('file', 'the file')}"


async def _drive(
    front_url: str, rollout_id: str, task: str, max_turns: int, edits_answer: bool = False
) -> tuple[dict[str, Any], int]:
    """One harness run over Anthropic Messages, streamed; returns (record, turns)."""
    client = anthropic.AsyncAnthropic(
        base_url=capture_base_url(front_url, rollout_id), api_key="demo", max_retries=0
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    final: Any = None
    turns = 0
    try:
        while turns < max_turns:
            turns += 1
            async with client.messages.stream(
                model=MODEL, max_tokens=512, system=SYSTEM, tools=TOOLS, messages=messages
            ) as stream:
                final = await stream.get_final_message()
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in final.content],
                }
            )
            calls = [b for b in final.content if b.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": _tool_results(calls)})
    finally:
        await client.close()
    output = _output_of(final)
    if edits_answer:
        # The harness returns its own text, not the model's: no call produced this answer.
        text = output[0]["content"][0]["text"]
        output = [_message(text + EDIT_NOTE)]
    record = {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "transcript": messages,
        "response": {"id": f"resp_{rollout_id}", "object": "response", "output": output},
    }
    return record, turns


def _tool_results(calls: list[Any]) -> list[dict[str, Any]]:
    return [
        {"type": "tool_result", "tool_use_id": b.id, "content": _run_tool(b.name, b.input)}
        for b in calls
    ]


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _output_of(final: Any) -> list[dict[str, Any]]:
    """The harness's answer as Responses items: its text, then any tool calls left open."""
    blocks = final.content if final else []
    output = [_message("".join(b.text for b in blocks if b.type == "text"))]
    for block in blocks:
        if block.type == "tool_use":
            output.append(
                {
                    "type": "function_call",
                    "call_id": block.id,
                    "name": block.name,
                    "arguments": json.dumps(block.input),
                }
            )
    return output


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


def _carriers(record: dict[str, Any]) -> list[dict[str, Any]]:
    output = (record.get("response") or {}).get("output") or []
    return [i for i in output if isinstance(i, dict) and "generation_token_ids" in i]


def _check(row: Row, engine: httpx.Client) -> None:
    """Delivered ids vs the engine's sampled ids; and what re-tokenizing the text gets wrong."""
    sampled = {(tuple(g["prompt_token_ids"]), tuple(g["token_ids"])): g for g in row.truth}
    carriers = _carriers(row.record)
    if row.record.get("mask_sample") and not carriers:
        row.ids_exact = None  # masked: nothing was delivered, so nothing can be wrong
    else:
        row.ids_exact = bool(carriers) and all(
            (key := (tuple(c["prompt_token_ids"]), tuple(c["generation_token_ids"]))) in sampled
            and sampled[key]["logprobs"] == c["generation_log_probs"]
            for c in carriers
        )
    for call in row.truth:
        text = engine.post("/detokenize", json={"tokens": call["token_ids"]}).json()["prompt"]
        again = engine.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
            "tokens"
        ]
        matcher = difflib.SequenceMatcher(a=call["token_ids"], b=again, autojunk=False)
        matched = sum(block.size for block in matcher.get_matching_blocks())
        row.retokenized_wrong += len(call["token_ids"]) - matched
        row.sampled_tokens += len(call["token_ids"])


def short_reasons(reasons: list[str]) -> str:
    """Mask reasons without their details: each reason's head, before the first colon.

    ``incomplete capture: call c-7: marked incomplete`` becomes ``incomplete capture``; the
    call ids and errors stay in the record (and in ``--json``).
    """
    heads = dict.fromkeys(reason.split(": ", 1)[0].strip() for reason in reasons)
    return "; ".join(head for head in heads if head) or "-"


def _delivered_cell(fraction: float) -> Text:
    if fraction < LOW_DELIVERY:
        return Text(f"{fraction:.2f} {LOW_MARK}", style="bold yellow")
    return Text(f"{fraction:.2f}  ")


def _ids_cell(row: Row) -> str:
    if row.ids_exact is None:
        return "-"
    return "yes" if row.ids_exact else "NO"


COLUMNS = (
    "rollout",
    "serving",
    "turns",
    "calls",
    "chains",
    "delivered",
    "mask",
    "why masked",
    "ids = sampled",
    "re-tokenized wrong",
)
_LEFT = ("rollout", "serving", "why masked")
_WRAPS = {"why masked": 22, "ids = sampled": 7, "re-tokenized wrong": 12}  # max widths
EDITED = "+edit"  # serving label suffix of a rollout whose harness edits its final answer


def _table(rows: list[Row], backend: str) -> Table:
    table = Table(title=f"tokcap demo: {len(rows)} rollouts, rebuilt via {backend}")
    for name in COLUMNS:
        table.add_column(
            name,
            justify="left" if name in _LEFT else "right",
            # Free text and long headers wrap; ids and numbers stay on one line.
            no_wrap=name not in _WRAPS,
            max_width=_WRAPS.get(name),
        )
    for row in rows:
        metrics = _metrics(row)
        table.add_row(
            row.rollout_id,
            row.serving + (EDITED if row.edits_answer else ""),
            str(row.turns),
            str(metrics.get("n_calls", "-")),
            str(metrics.get("chains", "-")),
            _delivered_cell(metrics.get("delivered_fraction", 0.0)),
            "yes" if row.record.get("mask_sample") else "no",
            short_reasons(metrics.get("mask_reasons") or []),
            _ids_cell(row),
            f"{row.retokenized_wrong} of {row.sampled_tokens}",
        )
    return table


def _notes(rows: list[Row]) -> str:
    """What the table's columns and marks mean; the edit and low-delivery marks only when
    they show."""
    notes = []
    if any(r.edits_answer for r in rows):
        notes.append(
            f"faithful{EDITED}: faithful serving, but the harness edits its final answer before "
            "returning it, so no call produced that answer and the rollout is masked."
        )
    notes += [
        "ids = sampled: every token-bearing item equals a sequence the engine sampled (ids "
        "and log-probs); - when the rollout is masked and nothing was delivered.",
        "re-tokenized wrong: sampled ids that detokenize + tokenize of the same text does not "
        "reproduce.",
        "Lossy serving splits chains; they are reported (chains, delivered), never delivered "
        "wrong.",
        "why masked: the record's _ng_token_capture.mask_reasons, without call ids and "
        "details (--json has them whole). A masked rollout is left out of the loss.",
    ]
    low = [r for r in rows if _metrics(r).get("delivered_fraction", 0.0) < LOW_DELIVERY]
    if low:
        notes.append(
            f"{LOW_MARK} delivered below {LOW_DELIVERY}: most sampled tokens did not reach the "
            "trainer (they are in chains that were not delivered, or the rollout was masked)."
        )
    return "\n".join(notes)


def _metrics(row: Row) -> dict[str, Any]:
    return row.record.get("_ng_token_capture") or {}


def _json_rows(rows: list[Row]) -> str:
    return json.dumps(
        [
            {
                "rollout_id": r.rollout_id,
                "serving": r.serving,
                "edits_answer": r.edits_answer,
                "turns": r.turns,
                "metrics": r.record.get("_ng_token_capture"),
                "mask_sample": r.record.get("mask_sample"),
                "ids_exact": r.ids_exact,
                "retokenized_wrong": r.retokenized_wrong,
                "sampled_tokens": r.sampled_tokens,
            }
            for r in rows
        ]
    )


def _plan(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """(serving, harness edits its answer) per rollout: faithful and lossy by turns, then
    the editing harness on faithful serving."""
    plain = [("faithful" if n % 2 == 0 else "lossy", False) for n in range(args.rollouts)]
    return plain + [("faithful", True)] * args.edited


async def _drive_all(
    args: argparse.Namespace, servings: dict[str, tuple[str, str]], progress: Progress
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Drive every planned rollout, one at a time; returns its rows and finished records."""
    plan = _plan(args)
    driving = progress.add_task("driving rollouts (anthropic SDK, streaming)", total=len(plan))
    rows, records = [], []
    for n, (serving, edits_answer) in enumerate(plan):
        rollout_id = f"demo{n}-{uuid.uuid4().hex[:4]}"
        engine_url, front_url = servings[serving]
        record, turns = await _drive(
            front_url, rollout_id, TASKS[n % len(TASKS)], args.max_turns, edits_answer
        )
        records.append(record)
        # Rollouts run one at a time, so the engine's log since the last one is this one.
        async with httpx.AsyncClient(base_url=engine_url, timeout=30) as engine:
            truth = (await engine.get("/tokcap/ground_truth")).json()
            await engine.delete("/tokcap/ground_truth")
        rows.append(Row(rollout_id, serving, turns, edits_answer, truth=truth))
        progress.advance(driving)
    return rows, records


async def _run_rollouts(
    args: argparse.Namespace, workdir: Path, backend: Backend, console: Console
) -> list[Row]:
    """Start the servings, drive and rebuild every rollout, and check what was delivered."""
    with Progress(console=console, transient=True) as progress:
        starting = progress.add_task("starting engines and front ends", total=2)
        servings = {}
        for name, knobs in (
            ("faithful", []),
            ("lossy", ["--noncanonical-rate", str(args.lossy_rate)]),
        ):
            servings[name] = _start_serving(
                name, workdir, backend, ["--seed", str(args.seed), *knobs]
            )
            progress.advance(starting)
        rows, records = await _drive_all(args, servings, progress)
        rebuilt = await _rebuild(backend, records, progress)
    for row, record in zip(rows, rebuilt, strict=True):
        row.record = record
    with httpx.Client(base_url=servings["faithful"][0], timeout=30) as engine:
        for row in rows:
            _check(row, engine)
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
    if args.json:
        console.print_json(_json_rows(rows))
    else:
        console.print(_table(rows, "Redis + worker pool" if kind == "redis" else "file store"))
        console.print(_notes(rows), highlight=False)
    # Every delivered rollout carries the sampled ids; a masked one delivered nothing.
    return 0 if all(r.ids_exact is not False for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_main(args, workdir, console))
    with tempfile.TemporaryDirectory(prefix="tokcap-demo-") as tmp:
        return asyncio.run(_main(args, Path(tmp), console))
