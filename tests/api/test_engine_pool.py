"""Many engines behind one front end (issue 34), judged from each engine's ground truth.

Every call of a rollout goes to one engine, chosen by rendezvous hashing of the rollout id:
the engine that sampled a call is the one whose ground truth holds its prompt, and the
entry names it. An engine that dies is taken out (its rollouts' next calls go to the next
engine in their order) and comes back when it answers again; engines named in a watched
file join and leave while calls run, and a leaving one is drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import Response

from api.engine.client import UpstreamClient
from api.engine.pool import EnginePool, score
from api.engine.probe import EngineRefused
from api.settings import ServerSettings
from api.startup import probe
from tests.support.frontend import engine_server, file_store_settings, freeze, front_end
from tests.support.servers import free_port, serve_app


def _converse(front: str, rollout: str, turns: int, retries: int = 0) -> list[str]:
    """``turns`` Messages calls of one rollout, each with the whole conversation so far."""
    sdk = anthropic.Anthropic(
        base_url=f"{front}/ng-rollout/{rollout}/training-token-capture",
        api_key="dummy",
        max_retries=retries,
    )
    messages: list[dict[str, Any]] = []
    replies = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn} of {rollout}: go on."})
        reply = sdk.messages.create(model="m", max_tokens=64, messages=messages)
        text = "".join(block.text for block in reply.content if block.type == "text")
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def _home(rollout: str, engines: list[str]) -> str:
    """The engine rendezvous hashing gives ``rollout`` among ``engines``."""
    return max(engines, key=lambda url: score(rollout, url))


def _sampled_by(truths: dict[str, list[dict]], prompt: list[int]) -> list[str]:
    """The engines whose ground truth holds a call with this prompt."""
    return [
        url for url, truth in truths.items() if any(r["prompt_token_ids"] == prompt for r in truth)
    ]


def _truths(engines: list[str]) -> dict[str, list[dict]]:
    return {url: httpx.get(url + "/tokcap/ground_truth").json() for url in engines}


def _engine_of(entry: Any) -> str:
    return (entry.model_extra or {})["engine"]


def _engines_in_order(store: Path, rollout: str) -> list[str]:
    """The engine each call of ``rollout`` was served by, in the order of the calls."""
    entries = sorted(freeze(store, rollout).entries, key=lambda entry: entry.created_at)
    return [_engine_of(entry) for entry in entries]


def test_each_rollout_stays_on_one_engine_which_its_entries_name(tmp_path: Path) -> None:
    rollouts = [f"pool-{n}" for n in range(24)]
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(engine_server()) for _ in range(3)]
        front = stack.enter_context(front_end(file_store_settings(engines, tmp_path / "store")))
        for rollout in rollouts:
            _converse(front, rollout, turns=3)
        truths = _truths(engines)
        ready = httpx.get(front + "/ready").json()
        metrics = httpx.get(front + "/metrics").text
    homes = {rollout: _home(rollout, engines) for rollout in rollouts}
    assert set(homes.values()) == set(engines)  # all three take rollouts
    for rollout in rollouts:
        entries = freeze(tmp_path / "store", rollout).entries
        assert len(entries) == 3
        for entry in entries:
            assert _sampled_by(truths, list(entry.prompt_token_ids)) == [homes[rollout]]
            assert _engine_of(entry) == homes[rollout]
    assert [row["engine"] for row in ready["engines"]] == engines
    assert all(row["state"] == "up" and "problem" not in row for row in ready["engines"])
    for url in engines:
        served = 3 * sum(1 for home in homes.values() if home == url)
        assert f'tokcap_engine_calls_total{{engine="{url}",outcome="served"}} {served}.0' in metrics


def test_a_dead_engine_is_taken_out_and_takes_its_rollouts_back_when_it_answers(
    tmp_path: Path,
) -> None:
    port = free_port()
    rollouts = [f"failover-{n}" for n in range(12)]
    with engine_server() as steady:
        doomed = f"http://127.0.0.1:{port}"
        engines = [steady, doomed]
        moving = [r for r in rollouts if _home(r, engines) == doomed]
        assert moving, "some rollout lives on the engine that dies"
        settings = file_store_settings(engines, tmp_path / "store")
        with front_end(settings) as front:
            with engine_server(port=port):
                for rollout in rollouts:
                    _converse(front, rollout, turns=1)
            # The engine is gone: its rollouts' calls fail once (retried by the SDK), then
            # go to the steady engine.
            for rollout in rollouts:
                _converse(front, rollout, turns=1, retries=2)
            down = httpx.get(front + "/ready").json()
            with engine_server(port=port):
                deadline = time.monotonic() + 30
                while httpx.get(front + "/ready").json()["engines"][1]["state"] != "up":
                    assert time.monotonic() < deadline, "the engine never came back"
                    time.sleep(0.2)
                for rollout in moving:
                    _converse(front, rollout, turns=1)
                back = _truths([doomed])[doomed]
            metrics = httpx.get(front + "/metrics").text
    assert down["status"] == "ready" and down["engines"][1]["state"] == "out"
    for rollout in moving:
        named = _engines_in_order(tmp_path / "store", rollout)
        assert named == [doomed, steady, doomed]  # out, then back home
    assert len(back) == len(moving)  # the restarted engine's own record: the calls back home
    assert f'tokcap_engine_ejections_total{{engine="{doomed}"}} 1.0' in metrics
    assert f'tokcap_engine_moves_total{{engine="{steady}"}} {len(moving)}.0' in metrics


def _wait_for_pool(front: str, engines: list[str]) -> None:
    deadline = time.monotonic() + 30
    while [row["engine"] for row in httpx.get(front + "/ready").json().get("engines", [])] != (
        engines
    ):
        assert time.monotonic() < deadline, f"the pool never became {engines}"
        time.sleep(0.2)


def test_engines_named_in_the_watched_file_join_and_leave_while_calls_run(tmp_path: Path) -> None:
    pool_file = tmp_path / "engines.yaml"
    rollouts = [f"joins-{n}" for n in range(12)]
    with engine_server() as first, engine_server() as second:
        pool_file.write_text(yaml.safe_dump([first]))
        settings = file_store_settings("http://127.0.0.1:1", tmp_path / "store")
        settings = settings.model_copy(update={"engines_file": str(pool_file)})
        with front_end(settings) as front:
            for rollout in rollouts:
                _converse(front, rollout, turns=1)
            pool_file.write_text(f"{first}\n{second}\n")  # one URL per line works too
            _wait_for_pool(front, [first, second])
            for rollout in rollouts:
                _converse(front, rollout, turns=1)
            pool_file.write_text(yaml.safe_dump([second]))
            _wait_for_pool(front, [second])
            for rollout in rollouts:
                _converse(front, rollout, turns=1)
    for rollout in rollouts:
        named = _engines_in_order(tmp_path / "store", rollout)
        assert named == [first, _home(rollout, [first, second]), second]


Seen = list[tuple[str, str, dict[str, str]]]


def _recorder(engine: str, seen: Seen) -> FastAPI:
    """A pass-through to ``engine`` that keeps each request's method, path and headers: what
    a router in front of the engines would read."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        seen.append((request.method, f"/{path}", dict(request.headers)))
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.request(
                request.method,
                f"{engine}/{path}",
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        return Response(reply.content, reply.status_code, media_type="application/json")

    return app


def test_every_engine_request_carries_the_rollout_as_the_routers_affinity_key(
    tmp_path: Path,
) -> None:
    seen: Seen = []
    with engine_server() as engine:
        with serve_app(_recorder(engine, seen), ready_path="/health") as router:
            with front_end(file_store_settings(router, tmp_path / "store")) as front:
                _converse(front, "keyed-rollout", turns=2)
                httpx.post(  # no rollout: nothing to keep together
                    front + "/v1/messages",
                    json={
                        "model": "m",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                    headers={"x-api-key": "dummy"},
                ).raise_for_status()
    posts = [headers for method, _, headers in seen if method == "POST"]
    keyed = [headers for headers in posts if "x-smg-routing-key" in headers]
    assert len(keyed) == 2 and len(posts) == 3
    assert all(h["x-smg-routing-key"] == h["x-session-id"] == "keyed-rollout" for h in keyed)


def test_a_worker_asks_its_engines_what_they_are_as_it_starts_not_at_its_first_call(
    tmp_path: Path,
) -> None:
    """Left to the first call, the questions went out on an event loop busy with the first
    burst, and every call of the burst waited for their answers."""
    seen: Seen = []
    with engine_server() as engine:
        with serve_app(_recorder(engine, seen), ready_path="/health") as router:
            with front_end(file_store_settings(router, tmp_path / "store")) as front:
                deadline = time.monotonic() + 30
                while not any(path == "/version" for _, path, _ in seen):
                    assert time.monotonic() < deadline, "the engine was never asked"
                    time.sleep(0.05)
                asked_before = [path for method, path, _ in seen if method == "GET"]
                assert not any(method == "POST" for method, _, _ in seen)
                _converse(front, "asked-rollout", turns=2)
    assert {"/v1/models", "/version"} <= set(asked_before)
    assert [path for _, path, _ in seen].count("/version") == 1  # never asked again


def test_a_pause_and_resume_reach_every_engine_of_the_pool(tmp_path: Path) -> None:
    with engine_server() as first, engine_server() as second:
        with front_end(file_store_settings([first, second], tmp_path / "store")) as front:
            httpx.post(front + "/tokcap/pause", json={"mode": "abort"}).raise_for_status()
            paused = [httpx.get(url + "/is_paused").json()["is_paused"] for url in (first, second)]
            httpx.post(front + "/tokcap/resume", json={"version": "2"}).raise_for_status()
            running = [httpx.get(url + "/is_paused").json()["is_paused"] for url in (first, second)]
    assert paused == [True, True] and running == [False, False]


@pytest.mark.parametrize(
    ("upstream", "words"),
    [([], "at least one engine"), (["http://a:1", "http://a:1/"], "twice")],
)
def test_a_pool_that_names_no_engine_or_one_twice_is_refused(upstream: Any, words: str) -> None:
    from api.settings import InvalidSettings

    with pytest.raises(InvalidSettings, match=words):
        ServerSettings(upstream=upstream)


PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def test_the_start_up_probe_refuses_a_pool_whose_engines_differ_naming_the_odd_one() -> None:
    with engine_server() as first, engine_server() as same, engine_server(model="other") as odd:
        alike = ServerSettings(upstream=[first, same], sampling_overrides=PINNED)
        report = asyncio.run(probe(alike))
        with pytest.raises(EngineRefused) as refused:
            asyncio.run(probe(ServerSettings(upstream=[first, odd], sampling_overrides=PINNED)))
    assert report.where == f"{first}, {same}" and report.model == "tokcap-engine"
    assert odd in str(refused.value) and "'other'" in str(refused.value)


def test_bounded_load_sends_a_call_to_the_next_engine_only_when_its_own_is_far_over_its_share() -> (
    None
):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    pool = EnginePool([UpstreamClient(url) for url in urls])
    rollout = "bounded-rollout"
    order = sorted(urls, key=lambda url: score(rollout, url), reverse=True)
    engines = {engine.url: engine for engine in pool.engines}
    engines[order[0]].in_flight = 20  # over an even share, but within twice it (and 8 more)
    engines[order[1]].in_flight = engines[order[2]].in_flight = 10
    assert pool.choose(rollout).url == order[0]
    engines[order[0]].in_flight = 60  # over twice the share: this call goes to the next
    assert pool.choose(rollout).url == order[1]
    engines[order[0]].in_flight = 0
    engines[order[0]].state = "out"  # taken out: its rollouts go to the next in their order
    assert pool.choose(rollout).url == order[1]
    engines[order[1]].state = "draining"  # leaving: takes no new call either
    assert pool.choose(rollout).url == order[2]


def test_an_engine_that_fails_its_health_check_is_taken_out_before_any_call_finds_it_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.engine.pool.HEALTH_S", 0.2)
    port = free_port()
    with engine_server() as steady:
        doomed = f"http://127.0.0.1:{port}"
        with front_end(file_store_settings([steady, doomed], tmp_path / "store")) as front:
            with engine_server(port=port):
                up = [row["state"] for row in httpx.get(front + "/ready").json()["engines"]]
            deadline = time.monotonic() + 30
            while httpx.get(front + "/ready").json()["engines"][1]["state"] != "out":
                assert time.monotonic() < deadline, "the dead engine was never taken out"
                time.sleep(0.1)
            metrics = httpx.get(front + "/metrics").text
    assert up == ["up", "up"]
    assert f'tokcap_engine_ejections_total{{engine="{doomed}"}} 1.0' in metrics
    assert "tokcap_engine_calls_total{" not in metrics  # no call found it gone
