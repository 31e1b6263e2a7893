"""Tool loops through one front end over a pool of engines, under faults (issue 34).

Paced ``tokcap engine`` processes sit behind one ``tokcap serve --workers 2`` (file store);
Anthropic-SDK tool loops (``tests.support.fault_loops``) run through it while the pool is
calm, while one engine is ``kill -9``'d and restarted on its port, and while the engines
file drops one engine and adds another. Where each call was sampled is read from the
engines' own ground truth (``tests.support.pool_loops``), never from tokcap's metrics, and
every rollout is rebuilt and judged as the fault suite judges it: no critical problem.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.engine.engines_file import WATCH_S
from api.engine.pool import REPROBE_S
from capture.filestore.store import FileTokenStore
from tests.support.fault_loops import Outcome, Rollout, judge, rebuild, run_loops
from tests.support.pool_loops import (
    EngineProcess,
    Placement,
    RolloutTally,
    engine_pool,
    home,
    merged_truth,
    placement,
    ready_states,
    run_harnesses,
    spreading_client,
    tokcap_serve,
    wait_for_pool,
)

pytestmark = pytest.mark.slow
PACE = (0.3, 0.02)  # seconds to the first token, then per token: about 1 s a call
HARNESSES, ROLLOUTS_EACH = 90, 5  # 450 rollouts of 2-4 calls, 90 at a time
# 450 rollouts over 3 engines: a share outside +-25% of even is a 3.7-sigma event of the hash.
EVEN_WITHIN = 0.25
FAULT_LOOPS, TURNS = 30, 12  # the fault scenarios: 30 loops of 12 calls
GATE_S = 120.0  # the longest a loop waits at a gate before the test fails


@dataclass
class Run:
    """One scenario's result: the loops, the judgement, and where each call was sampled."""

    engines: list[str]
    rollouts: list[Rollout]
    outcome: Outcome
    placement: Placement
    tally: RolloutTally
    truths: dict[str, list[dict[str, Any]]]
    unserved: list[str]  # what an engine sampled for the loops that no captured call holds
    notes: dict[str, Any] = field(default_factory=dict)

    def after_gate(self, rollout: Rollout, gate: int) -> list[str]:
        """The engines that sampled the rollout's calls from turn ``gate`` on."""
        return self.placement.engines_of(rollout.rollout_id)[gate:]


async def judged(
    tmp: Path,
    engines: list[EngineProcess],
    done: list[Rollout],
    tally: RolloutTally,
    fault: str,
    since: float,
) -> Run:
    """Where every call was sampled, each rollout rebuilt and judged, and what the engines
    sampled after ``since`` that no captured call holds."""
    truths = {engine.url: engine.truth() for engine in engines}
    placed = await placement(tmp / "store", [r.rollout_id for r in done], truths)
    store = FileTokenStore(tmp / "store")
    try:
        records = await rebuild(store, done)
    finally:
        await store.close()
    outcome = judge(fault, done, records, merged_truth(tmp, engines), tally)
    unserved = placed.unserved(truths, since)
    return Run([e.url for e in engines], done, outcome, placed, tally, truths, unserved)


class Gate:
    """Every loop waits before turn ``at`` until the scenario opens the gate, so the calls
    from that turn on are known to start after the pool changed."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.opened = asyncio.Event()
        self.opened_at = 0.0

    async def before_turn(self, rollout: Rollout, turn: int) -> None:
        if turn == self.at:
            await asyncio.wait_for(self.opened.wait(), GATE_S)

    def open(self) -> None:
        self.opened_at = time.time()
        self.opened.set()


async def once_answered(rollouts: list[Rollout], calls: int, limit_s: float = 60.0) -> None:
    """Wait until the loops were answered ``calls`` calls in all: the run is under way."""
    deadline = time.monotonic() + limit_s
    while sum(len(r.answered) for r in rollouts) < calls:
        assert time.monotonic() < deadline, "the loops did not get under way"
        await asyncio.sleep(0.05)


async def alongside(gate: Gate, scenario: Callable[[], Awaitable[None]]) -> None:
    """Run the scenario's steps, and open the gate whatever happens (no loop waits on)."""
    try:
        await scenario()
    finally:
        gate.open()


async def down_state(front: str, engine: str) -> str | None:
    """The engine's state as one worker's ``/ready`` shows it."""
    return (await asyncio.to_thread(ready_states, front)).get(engine)


def sampled_after(run: Run, url: str, since: float) -> int:
    """Sequences ``url`` sampled after ``since`` (its ground truth's clock is ours)."""
    return sum(record["created"] > since for record in run.truths[url])


# -- a calm pool: every rollout on its engine, an even spread, two workers alike ----------


async def calm_run(tmp: Path) -> tuple[Run, dict[str, Counter[str]]]:
    """90 harnesses, each running 5 rollouts in turn, through 2 workers to 3 engines."""
    harnesses = [
        [Rollout(f"calm-{h}-{k}", 2 + (h + k) % 3) for k in range(ROLLOUTS_EACH)]
        for h in range(HARNESSES)
    ]
    tally = RolloutTally()
    with engine_pool(tmp, 3, PACE) as engines:
        with tokcap_serve(tmp, tmp / "store", [e.url for e in engines]) as served:
            since = time.time()
            async with spreading_client(tally) as http:
                done = await run_harnesses(served.url, harnesses, http)
            per_worker = served.worker_calls()
        run = await judged(tmp, engines, done, tally, "calm pool", since)
    shares = Counter(run.placement.engines_of(r.rollout_id)[0] for r in done)
    print(  # the figures behind the assertions; shown with pytest -s
        f"calm pool: rollouts per engine {sorted(shares.values())}, calls per worker "
        f"{[sum(c.values()) for c in per_worker.values()]}, "
        f"{len(run.placement.split())} rollouts split over two engines"
    )
    return run, per_worker


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, Counter[str]]]:
    """One calm run, judged by the tests below (each says one thing about it)."""
    return asyncio.run(calm_run(tmp_path_factory.mktemp("calm")))


def test_calm_pool_every_call_is_captured_as_the_engine_that_sampled_it(
    calm: tuple[Run, dict[str, Counter[str]]],
) -> None:
    run, _ = calm
    assert run.outcome.critical == [], "\n".join(run.outcome.critical)
    assert run.outcome.statuses.keys() == {200} and run.outcome.failed_loops == 0
    assert run.outcome.masked == 0
    assert run.placement.unfaithful() == []  # each entry names the one engine that sampled it
    for rollout in run.rollouts:  # one entry per call the harness was answered, no more
        calls = run.placement.calls[rollout.rollout_id]
        assert len(calls) == len(rollout.answered) == rollout.turns, rollout.rollout_id
    assert run.unserved == []  # nothing an engine sampled for a loop went missing


def test_calm_pool_spreads_rollouts_evenly_and_both_workers_place_them_alike(
    calm: tuple[Run, dict[str, Counter[str]]],
) -> None:
    run, per_worker = calm
    firsts = Counter(run.placement.engines_of(r.rollout_id)[0] for r in run.rollouts)
    even = len(run.rollouts) / len(run.engines)
    assert set(firsts) == set(run.engines)
    for url in run.engines:
        assert abs(firsts[url] - even) <= EVEN_WITHIN * even, (url, firsts, even)
    # Both workers served calls, on every engine (each worker's own counter file).
    assert len(per_worker) == 2, per_worker
    for served in per_worker.values():
        assert set(served) == set(run.engines) and min(served.values()) > 0, per_worker
    # The workers agree on each rollout's engine: the one rendezvous hashing names. A worker
    # placing by any other rule (another order, another spelling of a URL) would send about
    # a third of all calls elsewhere; the few calls that do leave are the bounded-load
    # rule's (see the next test).
    calls = [
        (rollout.rollout_id, engine)
        for rollout in run.rollouts
        for engine in run.placement.engines_of(rollout.rollout_id)
    ]
    at_home = sum(engine == home(rollout, run.engines) for rollout, engine in calls)
    assert at_home >= 0.9 * len(calls), (at_home, len(calls))


# The bounded-load rule (api.engine.pool) must not fire on the ordinary swings of one
# worker's in-flight counts: at LOAD_BOUND 1.5 it moved a call of 2-5% of these rollouts
# (9-23 of 450). A burst may still send one call of a rare rollout elsewhere (1 of 450 in
# one full-suite run on a loaded host): at most 1%.
MOST_SPLIT = 0.01


def test_calm_pool_keeps_every_rollout_on_one_engine(
    calm: tuple[Run, dict[str, Counter[str]]],
) -> None:
    run, _ = calm
    split = run.placement.split()
    examples = {r: run.placement.engines_of(r) for r in split[:3]}
    assert len(split) <= MOST_SPLIT * len(run.rollouts), f"{len(split)} split: {examples}"


# -- kill -9 of one engine mid-run, restarted on its port ---------------------------------

KILL_GATE = 7  # turns 7-11 start once the killed engine is back


async def kill_run(tmp: Path) -> Run:
    """Half the loops streamed, half not; one engine killed with calls in flight, restarted
    on its port 2.5 s later; the loops wait before turn 7 until every worker has it back."""
    rollouts = [Rollout(f"kill-{n}", TURNS) for n in range(FAULT_LOOPS)]
    gate, tally = Gate(KILL_GATE), RolloutTally()
    with engine_pool(tmp, 3, PACE) as engines:
        urls = [e.url for e in engines]
        # The engine most of the unstreamed loops live on, so some of them come back to it.
        whole = Counter(home(r.rollout_id, urls) for r in rollouts[1::2])
        killed = next(e for e in engines if e.url == whole.most_common(1)[0][0])
        with tokcap_serve(tmp, tmp / "store", urls) as served:
            notes: dict[str, Any] = {"killed": killed.url}

            async def fault() -> None:
                await once_answered(rollouts, 2 * FAULT_LOOPS)
                await asyncio.to_thread(killed.kill9)
                notes["killed_at"] = time.time()  # it sampled nothing after this
                await asyncio.sleep(2.5)
                notes["down"] = [(await down_state(served.url, killed.url)) for _ in range(6)]
                notes["restarted_at"] = time.time()
                await asyncio.to_thread(lambda: killed.start().wait())
                await wait_for_pool(served.url, {url: "up" for url in urls})
                await asyncio.sleep(2 * REPROBE_S)  # a worker /ready did not reach re-probes
                notes["ready"] = await asyncio.to_thread(ready_states, served.url)

            since = time.time()
            async with spreading_client(tally) as http:
                loops = [
                    run_loops(served.url, rollouts[0::2], http, before_turn=gate.before_turn),
                    run_loops(
                        served.url, rollouts[1::2], http, before_turn=gate.before_turn, stream=False
                    ),
                ]
                await asyncio.gather(*loops, alongside(gate, fault))
        run = await judged(tmp, engines, rollouts, tally, "engine kill -9", since)
    run.notes = {**notes, "gate_opened_at": gate.opened_at}
    return run


async def test_an_engine_killed_mid_run_loses_nothing_and_takes_its_rollouts_back(
    tmp_path: Path,
) -> None:
    run = await kill_run(tmp_path)
    killed, notes = run.notes["killed"], run.notes
    print({k: v for k, v in notes.items() if k != "killed"}, run.outcome.errors)
    assert run.outcome.critical == [], "\n".join(run.outcome.critical)
    assert run.placement.unfaithful() == []
    # The kill struck calls in flight: some were answered 5xx and retried by the SDK.
    retried = [
        r for r in run.rollouts if any(s >= 500 for s in run.tally.by_rollout.get(r.rollout_id, {}))
    ]
    assert retried, run.outcome.statuses
    # Every loop that retried completed, on the other engines while the killed one was out.
    for rollout in retried:
        assert rollout.error is None and len(rollout.answered) == rollout.turns, rollout.error
    # A loop gives up only where its streamed reply was already being relayed when the
    # engine died (an error event: nothing the SDK may resend); no whole reply is lost.
    gave_up = [r for r in run.rollouts if r.error is not None]
    streamed = {r.rollout_id for r in run.rollouts[0::2]}
    for rollout in gave_up:
        assert rollout.rollout_id in streamed and "stream broke off" in rollout.error, rollout
    assert "out" in notes["down"], notes["down"]
    # The killed engine rejoined on its port: /ready shows it up, and every rollout whose
    # engine it is samples there again after the gate (its later entries name it).
    assert notes["ready"] == {url: "up" for url in run.engines}, notes["ready"]
    assert sampled_after(run, killed, notes["gate_opened_at"]) > 0
    back_home = [
        r for r in run.rollouts if r.error is None and home(r.rollout_id, run.engines) == killed
    ]
    assert back_home, "some rollout lives on the engine that was killed"
    for rollout in back_home:
        engines = run.placement.engines_of(rollout.rollout_id)
        assert len(engines) == rollout.turns
        assert killed in engines[KILL_GATE:], (rollout.rollout_id, engines)
    # It sampled nothing while it was down: the calls of its rollouts went to the others.
    down = (notes["killed_at"], notes["restarted_at"])
    assert not any(down[0] < record["created"] < down[1] for record in run.truths[killed])
    for rollout in back_home:
        moved = run.placement.engines_of(rollout.rollout_id)[:KILL_GATE]
        assert any(engine != killed for engine in moved), (rollout.rollout_id, moved)


# -- the engines file drops one engine and adds another while loops run -------------------

DRAIN_GATE = 9  # turns 9-11 start once every worker has the new pool


def write_pool(path: Path, engines: list[str]) -> None:
    path.write_text(yaml.safe_dump(engines))


async def drain_run(tmp: Path) -> Run:
    """Three engines named in the engines file; once the loops are under way one is taken
    out of the file (drained), then a fourth added; the loops wait before turn 9 until
    every worker has the new pool."""
    rollouts = [Rollout(f"drain-{n}", TURNS) for n in range(FAULT_LOOPS)]
    gate, tally = Gate(DRAIN_GATE), RolloutTally()
    pool_file = tmp / "engines.yaml"
    with engine_pool(tmp, 4, PACE) as engines:
        first, second, leaving, joining = (e.url for e in engines)
        write_pool(pool_file, [first, second, leaving])
        with tokcap_serve(
            tmp, tmp / "store", [first, second, leaving], engines_file=pool_file
        ) as served:
            notes: dict[str, Any] = {"leaving": leaving, "joining": joining}

            async def change() -> None:
                await once_answered(rollouts, 3 * FAULT_LOOPS // 2)
                notes["removed_at"] = time.time()
                write_pool(pool_file, [first, second])
                seen = await wait_for_pool(served.url, {first: "up", second: "up"}, readings=4)
                # What /ready showed of the leaving engine meanwhile: draining while its
                # calls in flight finish, then gone (a figure; the drain's effect on the
                # calls is judged from the ground truth).
                notes["leaving_seen"] = Counter(states.get(leaving, "gone") for states in seen)
                notes["added_at"] = time.time()
                write_pool(pool_file, [first, second, joining])
                await wait_for_pool(served.url, {first: "up", second: "up", joining: "up"})
                await asyncio.sleep(WATCH_S + 0.5)  # a worker /ready did not reach sees it

            since = time.time()
            async with spreading_client(tally) as http:
                loops = run_loops(served.url, rollouts, http, before_turn=gate.before_turn)
                await asyncio.gather(loops, alongside(gate, change))
        run = await judged(tmp, engines, rollouts, tally, "engine drained, engine added", since)
    run.notes = {**notes, "gate_opened_at": gate.opened_at}
    return run


async def test_an_engine_leaving_is_drained_and_one_joining_takes_its_rollouts(
    tmp_path: Path,
) -> None:
    run = await drain_run(tmp_path)
    notes = run.notes
    leaving, joining = notes["leaving"], notes["joining"]
    print({k: v for k, v in notes.items()}, run.outcome.errors)
    # No call was lost to the drain: the harnesses saw no error at all, and everything an
    # engine sampled (the leaving one's last calls too) was captured and judged exact.
    assert run.outcome.statuses.keys() == {200}, run.outcome.errors
    assert run.outcome.failed_loops == 0
    assert run.outcome.critical == [], "\n".join(run.outcome.critical)
    assert run.placement.unfaithful() == [] and run.unserved == []
    # The leaving engine finished calls after it was taken out of the file (the drain),
    # and the joining one served calls before the loops reached the gate (while they ran).
    assert sampled_after(run, leaving, notes["removed_at"]) > 0
    captured = [call for calls in run.placement.calls.values() for call in calls]
    assert any(
        call.sampled_by == [joining] and call.created_at < notes["gate_opened_at"]
        for call in captured
    )
    final = [e for e in run.engines if e != leaving]
    joined = [r for r in run.rollouts if home(r.rollout_id, final) == joining]
    assert joined, "some rollout's engine is the one that joins"
    for rollout in run.rollouts:
        engines = run.placement.engines_of(rollout.rollout_id)
        assert len(engines) == rollout.turns
        assert leaving not in engines[DRAIN_GATE:], (rollout.rollout_id, engines)
    for rollout in joined:
        assert joining in run.after_gate(rollout, DRAIN_GATE), run.after_gate(rollout, DRAIN_GATE)
