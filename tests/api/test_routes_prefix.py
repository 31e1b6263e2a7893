"""Routes without the prefix (issue 35, item 4): a continued faithful call asks the engine
only for the routes rows it adds, and the rebuild still delivers every position's routes.

The tokcap engine serves as an MoE on vLLM's wire and honours ``routed_experts_prompt_start``
as vLLM 0.32 does; its ground-truth log says what each request asked for. Everything is
checked against that log and the engine's own routes (``routes_of`` the ids it read), never
against tokcap's metrics, on the file store and on Redis, with small blocks so a short
rollout spans many.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.samples import training_samples
from tests.support.fault_loops import Rollout, Tally, final_record, harness_client, run_loops
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    engine_server,
    front_end,
)
from tokcap_devtools.engine.routing import MoeShape, routes_of

MOE = MoeShape(layers=6, top_k=4, experts=40)
BLOCK = 8
PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
STORES = ["file", "redis"]


def sink_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if kind == "file":
        return "capture.filestore.store:FileTokenStore", {"dir": str(tmp_path / "captures")}
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    return "transports.redis:RedisTokenSink", {"url": url, "key_prefix": prefix}


def settings(upstream: str, sink: tuple[str, dict], **renderer: Any) -> ServerSettings:
    name, kwargs = sink
    capture = TokenIdCaptureConfig(
        enabled=True, sink=name, sink_kwargs={**kwargs, "block_size": BLOCK}
    )
    moe = {"layers": MOE.layers, "top_k": MOE.top_k, "experts": MOE.experts}
    return ServerSettings(
        upstream=upstream,
        capture=capture,
        sampling_overrides=PINNED,
        prompts="faithful",
        renderer={"tokenizer": "qwen3", **renderer},
        routed_experts=True,
        moe=moe,
    )


@contextlib.asynccontextmanager
async def opened(sink: tuple[str, dict]) -> AsyncIterator[Any]:
    name, kwargs = sink
    if name.startswith("transports.redis"):
        from transports.redis import RedisTokenStore

        store: Any = RedisTokenStore(**kwargs)
    else:
        store = FileTokenStore(kwargs["dir"])
    try:
        yield store
    finally:
        await store.close()


@contextlib.contextmanager
def served(sink: tuple[str, dict], **renderer: Any) -> Iterator[tuple[str, str]]:
    with engine_server(wire="vllm", moe=MOE, tokenizer_path="qwen3") as engine:
        with front_end(settings(engine, sink, **renderer)) as front:
            yield engine, front


def drive(front: str, *rollouts: Rollout) -> None:
    async def loops() -> None:
        async with harness_client(Tally()) as http:
            await run_loops(front, list(rollouts), http, stream=False)

    asyncio.run(loops())
    for rollout in rollouts:
        assert rollout.error is None and len(rollout.answered) >= 3, rollout


def rebuilt(sink: tuple[str, dict], rollout: Rollout) -> tuple[Any, dict, Any]:
    """(the frozen snapshot, the rebuilt record, the build), as a trainer gets them."""
    record = {"_ng_rollout_id": rollout.rollout_id, "response": final_record(rollout)["response"]}

    async def work() -> tuple[Any, dict, Any]:
        async with opened(sink) as store:
            snapshot = await store.freeze(rollout.rollout_id)
            build = await finalize_rollout_token_capture(record, store)
        return snapshot, record, build

    return asyncio.run(work())


def assert_routes_are_the_engines(snapshot: Any, record: dict, build: Any, calls: int) -> None:
    """Every stored call's routes, each carrier's and the training sample's are the
    engine's own routes of the ids read, position by position."""
    assert not snapshot.incomplete
    for entry in snapshot.entries:
        want = routes_of([*entry.prompt_token_ids, *entry.generation_token_ids], MOE)
        assert numpy.array_equal(entry.routed_experts.to_numpy(), want)
    assert_one_contiguous_chain(build, record, calls)
    [sample] = training_samples(record)
    rows = sample.routed_experts.to_numpy()
    assert numpy.array_equal(rows[:-1], routes_of(sample.input_ids, MOE))


@pytest.mark.parametrize("kind", STORES)
def test_later_calls_ask_only_for_new_rows_and_rebuild_every_position(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    sink = sink_of(kind, tmp_path, request)
    rollout = Rollout(f"prefix-{kind}", 4)
    with served(sink) as (engine, front):
        drive(front, rollout)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    starts = [record["routes_start"] for record in truth]
    assert starts[0] == 0  # the root has no stored prefix
    assert all(start > 0 for start in starts[1:]), starts
    for record, start in zip(truth, starts, strict=True):
        assert start % BLOCK == 0 and start < len(record["prompt_token_ids"])
    snapshot, record, build = rebuilt(sink, rollout)
    assert_entries_equal_ground_truth(snapshot, truth)
    assert_routes_are_the_engines(snapshot, record, build, len(truth))
