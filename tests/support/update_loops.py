"""Tool loops through weight updates, judged against the engine's ground truth (issue 33).

Streamed Anthropic-SDK tool loops (``tests.support.fault_loops``) run through a faithful
front end to a paced Qwen3 tokcap engine, while a trainer updates the weights every few
seconds: ``POST /tokcap/pause`` in ``abort`` mode (the engine cuts every call in flight),
the engine's new version, ``POST /tokcap/resume`` with it. With ``resume_cut_calls`` each cut
call is continued on the new weights; without, it fails retryably and the SDK resends it.
What the harnesses saw (errors), what the engine cut, and the decoded tokens no delivered
call holds are counted from the ground truth, never from tokcap's own metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.filestore.store import FileTokenStore
from tests.support.fault_loops import (
    GroundTruth,
    Outcome,
    Rollout,
    Tally,
    harness_client,
    judge,
    rebuild,
    run_loops,
    write_script,
)
from tests.support.frontend import engine_server, front_end

FAITHFUL = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}


@dataclass
class UpdateRun:
    """One run's figures: the property, and what the weight updates cost."""

    outcome: Outcome
    updates: int
    cut_records: int  # replies the engine cut (finish_reason abort)
    tokens_thrown_away: int  # ids the engine decoded that no delivered call holds
    tokens_sampled: int
    calls_continued: int  # delivered calls whose ids span two or more versions
    versions_wrong: int  # delivered spans whose version is not the one that sampled them

    def row(self, name: str) -> str:
        o = self.outcome
        return (
            f"{name}: {o.rollouts} loops, {self.updates} updates, {len(o.critical)} critical, "
            f"{o.masked} masked, {o.failed_loops} loops gave up, harness statuses "
            f"{dict(sorted(o.statuses.items()))}, {self.cut_records} replies cut, "
            f"{self.calls_continued} calls continued, {self.tokens_thrown_away} of "
            f"{self.tokens_sampled} decoded tokens thrown away, {self.versions_wrong} spans "
            "with a wrong version"
        )


def engine_settings(tmp_path: Path, token_s: float) -> dict[str, Any]:
    return {
        "tokenizer_path": "qwen3",
        "script_path": write_script(tmp_path / "script.yaml"),
        "ground_truth_path": str(tmp_path / "truth.jsonl"),
        "first_token_s": 0.05,
        "token_s": token_s,
        "weight_version": "0",
    }


async def updating(front: str, engine: str, every_s: float, done: asyncio.Event) -> int:
    """The trainer: a weight update every ``every_s`` until ``done``; how many it made."""
    version = 0
    async with httpx.AsyncClient(timeout=600) as http:  # the engine may be busy sampling
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), every_s)
                break
            except TimeoutError:
                pass
            version += 1
            (await http.post(front + "/tokcap/pause", json={"mode": "abort"})).raise_for_status()
            try:
                await asyncio.sleep(0.2)  # the update itself
                body = {"new_version": str(version)}
                (await http.post(engine + "/update_weight_version", json=body)).raise_for_status()
            finally:  # never leave the engine paused: the loops would wait for ever
                body = {"version": str(version)}
                (await http.post(front + "/tokcap/resume", json=body)).raise_for_status()
    return version


def _delivered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        item
        for record in records
        if not record.get("mask_sample")
        for item in record["response"]["output"]
        if "generation_token_ids" in item
    ]


def _figures(records: list[dict[str, Any]], truth: GroundTruth) -> dict[str, int]:
    """Cut replies, decoded tokens no delivered call holds, continued calls, and spans whose
    version is not the ground truth's, over every delivered carrier."""
    kept: set[int] = set()  # the ground-truth records some delivered call is made of
    continued = wrong = 0
    for carrier in _delivered(records):
        spans = carrier.get("policy_version_spans")
        parts = (truth.parts(carrier) if spans else truth.sampled(carrier)[:1]) or []
        kept.update(id(part) for part in parts)
        continued += bool(spans) and len(spans) > 1
        versions = [v for _, _, v in spans] if spans else [carrier.get("policy_version")]
        wrong += versions != [part["weight_version"] for part in parts]
    return {
        "cut_records": sum(r["finish_reason"] == "abort" for r in truth.records),
        "tokens_thrown_away": sum(len(r["token_ids"]) for r in truth.records if id(r) not in kept),
        "tokens_sampled": sum(len(r["token_ids"]) for r in truth.records),
        "calls_continued": continued,
        "versions_wrong": wrong,
    }


async def run_updates(
    tmp_path: Path,
    rollouts: list[Rollout],
    *,
    resume: bool,
    every_s: float = 1.5,
    token_s: float = 0.04,
) -> UpdateRun:
    """The loops under weight updates every ``every_s``; their figures."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    engine = engine_settings(tmp_path, token_s)
    capture = TokenIdCaptureConfig(enabled=True, dir=str(tmp_path / "store"))
    tally = Tally()
    with engine_server(**engine) as engine_url:
        settings = ServerSettings(
            upstream=engine_url, capture=capture, resume_cut_calls=resume, **FAITHFUL
        )
        with front_end(settings) as front:
            httpx.put(front + "/tokcap/policy_version", json={"version": "0"}).raise_for_status()
            done = asyncio.Event()
            trainer = asyncio.ensure_future(updating(front, engine_url, every_s, done))
            async with harness_client(tally) as http:
                finished = await run_loops(front, rollouts, http)
            done.set()
            updates = await trainer
            time.sleep(0.2)  # the last notes of unserved calls
    store = FileTokenStore(tmp_path / "store")
    try:
        records = await rebuild(store, finished)
    finally:
        await store.close()
    truth = GroundTruth(engine["ground_truth_path"])
    outcome = judge("weight updates", finished, records, truth, tally)
    return UpdateRun(outcome, updates, **_figures(records, truth))
