"""Serving like a model server (issue 22): keep-alive while the engine works, and hang-ups.

The engine is paced like a loaded one (``tokcap_devtools.engine.pacing``); the front end keeps streams
alive with the dialect's keep-alive, a harness that hangs up before the engine answered
cancels the engine request (the engine records the abort) and its call is abandoned, and
one that hangs up after the engine answered, before the final event, is noted unreceived.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.filestore.store import FileTokenStore
from tests.api.test_frontend_limits import host_port
from tests.support.frontend import OVERRIDES, engine_server, front_end, inspect

HELLO = [{"role": "user", "content": "hello"}]
MESSAGES = b'"messages": [{"role": "user", "content": "hello"}]'


class SlowStore(FileTokenStore):
    """The file store, with a put that takes ``PUT_S`` (loaded by the capture config)."""

    PUT_S = 1.0

    async def put(self, entry: Any) -> None:
        await asyncio.sleep(self.PUT_S)
        await super().put(entry)


def settings(engine: str, store_dir: Path, slow: bool = False, **server: Any) -> ServerSettings:
    sink = f"{__name__}:SlowStore" if slow else None
    capture = (
        TokenIdCaptureConfig(enabled=True, sink=sink, sink_kwargs={"dir": str(store_dir)})
        if slow
        else TokenIdCaptureConfig(enabled=True, dir=str(store_dir))
    )
    return ServerSettings(upstream=engine, capture=capture, sampling_overrides=OVERRIDES, **server)


def send_and_hang_up(front: str, rollout: str, stream: bool, after_s: float) -> bytes:
    """POST a Messages call, read what comes for ``after_s``, then close the connection."""
    body = b'{"model": "m", "max_tokens": 20, "stream": %s, %s}' % (
        b"true" if stream else b"false",
        MESSAGES,
    )
    path = f"/ng-rollout/{rollout}/training-token-capture/v1/messages"
    sock = socket.create_connection(host_port(front), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sock.settimeout(0.05)
    received = b""
    deadline = time.monotonic() + after_s
    while time.monotonic() < deadline:
        try:
            received += sock.recv(65536)
        except TimeoutError:
            pass
    sock.close()
    return received


def metric(front: str, line: str) -> float:
    for row in httpx.get(front + "/metrics", timeout=30).text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "create"])
def test_a_harness_that_hangs_up_cancels_its_engine_request(tmp_path: Path, stream: bool) -> None:
    """Gone after 0.3 s of a 5 s generation: the engine aborts within 1 s of the hang-up,
    the call is abandoned, its intent voided, and the rollout is not masked for it."""
    with (
        engine_server(first_token_s=5.0) as engine,
        front_end(settings(engine, tmp_path, keepalive_s=0.1)) as front,
    ):
        received = send_and_hang_up(front, "gone-1", stream, after_s=0.3)
        aborted = wait_for(lambda: httpx.get(engine + "/tokcap/aborted", timeout=30).json())
        abandoned = wait_for(
            lambda: metric(front, 'tokcap_calls_total{dialect="anthropic",outcome="abandoned"}')
        )
    assert len(aborted) == 1 and aborted[0]["after_s"] < 1.3  # sent at 0, gone at 0.3
    assert abandoned == 1
    if stream:  # the stream was opened and kept alive while the engine worked
        assert b"event: message_start" in received and b"event: ping" in received
    state = inspect(tmp_path, "gone-1")
    assert state["calls"] == 0 and state["pending_intents"] == 0 and not state["incomplete"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "create"])
def test_a_harness_gone_after_the_engine_answered_is_noted_unreceived(
    tmp_path: Path, stream: bool
) -> None:
    """Gone while the entry is being put: the put completes, and the reply is unreceived."""
    with (
        engine_server(first_token_s=0.3) as engine,
        front_end(settings(engine, tmp_path, slow=True, keepalive_s=0.1)) as front,
    ):
        send_and_hang_up(front, "late-1", stream, after_s=0.8)  # engine 0.3 s, put 1.0 s
        state = wait_for(
            lambda: inspect(tmp_path, "late-1").get("unreceived") and inspect(tmp_path, "late-1")
        )
        unreceived = metric(front, "tokcap_unreceived_calls_total")
        aborted = httpx.get(engine + "/tokcap/aborted", timeout=30).json()
    assert state["calls"] == 1 and state["unreceived"] == 1 and not state["incomplete"]
    assert unreceived == 1 and aborted == []


LONG_CASES = {
    "vllm": ({}, {}),
    "sglang": ({"wire": "sglang"}, {}),
    "faithful": (
        {"tokenizer_path": "qwen3"},
        {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}},
    ),
}


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_a_long_generation_reaches_a_client_with_a_short_read_timeout(
    tmp_path: Path, case: str
) -> None:
    """Engine 4 s, client read timeout 1.5 s: the keep-alive keeps the stream going (the
    Anthropic and OpenAI SDKs both, all three dialects), and every call is captured
    exactly, in text mode on either wire and in faithful mode."""
    engine_kw, front_kw = LONG_CASES[case]
    with (
        engine_server(first_token_s=4.0, **engine_kw) as engine,
        front_end(settings(engine, tmp_path, keepalive_s=0.5, **front_kw)) as front,
    ):
        base = f"{front}/ng-rollout/slow-1/training-token-capture"
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=1.5)
        with client.messages.stream(model="m", max_tokens=200, messages=HELLO) as events:
            message = events.get_final_message()
        sdk = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=1.5)
        chunks = list(
            sdk.chat.completions.create(model="m", messages=HELLO, max_tokens=200, stream=True)
        )
        with sdk.responses.stream(model="m", input="hello", max_output_tokens=200) as stream:
            response = stream.get_final_response()
        truth = httpx.get(engine + "/tokcap/ground_truth", timeout=30).json()
    assert message.stop_reason == "end_turn" and message.content[-1].type == "text"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert response.status == "completed"
    entries = asyncio.run(peek_entries(tmp_path, "slow-1"))
    assert [e.generation_token_ids for e in entries] == [t["token_ids"] for t in truth]
    assert len(entries) == 3


async def peek_entries(store_dir: Path, rollout: str) -> list[Any]:
    store = FileTokenStore(store_dir)
    try:
        return await store.peek(rollout)
    finally:
        await store.close()


def test_calls_waiting_on_the_engine_do_not_count_against_the_body_guard(tmp_path: Path) -> None:
    """Bytes in flight are bodies being read and translated: twelve 40 KB calls sent 150 ms
    apart (room for each body to be read, with client, front end and engine sharing one
    process), all waiting on a 2.5 s engine at once, under a 100 KB guard, are all served
    (issue 22: 52 of 100 got 503 when a body counted for its whole call)."""
    padding = "x" * 40_000
    messages = [{"role": "user", "content": f"hello {padding}"}]

    async def one(client: anthropic.AsyncAnthropic, after_s: float) -> Any:
        await asyncio.sleep(after_s)
        return await client.messages.create(model="m", max_tokens=20, messages=messages)

    async def twelve(base: str) -> list[Any]:
        client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        return await asyncio.gather(*(one(client, 0.15 * n) for n in range(12)))

    guard = {"max_body_bytes": 60_000, "max_inflight_bytes": 100_000}
    with (
        engine_server(first_token_s=2.5) as engine,
        front_end(settings(engine, tmp_path, **guard)) as front,
    ):
        started = time.monotonic()
        replies = asyncio.run(twelve(f"{front}/ng-rollout/wide-1/training-token-capture"))
        took = time.monotonic() - started
    assert len(replies) == 12 and all(r.stop_reason for r in replies)
    assert took < 2.5 * 4, "the calls waited on the engine together, not one by one"
    assert inspect(tmp_path, "wide-1")["calls"] == 12
