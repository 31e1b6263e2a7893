"""The policy version of every call, end to end (issue 25).

A weight update lands in the middle of a rollout. On SGLang's wire the engine reports its
version (``/update_weight_version``, ``meta_info.weight_version``); on vLLM's the trainer
tells the front end (``PUT /tokcap/policy_version``). Either way each captured call carries
the version the engine's ground truth says sampled it, the calls before and after the update
their own, and the rebuilt record names the versions it spans, the lag to the consumer's,
and each call's sampled span in ``training_samples``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.settings import ServerSettings
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.rollout_ids import capture_base_url, rollout_token
from capture.samples import training_samples
from tests.support.fault_loops import (
    Rollout,
    Tally,
    final_record,
    harness_client,
    run_loops,
    write_script,
)
from tests.support.frontend import engine_server, file_store_settings, finalize, freeze, front_end

PINNED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
SECRET = "policy-version-secret-0123"


def settings(upstream: str, store: Path, **server: Any) -> ServerSettings:
    return file_store_settings(upstream, store, sampling_overrides=PINNED, **server)


def update_weights(wire: str, engine: str, front: str, version: str) -> None:
    """What a trainer does after a weight update: the engine is told its version (both
    engines' ``/update_weight_version``). SGLang reports it in each reply; vLLM's chat and
    completions replies do not, so the front end is told too."""
    reply = httpx.post(engine + "/update_weight_version", json={"new_version": version})
    assert reply.json()["success"]
    if wire == "vllm":
        reply = httpx.put(front + "/tokcap/policy_version", json={"version": version})
        assert reply.status_code == 200 and reply.json()["version"] == version


CASES = [
    ("vllm", "text", True),
    ("vllm", "text", False),
    ("sglang", "text", False),
    ("vllm", "faithful", True),
    ("sglang", "faithful", True),
]


@pytest.mark.parametrize(("wire", "prompts", "stream"), CASES)
def test_each_call_carries_the_version_that_sampled_it(
    wire: str, prompts: str, stream: bool, tmp_path: Path
) -> None:
    store = tmp_path / "captures"
    script = write_script(tmp_path / "script.yaml")
    engine_kw: dict[str, Any] = {"wire": wire, "script_path": script}
    front_kw: dict[str, Any] = {}
    if prompts == "faithful":
        engine_kw["tokenizer_path"] = "qwen3"
        front_kw = {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}
    with (
        engine_server(**engine_kw) as engine,
        front_end(settings(engine, store, **front_kw)) as front,
    ):
        update_weights(wire, engine, front, "7")
        rollout = Rollout(f"versions-{wire}-{prompts}-{stream}", 4)

        async def before_turn(_: Rollout, turn: int) -> None:
            if turn == 2:
                await asyncio.to_thread(update_weights, wire, engine, front, "8")

        async def drive() -> None:
            async with harness_client(Tally()) as http:
                await run_loops(front, [rollout], http, stream=stream, before_turn=before_turn)

        asyncio.run(drive())
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    assert rollout.error is None and len(rollout.answered) == 4
    snapshot = freeze(store, rollout.rollout_id)
    by_ids = {(tuple(t["prompt_token_ids"]), tuple(t["token_ids"])): t for t in truth}
    versions = []
    for entry in sorted(snapshot.entries, key=lambda e: len(e.prompt_token_ids)):
        sampled = by_ids[(tuple(entry.prompt_token_ids), tuple(entry.generation_token_ids))]
        assert entry.policy_version == sampled["weight_version"]
        versions.append(entry.policy_version)
    assert versions == ["7", "7", "8", "8"]
    record = final_record(rollout)
    record["_ng_current_policy_version"] = 10
    record, build = finalize(store, rollout.rollout_id, record["response"]["output"])
    assert build.ok and not build.masked
    assert build.summary.policy_versions == ["7", "8"]
    carriers = [i for i in record["response"]["output"] if "generation_token_ids" in i]
    assert [item["policy_version"] for item in carriers] == versions
    [sample] = training_samples(record)
    assert [version for _, _, version in sample.policy_versions] == versions
    for (start, stop, _), item in zip(sample.policy_versions, carriers, strict=True):
        assert sample.input_ids[start:stop] == list(item["generation_token_ids"])
        assert set(sample.loss_mask[start:stop]) == {1}


def test_the_lag_counts_from_the_version_the_consumer_names(tmp_path: Path) -> None:
    store = tmp_path / "captures"
    with engine_server() as engine, front_end(settings(engine, store)) as front:
        update_weights("vllm", engine, front, "3")
        rollout = Rollout("lag", 2)

        async def drive() -> None:
            async with harness_client(Tally()) as http:
                await run_loops(front, [rollout], http)

        asyncio.run(drive())
    record = final_record(rollout)
    record["_ng_current_policy_version"] = "5"

    async def rebuild() -> Any:
        source = FileTokenStore(store)
        try:
            return await finalize_rollout_token_capture(record, source)
        finally:
            await source.close()

    built = asyncio.run(rebuild())
    assert built.summary.policy_versions == ["3"] and built.summary.policy_version_lag == 2


def test_a_call_dispatched_before_an_update_keeps_its_version(tmp_path: Path) -> None:
    """The engine still works on a call when the trainer sets a new version: that call
    ran under the old weights and keeps the old version; the next call has the new one."""
    store = tmp_path / "captures"
    with engine_server(first_token_s=1.5) as engine, front_end(settings(engine, store)) as front:
        httpx.put(front + "/tokcap/policy_version", json={"version": 1}).raise_for_status()
        base = capture_base_url(front, "in-flight") + "/v1/chat/completions"
        call = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        done: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: done.append(httpx.post(base, json=call, timeout=30))
        )
        worker.start()
        time.sleep(0.5)  # dispatched, the engine still working
        httpx.put(front + "/tokcap/policy_version", json={"version": 2}).raise_for_status()
        worker.join()
        assert done[0].status_code == 200
        call["messages"] = [{"role": "user", "content": "hello again"}]
        assert httpx.post(base, json=call, timeout=30).status_code == 200
    entries = sorted(freeze(store, "in-flight").entries, key=lambda e: e.created_at)
    assert [entry.policy_version for entry in entries] == ["1", "2"]


def test_every_front_end_on_a_store_follows_the_version(tmp_path: Path) -> None:
    """Two front ends (as two workers) on one store: a version set at one reaches the
    other's calls."""
    store = tmp_path / "captures"
    with engine_server() as engine:
        with front_end(settings(engine, store)) as one, front_end(settings(engine, store)) as two:
            assert httpx.get(two + "/tokcap/policy_version").json() == {
                "version": None,
                "shared": True,
            }
            httpx.put(one + "/tokcap/policy_version", json={"version": "v9"}).raise_for_status()
            assert httpx.get(two + "/tokcap/policy_version").json()["version"] == "v9"
            deadline = time.monotonic() + 5
            while httpx.get(two + "/tokcap/policy_version").json()["version"] != "v9":
                assert time.monotonic() < deadline
            base = capture_base_url(two, "followed") + "/v1/chat/completions"
            time.sleep(0.6)  # past two polls: the worker's own view has it too
            call = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
            assert httpx.post(base, json=call, timeout=30).status_code == 200
    [entry] = freeze(store, "followed").entries
    assert entry.policy_version == "v9"


def test_only_the_trainer_may_set_the_version(tmp_path: Path) -> None:
    store = tmp_path / "captures"
    with engine_server() as engine:
        with front_end(settings(engine, store, auth_secret=SECRET)) as front:
            path = front + "/tokcap/policy_version"
            assert httpx.put(path, json={"version": "1"}).status_code == 401
            token = rollout_token(SECRET, "harness")
            on_rollout = capture_base_url(front, "harness") + "/tokcap/policy_version"
            refused = httpx.put(on_rollout, json={"version": "1"}, headers={"x-api-key": token})
            assert refused.status_code == 404
            key = {"x-api-key": SECRET}
            for bad in ({"version": ""}, {"version": "a b"}, {"nope": 1}, [1], {"version": True}):
                reply = httpx.put(path, json=bad, headers=key)
                assert reply.status_code == 400, bad
                assert SECRET not in reply.text
            assert httpx.put(path, content=b"{", headers=key).status_code == 400
            deep = b'{"version": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            assert httpx.put(path, content=deep, headers=key).status_code == 400
            assert (
                httpx.put(
                    path, content=b'{"version": 1' + b"0" * 4000 + b"}", headers=key
                ).status_code
                == 400
            )
            assert httpx.put(path, json={"version": "1"}, headers=key).json()["version"] == "1"
            assert httpx.get(path, headers=key).json()["version"] == "1"
