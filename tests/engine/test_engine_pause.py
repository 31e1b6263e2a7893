"""The engine's weight-update pauses over real HTTP (uvicorn on 127.0.0.1), on both wires.

vLLM 0.32's ``/pause?mode=abort|wait|keep``, ``/resume``, ``/is_paused``, ``/abort_requests``;
SGLang 0.5's ``/pause_generation``, ``/continue_generation``, ``/abort_request``. A paced
engine (20 ms a token) with a script that samples ~150 tokens, so a pause finds requests in
flight; each reply is checked against the ground truth, which must name exactly what was
returned.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import serve_app
from tokcap_devtools.engine import EngineSettings, create_app

FIRST_S, TOKEN_S = 0.05, 0.02
USER = [{"role": "user", "content": "go on at length"}]
LONG = {"messages": USER, "max_tokens": 200, "seed": 5}
WIRES = ("vllm", "sglang")
PAUSE = {"vllm": ("/pause", "/resume"), "sglang": ("/pause_generation", "/continue_generation")}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "long.yaml"
    path.write_text("default:\n  sampled_words: 150\n")
    return str(path)


@contextlib.contextmanager
def engine(script: str, wire: str, paced: bool = True) -> Iterator[str]:
    pace = {"first_token_s": FIRST_S, "token_s": TOKEN_S} if paced else {}
    settings = EngineSettings(wire=wire, script_path=script, ground_truth=True, **pace)
    with serve_app(create_app(settings)) as url:
        yield url


def post(base: str, path: str, body: dict | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=kw.pop("timeout", 30), **kw)


def pause(base: str, wire: str, mode: str = "abort") -> httpx.Response:
    if wire == "vllm":
        return post(base, f"/pause?mode={mode}")
    return post(base, "/pause_generation", {"mode": mode})


def resume(base: str, wire: str) -> httpx.Response:
    return post(base, PAUSE[wire][1])


def truth(base: str) -> list[dict]:
    return httpx.get(base + "/tokcap/ground_truth", timeout=30).json()


def pacing(base: str) -> int:
    """How many requests the engine is pacing now (sampled, started, not yet answered)."""
    return httpx.get(base + "/tokcap/pace", timeout=30).json()["in_flight"]


def pauses(base: str) -> dict:
    return httpx.get(base + "/tokcap/pauses", timeout=30).json()


def sse(text: str) -> list[dict]:
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def chat_body(wire: str, **extra: Any) -> dict:
    ids = {"return_token_ids": True} if wire == "vllm" or not extra.get("stream") else {}
    if wire == "vllm":
        ids["stream_options"] = {"include_usage": True} if extra.get("stream") else None
    return {**LONG, "logprobs": True, **ids, **extra}


def later(pool: ThreadPoolExecutor, call: Callable[[], httpx.Response], base: str) -> Future:
    """Send a request from another thread, and return once it has been paced for 0.3 s
    (sampling ~150 tokens takes the engine ~0.3 s before its pacing starts)."""
    before = pacing(base)
    future = pool.submit(call)
    wait_for(lambda: pacing(base) > before)
    time.sleep(0.3)
    assert not future.done(), "still being paced"
    return future


def wait_for(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


# -- abort ------------------------------------------------------------------------------
@pytest.mark.parametrize("wire", WIRES)
def test_abort_cuts_a_whole_reply_to_the_tokens_generated(script: str, wire: str) -> None:
    with engine(script, wire) as base, ThreadPoolExecutor() as pool:
        future = later(pool, lambda: post(base, "/v1/chat/completions", chat_body(wire)), base)
        started = time.monotonic()
        assert pause(base, wire).status_code == 200
        reply = future.result(timeout=5).json()
        assert time.monotonic() - started < 1.0, "answered at once"
        if wire == "vllm":
            assert httpx.get(base + "/is_paused").json() == {"is_paused": True}
        [cut] = truth(base)
        assert pauses(base)["is_paused"] and pauses(base)["pauses"][0]["mode"] == "abort"
        assert resume(base, wire).status_code == 200
        if wire == "vllm":
            assert httpx.get(base + "/is_paused").json() == {"is_paused": False}
        full = post(base, "/v1/chat/completions", chat_body(wire)).json()
    choice, whole = reply["choices"][0], full["choices"][0]
    ids = choice["token_ids" if wire == "vllm" else "response_token_ids"]
    all_ids = whole["token_ids" if wire == "vllm" else "response_token_ids"]
    k = len(ids)
    assert 0 < k < len(all_ids) and ids == all_ids[:k], "the tokens generated by then"
    assert choice["finish_reason"] == "abort" and whole["finish_reason"] != "abort"
    if wire == "vllm":
        assert choice["stop_reason"] is None
    else:
        assert choice["matched_stop"] is None
    assert reply["usage"]["completion_tokens"] == k
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == k
    assert choice["message"]["content"] == cut["content"]
    assert cut["token_ids"] == ids and cut["logprobs"] == pytest.approx(logprobs)
    assert cut["finish_reason"] == "abort" and cut["weight_version"] == "default"
    assert cut["version_spans"] == [[0, k, "default"]]


@pytest.mark.parametrize("wire", WIRES)
def test_abort_ends_a_stream_with_an_abort_chunk(script: str, wire: str) -> None:
    body = chat_body(wire, stream=True)
    with engine(script, wire) as base, ThreadPoolExecutor() as pool:
        future = later(pool, lambda: post(base, "/v1/chat/completions", body), base)
        assert pause(base, wire).status_code == 200
        chunks = sse(future.result(timeout=5).text)
        [cut] = truth(base)
        resume(base, wire)
    *tokens, final = [c for c in chunks if c["choices"]]
    assert final["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
    k = len(cut["token_ids"])
    assert 0 < k < 150 and cut["finish_reason"] == "abort"
    sent = tokens[1:]  # after the role chunk, one chunk a token
    assert len(sent) == k
    logprobs = [e["logprob"] for c in sent for e in c["choices"][0]["logprobs"]["content"]]
    assert cut["logprobs"] == pytest.approx(logprobs)
    if wire == "vllm":
        assert [i for c in sent for i in c["choices"][0]["token_ids"]] == cut["token_ids"]
        assert final["choices"][0]["token_ids"] == [] and final["choices"][0]["stop_reason"] is None
        assert chunks[-1]["usage"]["completion_tokens"] == k
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        + (c["choices"][0]["delta"].get("reasoning_content") or "")
        for c in sent
    )
    assert text == cut["text"]


def test_abort_cuts_sglang_generate_whole_and_streamed(script: str) -> None:
    body = {"text": "go on", "sampling_params": {"max_new_tokens": 200}, "return_logprob": True}
    with engine(script, "sglang") as base, ThreadPoolExecutor() as pool:
        whole = later(pool, lambda: post(base, "/generate", body), base)
        streamed = later(pool, lambda: post(base, "/generate", {**body, "stream": True}), base)
        assert pause(base, "sglang").json() == {
            "message": "Generation paused successfully.",
            "status": "ok",
        }
        reply = whole.result(timeout=5).json()
        events = sse(streamed.result(timeout=5).text)
        records = {r["request_id"]: r for r in truth(base)}
        assert resume(base, "sglang").json()["message"] == "Generation continued successfully."
    meta = reply["meta_info"]
    k = len(reply["output_ids"])
    assert 0 < k < 150 and meta["completion_tokens"] == k
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert [t[1] for t in meta["output_token_logprobs"]] == reply["output_ids"]
    record = records[meta["id"]]
    assert record["token_ids"] == reply["output_ids"] and record["finish_reason"] == "abort"
    assert record["logprobs"] == pytest.approx([t[0] for t in meta["output_token_logprobs"]])
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert last["output_ids"] == events[-2]["output_ids"], "the tokens sent, once more"
    assert records[last["meta_info"]["id"]]["token_ids"] == last["output_ids"]


def test_vllm_abort_requests_cuts_without_pausing(script: str) -> None:
    body = chat_body("vllm")
    with engine(script, "vllm") as base, ThreadPoolExecutor() as pool:
        future = later(pool, lambda: post(base, "/v1/chat/completions", body), base)
        assert post(base, "/abort_requests", {"request_ids": []}).json() == {
            "status": "aborted",
            "aborted": 1,
        }
        reply = future.result(timeout=5).json()
        assert httpx.get(base + "/is_paused").json() == {"is_paused": False}
        named = post(base, "/abort_requests", {"request_ids": ["chatcmpl-none"]}).json()
        assert named == {"status": "aborted", "aborted": 1}, "vLLM counts the ids it was given"
        assert post(base, "/abort_requests", content=b"not json").status_code == 400
        # A request held by a pause is already vLLM's, so it is cut too, with nothing.
        pause(base, "vllm")
        held = pool.submit(lambda: post(base, "/v1/chat/completions", body))
        wait_for(lambda: pauses(base)["held"] == 1)
        post(base, "/abort_requests", {})
        nothing = held.result(timeout=5).json()
        resume(base, "vllm")
        records = truth(base)
    assert reply["choices"][0]["finish_reason"] == "abort"
    assert 0 < reply["usage"]["completion_tokens"] < 150
    assert nothing["choices"][0]["finish_reason"] == "abort"
    assert nothing["choices"][0]["token_ids"] == [] and nothing["usage"]["completion_tokens"] == 0
    assert [(r["request_id"], len(r["token_ids"])) for r in records] == [
        (reply["id"], reply["usage"]["completion_tokens"]),
        (nothing["id"], 0),
    ]
    assert records[1]["version_spans"] == []


def test_sglang_abort_request_cuts_one_rid(script: str) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200}}
    with engine(script, "sglang") as base, ThreadPoolExecutor() as pool:
        one = later(pool, lambda: post(base, "/generate", {**body, "rid": "one"}), base)
        two = pool.submit(lambda: post(base, "/generate", {**body, "rid": "two"}))
        done = post(base, "/abort_request", {"rid": "one"})
        assert (done.status_code, done.content) == (200, b"")
        assert one.result(timeout=5).json()["meta_info"]["finish_reason"]["type"] == "abort"
        time.sleep(0.2)
        assert not two.done()
        post(base, "/abort_request", {"abort_all": True})
        assert two.result(timeout=5).json()["meta_info"]["finish_reason"]["type"] == "abort"
        # A weight update may cut everything first, as SGLang's abort_all_requests does.
        three = later(pool, lambda: post(base, "/generate", {**body, "rid": "three"}), base)
        update = {"new_version": "v3", "abort_all_requests": True}
        post(base, "/update_weight_version", update).raise_for_status()
        cut = three.result(timeout=5).json()["meta_info"]
        records = {r["request_id"]: r for r in truth(base)}
    assert cut["finish_reason"]["type"] == "abort" and cut["weight_version"] == "default"
    assert [records[rid]["finish_reason"] for rid in ("one", "two", "three")] == ["abort"] * 3
    assert records["three"]["weight_version"] == "default"


# -- held requests ----------------------------------------------------------------------
@pytest.mark.parametrize("paced", [True, False], ids=["paced", "unpaced"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_request_sent_while_paused_is_held_until_resume(
    script: str, wire: str, paced: bool
) -> None:
    short = {**chat_body(wire), "max_tokens": 10}
    with engine(script, wire, paced) as base, ThreadPoolExecutor() as pool:
        assert pause(base, wire).status_code == 200
        held = pool.submit(lambda: post(base, "/v1/chat/completions", short))
        streamed = pool.submit(
            lambda: post(base, "/v1/chat/completions", chat_body(wire, stream=True, max_tokens=10))
        )
        wait_for(lambda: pauses(base)["held"] == 2)
        time.sleep(0.3)
        assert not held.done() and not streamed.done() and truth(base) == []
        post(base, "/update_weight_version", {"new_version": "v2"}).raise_for_status()
        resumed = time.monotonic()
        resume(base, wire)
        reply = held.result(timeout=5).json()
        took = time.monotonic() - resumed
        chunks = sse(streamed.result(timeout=5).text)
        records = truth(base)
        state = pauses(base)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert chunks[-1 if wire == "sglang" else -2]["choices"][0]["finish_reason"] == "length"
    if paced:
        assert took >= FIRST_S + TOKEN_S * 9, "its pacing started at the resume"
    assert len(records) == 2
    assert all(r["weight_version"] == "v2" for r in records)
    assert all(r["version_spans"] == [[0, 10, "v2"]] for r in records)
    if wire == "sglang":
        assert reply["metadata"]["weight_version"] == "v2"
    assert state["is_paused"] is False and state["held"] == 0
    assert state["pauses"][0]["resumed_at"] is not None


def test_a_held_request_whose_client_leaves_leaves_no_record(script: str) -> None:
    with engine(script, "vllm") as base:
        pause(base, "vllm")
        with pytest.raises(httpx.ReadTimeout):
            post(base, "/v1/chat/completions", chat_body("vllm"), timeout=0.4)
        aborted = wait_for(lambda: httpx.get(base + "/tokcap/aborted").json())
        assert pauses(base)["held"] == 0
        resume(base, "vllm")
        assert truth(base) == []
    assert len(aborted) == 1 and aborted[0]["request_id"].startswith("chatcmpl-")


# -- wait and keep ----------------------------------------------------------------------
def test_wait_mode_returns_once_the_requests_in_flight_finish(script: str) -> None:
    body = {**chat_body("vllm"), "max_tokens": 40}  # 0.05 + 39 * 0.02 s: about 0.83 s
    with engine(script, "vllm") as base, ThreadPoolExecutor() as pool:
        future = pool.submit(lambda: post(base, "/v1/chat/completions", body))
        wait_for(lambda: pacing(base) == 1)
        started = time.monotonic()
        assert pause(base, "vllm", "wait").json() == {"status": "paused"}
        assert time.monotonic() - started > 0.3, "the pause waited for it"
        assert len(truth(base)) == 1 and pacing(base) == 0, "it had finished"
        reply = future.result(timeout=5).json()
        held = pool.submit(lambda: post(base, "/v1/chat/completions", body))
        time.sleep(0.3)
        assert not held.done()
        resume(base, "vllm")
        assert held.result(timeout=5).status_code == 200
        [first, _] = truth(base)
    assert reply["choices"][0]["finish_reason"] == "length" and len(first["token_ids"]) == 40
    assert first["version_spans"] == [[0, 40, "default"]]


@pytest.mark.parametrize(
    ("wire", "mode"), [("vllm", "keep"), ("sglang", "in_place"), ("sglang", "retract")]
)
def test_keep_mode_freezes_and_splits_the_versions(script: str, wire: str, mode: str) -> None:
    body = {**chat_body(wire), "max_tokens": 60}  # 0.05 + 59 * 0.02 s: about 1.2 s
    with engine(script, wire) as base, ThreadPoolExecutor() as pool:
        future = pool.submit(lambda: post(base, "/v1/chat/completions", body))
        wait_for(lambda: pacing(base) == 1)
        time.sleep(0.3)
        started = time.monotonic()
        assert pause(base, wire, mode).status_code == 200
        assert time.monotonic() - started < 0.5, "keep returns at once"
        assert pauses(base)["frozen"] == 1
        time.sleep(1.2)  # longer than the rest of the reply: it would be done unless frozen
        assert not future.done()
        post(base, "/update_weight_version", {"new_version": "v2"}).raise_for_status()
        resume(base, wire)
        reply = future.result(timeout=5).json()
        [record] = truth(base)
    ids = reply["choices"][0]["token_ids" if wire == "vllm" else "response_token_ids"]
    assert reply["choices"][0]["finish_reason"] == "length" and record["token_ids"] == ids
    [[start, split, old], [again, stop, new]] = record["version_spans"]
    assert (start, old, new, again, stop) == (0, "default", "v2", split, 60)
    assert 5 < split < 55, f"about 0.3 s of 1.2 s generated before the pause: {split}"
    assert record["weight_version"] == "v2", "the version of its last token"
    if wire == "sglang":
        assert reply["metadata"]["weight_version"] == "v2"


def test_keep_mode_splits_a_streamed_generate_where_it_froze(script: str) -> None:
    body = {"text": "go", "sampling_params": {"max_new_tokens": 60}, "stream": True}
    with engine(script, "sglang") as base, ThreadPoolExecutor() as pool:
        future = pool.submit(lambda: post(base, "/generate", body))
        wait_for(lambda: pacing(base) == 1)
        time.sleep(0.3)
        pause(base, "sglang", "in_place")
        post(base, "/update_weight_version", {"new_version": "v2"}).raise_for_status()
        time.sleep(0.3)
        resume(base, "sglang")
        events = sse(future.result(timeout=5).text)
        [record] = truth(base)
    versions = [e["meta_info"]["weight_version"] for e in events]
    split = versions.index("v2")
    assert versions == ["default"] * split + ["v2"] * (len(events) - split)
    assert record["version_spans"] == [[0, split, "default"], [split, 60, "v2"]]
    assert events[-1]["output_ids"] == record["token_ids"]


# -- refusals ---------------------------------------------------------------------------
def test_an_unknown_mode_is_a_400(script: str) -> None:
    with engine(script, "vllm") as base:
        refused = post(base, "/pause?mode=bogus")
        assert refused.status_code == 400 and "error" in refused.json()
        assert httpx.get(base + "/is_paused").json() == {"is_paused": False}
    with engine(script, "sglang") as base:
        for mode in ("bogus", ["abort"]):
            refused = post(base, "/pause_generation", {"mode": mode})
            assert refused.status_code == 400 and "error" in refused.json()
        assert pauses(base)["is_paused"] is False
        assert post(base, "/pause_generation").status_code == 200, "the body is optional"
        assert pauses(base)["is_paused"] is True
