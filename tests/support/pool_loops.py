"""Tool loops through one front end over a pool of engine processes (issue 34).

Each engine is a paced ``tokcap engine`` child on a port of its own, its ground truth in a
JSONL file that outlives a ``kill -9`` (a restart on the same port appends to it); the
front end is ``tokcap serve`` with several workers. Where a call was sampled is read from
the engines' ground truth, never from tokcap's metrics: a call was sampled by the engine
whose log holds its prompt and ids. Per-worker figures come from the workers' own
Prometheus files (``PROMETHEUS_MULTIPROC_DIR``, one file per worker PID), which the test
finds because ``tokcap serve`` makes that directory under the ``TMPDIR`` it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import yaml
from prometheus_client.multiprocess import MultiProcessCollector

from api.engine.pool import score
from capture.filestore.store import FileTokenStore
from tests.support.fault_loops import GroundTruth, Rollout, Tally, tool_loop, write_script
from tokcap_devtools.engine.ground_truth import read_jsonl
from tokcap_devtools.processes import free_port, process_tree, stop_process, wait_http

ROLLOUT_PATH = "/ng-rollout/"


@dataclass
class EngineProcess:
    """One paced ``tokcap engine`` child: started, killed and restarted on one port."""

    port: int
    truth_path: Path
    log_path: Path
    pace: tuple[float, float]  # seconds to the first token, then per token
    script: str
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        """Start the child (its output appended to its log); ``wait`` for it to answer."""
        args = [sys.executable, "-m", "tokcap_devtools.engine.cli", "--port", str(self.port)]
        args += ["--script", self.script, "--ground-truth", str(self.truth_path)]
        args += ["--first-token-s", str(self.pace[0]), "--token-s", str(self.pace[1])]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*args, "--log-level", "warning"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait(self, timeout: float = 60.0) -> None:
        try:
            wait_http(self.url + "/health", timeout=timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"engine {self.url}: {exc}\n{tail}") from None

    def kill9(self) -> None:
        """SIGKILL the child, by its PID: no reply it has in flight is finished."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def truth(self) -> list[dict[str, Any]]:
        """Every sequence this engine sampled, across its restarts."""
        return read_jsonl(self.truth_path) if self.truth_path.exists() else []


@contextlib.contextmanager
def engine_pool(
    tmp: Path, count: int, pace: tuple[float, float] = (0.1, 0.01)
) -> Iterator[list[EngineProcess]]:
    """``count`` paced engines, started at once (they import in parallel), all stopped by
    PID at the end, whatever a test did to them."""
    script = write_script(tmp / "script.yaml")
    engines = [new_engine(tmp, script, pace) for _ in range(count)]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def new_engine(tmp: Path, script: str, pace: tuple[float, float]) -> EngineProcess:
    """An engine not started yet, on a free port, logging under ``tmp``."""
    port = free_port()
    return EngineProcess(
        port, tmp / f"truth-{port}.jsonl", tmp / f"engine-{port}.log", pace, script
    )


@dataclass
class Served:
    """A running ``tokcap serve``: its URL, and where its workers keep their counters."""

    url: str
    temp_root: Path
    proc: subprocess.Popen

    def worker_calls(self) -> dict[str, Counter[str]]:
        """Calls each worker served, by engine: from each worker's own counter file."""
        found: dict[str, Counter[str]] = {}
        for path in sorted(self.temp_root.glob("tokcap-metrics-*/counter_*.db")):
            served: Counter[str] = Counter()
            for metric in MultiProcessCollector.merge([str(path)], accumulate=True):
                for sample in metric.samples:
                    labels = sample.labels
                    if sample.name == "tokcap_engine_calls_total" and (
                        labels.get("outcome") == "served"
                    ):
                        served[labels["engine"]] += int(sample.value)
            found[path.stem.removeprefix("counter_")] = served
        return found


def serve_config(store_dir: Path, upstream: list[str], engines_file: Path | None = None) -> str:
    """The YAML of a front end over ``upstream`` capturing to the file store."""
    server: dict[str, Any] = {"upstream": upstream}
    if engines_file is not None:
        server["engines_file"] = str(engines_file)
    capture = {"enabled": True, "dir": str(store_dir)}
    return yaml.safe_dump(
        {"model_server": server, "env": {"nemo_gym": {"token_id_capture": capture}}}
    )


@contextlib.contextmanager
def tokcap_serve(
    tmp: Path,
    store_dir: Path,
    upstream: list[str],
    *,
    workers: int = 2,
    engines_file: Path | None = None,
) -> Iterator[Served]:
    """``tokcap serve --workers N`` over the engines, stopped by PID at the end (uvicorn's
    supervisor stops its workers)."""
    config = tmp / "serve.yaml"
    config.write_text(serve_config(store_dir, upstream, engines_file))
    temp_root = tmp / "serve-tmp"  # the workers' counter directory is made here
    temp_root.mkdir(exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "tokcap.commands.serve", "--config", str(config)]
    args += ["--port", str(port), "--workers", str(workers), "--log-level", "warning"]
    log_path = tmp / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(temp_root)},
            start_new_session=True,
        )
    try:
        try:
            wait_http(url + "/health", timeout=120, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"tokcap serve: {exc}\n{tail}") from None
        yield Served(url, temp_root, proc)
    finally:
        stop_tree(proc)


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop ``tokcap serve`` by its PID (its supervisor stops the workers), then SIGKILL
    any worker of it still running, by the PIDs read before: none outlives the test."""
    workers = process_tree(proc.pid)[1:]
    stop_process(proc, timeout=20)
    for pid in workers:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if cmdline.startswith(sys.executable.encode()):  # still ours, not a reused PID
                os.kill(pid, signal.SIGKILL)


class RolloutTally(Tally):
    """The harness side's statuses, also per rollout (read off each call's capture path)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_rollout: dict[str, Counter[int]] = {}

    async def on_response(self, response: Any) -> None:
        await super().on_response(response)
        path = response.url.path
        if "/v1/messages" in path and path.startswith(ROLLOUT_PATH):
            rollout = path[len(ROLLOUT_PATH) :].split("/", 1)[0]
            self.by_rollout.setdefault(rollout, Counter())[response.status_code] += 1


def spreading_client(tally: Tally) -> Any:
    """The harnesses' HTTP client (the SDK's own kind), counting statuses like
    ``fault_loops.harness_client`` but opening a new connection per call: a kept-alive
    connection stays with the worker that accepted it, and a multi-worker server could
    accept every connection of a burst in one worker."""
    # The HTTP package the SDK's client class is built on (httpx, or its httpx2 fork).
    http = importlib.import_module(anthropic.DefaultAsyncHttpxClient.__mro__[1].__module__)
    return anthropic.DefaultAsyncHttpxClient(
        timeout=120.0,
        limits=http.Limits(max_keepalive_connections=0),
        event_hooks={"response": [tally.on_response]},
    )


async def run_harnesses(
    front: str, harnesses: list[list[Rollout]], http: Any, **options: Any
) -> list[Rollout]:
    """Each harness runs its rollouts one after another, as an RL worker runs episodes; all
    harnesses at once. The rollouts, in the order given."""

    async def harness(rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            await tool_loop(front, rollout, http, **options)

    await asyncio.gather(*(harness(rollouts) for rollouts in harnesses))
    return [rollout for rollouts in harnesses for rollout in rollouts]


def home(rollout_id: str, engines: Iterable[str]) -> str:
    """The engine rendezvous hashing gives the rollout among ``engines``."""
    return max(engines, key=lambda url: score(rollout_id, url))


@dataclass
class Call:
    """One captured call of a rollout: the engine its entry names, and the engines whose
    ground truth holds its prompt and ids (exactly one, when all is well)."""

    named: str
    sampled_by: list[str]
    created_at: float
    key: tuple  # its prompt ids, generated ids and log-probs (``sampled_key``)

    @property
    def faithful(self) -> bool:
        return self.sampled_by == [self.named]


@dataclass
class Placement:
    """Where each captured call of every rollout was sampled, from the engines' logs."""

    calls: dict[str, list[Call]] = field(default_factory=dict)  # rollout -> its calls, in order

    def unfaithful(self) -> list[str]:
        """Calls whose entry names another engine than the one that sampled them."""
        return [
            f"{rollout} call {n}: named {call.named}, sampled by {call.sampled_by}"
            for rollout, calls in self.calls.items()
            for n, call in enumerate(calls)
            if not call.faithful
        ]

    def engines_of(self, rollout: str) -> list[str]:
        """The engine that sampled each call of ``rollout``, in order ("?" if not one)."""
        return [
            call.sampled_by[0] if len(call.sampled_by) == 1 else "?"
            for call in self.calls.get(rollout, [])
        ]

    def unserved(self, truths: dict[str, list[dict[str, Any]]], since: float) -> list[str]:
        """Sequences an engine sampled after ``since`` that no captured call holds: calls
        sampled and then lost on the way. The probe's prompt (sent at start-up, before
        ``since``, and to an engine that joins later) is no loop's call."""
        captured = {call.key for calls in self.calls.values() for call in calls}
        records = [(url, record) for url, kept in truths.items() for record in kept]
        probes = {tuple(r["prompt_token_ids"]) for _, r in records if r["created"] < since}
        return [
            f"{url} {record['request_id']}"
            for url, record in records
            if record["created"] >= since
            and tuple(record["prompt_token_ids"]) not in probes
            and record_key(record) not in captured
        ]

    def split(self) -> list[str]:
        """Rollouts whose calls were sampled by more than one engine."""
        return [r for r in self.calls if len(set(self.engines_of(r))) > 1]


def sampled_key(prompt: Iterable[int], ids: Iterable[int], log_probs: Iterable[float]) -> tuple:
    """What identifies one sampled sequence in every engine's log: prompt, ids, log-probs."""
    return (tuple(prompt), tuple(ids), tuple(log_probs))


def record_key(record: dict[str, Any]) -> tuple:
    return sampled_key(record["prompt_token_ids"], record["token_ids"], record["logprobs"])


def truth_index(truths: dict[str, list[dict[str, Any]]]) -> dict[tuple, list[str]]:
    """(prompt ids, generated ids, log-probs) -> the engines that sampled exactly that."""
    index: dict[tuple, list[str]] = {}
    for url, records in truths.items():
        for record in records:
            index.setdefault(record_key(record), []).append(url)
    return index


async def placement(
    store_dir: Path, rollouts: Iterable[str], truths: dict[str, list[dict[str, Any]]]
) -> Placement:
    """Each rollout's captured calls, in order, judged against the engines' logs."""
    index = truth_index(truths)
    found = Placement()
    store = FileTokenStore(store_dir)
    try:
        for rollout in rollouts:
            snapshot = await store.freeze(rollout)
            entries = sorted(snapshot.entries, key=lambda entry: entry.created_at)
            calls = []
            for entry in entries:
                key = sampled_key(
                    entry.prompt_token_ids, entry.generation_token_ids, entry.generation_log_probs
                )
                named = (entry.model_extra or {}).get("engine", "?")
                calls.append(Call(named, sorted(set(index.get(key, []))), entry.created_at, key))
            found.calls[rollout] = calls
    finally:
        await store.close()
    return found


def merged_truth(tmp: Path, engines: Iterable[EngineProcess]) -> GroundTruth:
    """One ground truth over every engine's log, for ``fault_loops.judge``."""
    path = tmp / "merged-truth.jsonl"
    with open(path, "w", encoding="utf-8") as merged:
        for engine in engines:
            if engine.truth_path.exists():
                merged.write(engine.truth_path.read_text(encoding="utf-8"))
    return GroundTruth(path)


def ready_states(front: str) -> dict[str, str]:
    """Each engine's state as one worker's ``/ready`` shows it (a fresh connection)."""
    body = httpx.get(front + "/ready", timeout=10).json()
    return {row["engine"]: row["state"] for row in body.get("engines", [])}


async def wait_for_pool(
    front: str, want: dict[str, str], readings: int = 8, timeout: float = 30.0
) -> list[dict[str, str]]:
    """Until ``readings`` answers of ``/ready`` in a row show the pool as ``want``
    (engine -> state); each a fresh connection, so either worker may answer. Every
    answer read on the way, in order."""
    deadline = time.monotonic() + timeout
    seen: list[dict[str, str]] = []
    alike = 0
    while alike < readings:
        states = await asyncio.to_thread(ready_states, front)
        seen.append(states)
        alike = alike + 1 if states == want else 0
        if time.monotonic() > deadline:
            raise AssertionError(f"the pool never became {want}: last {states}")
        await asyncio.sleep(0.1)
    return seen
