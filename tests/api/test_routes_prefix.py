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
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest
from fastapi import FastAPI, Request, Response

from api.prompts.route_prefix import prefix_for
from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.routes import RouteChain
from capture.samples import training_samples
from tests.support.fault_loops import Rollout, Tally, final_record, harness_client, run_loops
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    engine_server,
    front_end,
)
from tests.support.servers import serve_app
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


def drive(front: str, *rollouts: Rollout, **options: Any) -> None:
    async def loops() -> None:
        async with harness_client(Tally()) as http:
            await run_loops(front, list(rollouts), http, stream=False, **options)

    asyncio.run(loops())
    for rollout in rollouts:
        assert rollout.error is None and len(rollout.answered) >= 2, rollout


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


@pytest.mark.parametrize("kind", STORES)
def test_a_prompt_rendered_anew_keeps_the_whole_routes(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``thinking_retention: template`` renders every prompt anew (earlier thinking
    dropped, so earlier ids change): no call names a stored prefix, each is sent for
    every row, and each stored call keeps the engine's routes."""
    sink = sink_of(kind, tmp_path, request)
    rollout = Rollout(f"rerendered-{kind}", 3)
    with served(sink, thinking_retention="template") as (engine, front):
        drive(front, rollout)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert [record["routes_start"] for record in truth] == [0] * len(truth)
    snapshot, _, _ = rebuilt(sink, rollout)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)
    for entry in snapshot.entries:
        want = routes_of([*entry.prompt_token_ids, *entry.generation_token_ids], MOE)
        assert numpy.array_equal(entry.routed_experts.to_numpy(), want)


@pytest.mark.parametrize("kind", STORES)
def test_another_rollout_never_reuses_the_prefix(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two rollouts with the same task read the same ids: the second still starts from
    every row of its own first call, and continues only its own stored routes."""
    sink = sink_of(kind, tmp_path, request)
    first, second = (Rollout(f"twin-{n}-{kind}", 3, task="List the directories.") for n in (1, 2))
    with served(sink) as (engine, front):
        drive(front, first)
        seen = len(httpx.get(engine + "/tokcap/ground_truth").json())
        drive(front, second)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    theirs = truth[seen:]
    assert theirs[0]["prompt_token_ids"] == truth[0]["prompt_token_ids"]  # the same ids
    assert theirs[0]["routes_start"] == 0
    assert all(record["routes_start"] > 0 for record in theirs[1:])
    for rollout, records in ((first, truth[:seen]), (second, theirs)):
        snapshot, record, build = rebuilt(sink, rollout)
        assert_entries_equal_ground_truth(snapshot, records)
        assert_routes_are_the_engines(snapshot, record, build, len(records))


@contextlib.contextmanager
def forwarding(
    targets: list[str], start_by: int = 0, hows: list[str] | None = None
) -> Iterator[str]:
    """A real proxy that forwards each request to the next of ``targets`` in turn, moving
    each token-in call's ``routed_experts_prompt_start`` by ``start_by`` positions (an
    engine that applied another start than it was asked for); ``hows`` collects how the
    front ends made each prompt (their ``x-tokcap-prompt`` header)."""
    app = FastAPI()
    turn = iter(range(1 << 30))

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, incoming: Request) -> Response:
        body = await incoming.body()
        if path == "v1/completions" and start_by:
            data = json.loads(body)
            if data.get("routed_experts_prompt_start"):
                data["routed_experts_prompt_start"] += start_by
            body = json.dumps(data).encode()
        headers = {
            key: value
            for key, value in incoming.headers.items()
            if key not in ("host", "content-length")
        }
        url = f"{targets[next(turn) % len(targets)]}/{path}"
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.request(incoming.method, url, content=body, headers=headers)
        if hows is not None and "x-tokcap-prompt" in reply.headers:
            hows.append(reply.headers["x-tokcap-prompt"])
        kind = reply.headers.get("content-type", "application/json")
        return Response(reply.content, reply.status_code, media_type=kind)

    with serve_app(app, ready_path="/health") as url:
        yield url


@pytest.mark.parametrize("kind", STORES)
def test_a_call_another_front_end_served_is_continued_from_the_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The harness's calls alternate between two front ends on one store: each finds the
    call it continues in the store, whose routes name their blocks, and still asks the
    engine only for the rows after them."""
    sink = sink_of(kind, tmp_path, request)
    rollout = Rollout(f"two-fronts-{kind}", 4)
    hows: list[str] = []
    with engine_server(wire="vllm", moe=MOE, tokenizer_path="qwen3") as engine:
        with front_end(settings(engine, sink)) as one, front_end(settings(engine, sink)) as two:
            with forwarding([one, two], hows=hows) as front:
                drive(front, rollout)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert hows[0] == "root" and set(hows[1:]) == {"continued:store"}, hows
    assert [record["routes_start"] > 0 for record in truth] == [False] + [True] * (len(truth) - 1)
    snapshot, record, build = rebuilt(sink, rollout)
    assert_entries_equal_ground_truth(snapshot, truth)
    assert_routes_are_the_engines(snapshot, record, build, len(truth))


@pytest.mark.parametrize("kind", STORES)
def test_routes_from_another_start_than_asked_are_never_delivered(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The engine returns the rows from one block earlier than asked: the harness is still
    answered, the call is lost, and the rollout is masked; no wrong routes go out."""
    sink = sink_of(kind, tmp_path, request)
    rollout = Rollout(f"moved-{kind}", 3)
    with engine_server(wire="vllm", moe=MOE, tokenizer_path="qwen3") as engine:
        with forwarding([engine], -BLOCK) as proxy, front_end(settings(proxy, sink)) as front:
            drive(front, rollout)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert any(record["routes_start"] > 0 for record in truth)
    snapshot, record, build = rebuilt(sink, rollout)
    assert snapshot.incomplete and len(snapshot.entries) < len(truth)
    assert build.masked and training_samples(record) == []


def test_a_prefix_ends_before_the_first_id_a_bridge_changed() -> None:
    """A row depends on the ids up to its position: where the new prompt's ids differ
    from the continued call's (a bridge that dropped thinking), its prefix ends at the
    last whole block before them."""
    chain = RouteChain(tuple(f"{n:032x}" for n in range(10)), BLOCK, 10 * BLOCK)
    previous = list(range(100, 101 + 10 * BLOCK))
    ids = [*previous, 7, 7, 7]
    assert prefix_for(chain, ids, previous).rows == 10 * BLOCK
    changed = list(ids)
    changed[3 * BLOCK + 2] = 5
    found = prefix_for(chain, changed, previous)
    assert found.rows == 3 * BLOCK and found.names == chain.names[:3]
    changed[1] = 5
    assert prefix_for(chain, changed, previous) is None
    assert prefix_for(None, ids, previous) is None


@pytest.mark.parametrize("kind", STORES)
def test_a_prefix_the_store_no_longer_holds_loses_the_call(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The rollout's stored data is deleted under a running loop: the front end still
    remembers the call it continues and asks only for the new rows, the store refuses
    routes that continue blocks it does not hold, and the call is lost (the harness is
    answered all the same); the rollout is masked, never delivered with routes it lacks."""
    sink = sink_of(kind, tmp_path, request)
    rollout = Rollout(f"deleted-{kind}", 4)

    async def delete_before_the_third(_: Rollout, turn: int) -> None:
        if turn == 2:
            async with opened(sink) as store:
                await store.delete(rollout.rollout_id)

    with served(sink) as (engine, front):
        drive(front, rollout, before_turn=delete_before_the_third)
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert len(truth) >= 3 and truth[2]["routes_start"] > 0
    assert "which the rollout does not hold" in caplog.text
    snapshot, record, build = rebuilt(sink, rollout)
    assert snapshot.incomplete and not snapshot.entries
    assert build.masked and training_samples(record) == []
