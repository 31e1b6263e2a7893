"""The intent of a captured call is durable while the engine works, before any reply.

The front end writes the intent concurrently with the upstream call rather than before
it. These tests hold the call inside the upstream (a real gate server in front of the
engine) and look at the file store meanwhile: the call is pending there, a freeze at that
moment yields an incomplete snapshot, and once the gate opens the reply still reaches the
harness (a capture failure never fails the call).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tests.support.frontend import (
    engine_server,
    file_store_settings,
    freeze,
    front_end,
    inspect,
)
from tests.support.servers import serve_app

HELLO = [{"role": "user", "content": "hello"}]


class Gate:
    """An upstream that forwards to the engine only once the test opens it."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.dispatched = threading.Event()
        self.opened = threading.Event()
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    async def chat(self, request: Request) -> Response:
        body = await request.body()
        self.dispatched.set()
        await asyncio.to_thread(self.opened.wait, 30)
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(
                self.engine + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")


@contextlib.contextmanager
def gated_front_end(store_dir: Path) -> Iterator[tuple[str, Gate]]:
    with engine_server() as engine:
        gate = Gate(engine)
        with serve_app(gate.app, ready_path="/docs") as gate_url:
            settings = file_store_settings(gate_url, store_dir, model="tokcap-engine")
            with front_end(settings) as front:
                yield front, gate


def wait_for_pending_intent(
    store_dir: Path, rollout_id: str, timeout: float = 10.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = inspect(store_dir, rollout_id)
        if state["pending_intents"] == 1 or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def send(front: str, rollout_id: str) -> Any:
    client = anthropic.Anthropic(
        base_url=f"{front}/ng-rollout/{rollout_id}/training-token-capture",
        api_key="dummy",
        max_retries=0,
    )
    return client.messages.create(model="m", max_tokens=16, messages=HELLO)


@pytest.mark.timeout(120)
def test_the_intent_is_pending_while_the_engine_works(tmp_path: Path) -> None:
    rollout_id = "intent-while-dispatched"
    with gated_front_end(tmp_path) as (front, gate), ThreadPoolExecutor(1) as pool:
        reply = pool.submit(send, front, rollout_id)
        assert gate.dispatched.wait(30)
        held = wait_for_pending_intent(tmp_path, rollout_id)
        gate.opened.set()
        message = reply.result(timeout=60)
    assert held["pending_intents"] == 1 and held["calls"] == 0
    assert message.content and message.stop_reason
    done = inspect(tmp_path, rollout_id)
    assert done["calls"] == 1 and done["pending_intents"] == 0
    assert done["incomplete"] is False


@pytest.mark.timeout(120)
def test_a_freeze_while_the_engine_works_is_an_incomplete_snapshot(tmp_path: Path) -> None:
    rollout_id = "freeze-while-dispatched"
    with gated_front_end(tmp_path) as (front, gate), ThreadPoolExecutor(1) as pool:
        reply = pool.submit(send, front, rollout_id)
        assert gate.dispatched.wait(30)
        wait_for_pending_intent(tmp_path, rollout_id)
        snapshot = freeze(tmp_path, rollout_id)
        gate.opened.set()
        message = reply.result(timeout=60)
    assert snapshot.incomplete is True and snapshot.entries == ()
    assert message.content and message.stop_reason  # the harness is answered all the same
    after = inspect(tmp_path, rollout_id)
    # The late put is refused; the pending intent is the record of the loss, so the snapshot
    # the consumer holds stays the current one, and stays incomplete.
    assert after["state"] == "frozen" and after["calls"] == 0 and after["pending_intents"] == 1
    again = freeze(tmp_path, rollout_id)
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)
    assert again.incomplete is True
