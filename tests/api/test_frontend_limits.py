"""Hostile input and a lost store at the front end (issue 8, items 1, 5 and 8), for real.

Whatever a client sends gets a clear 4xx (or a retryable 503 when the server is merely at
its limit), never a 500 and never a memory blow-up: JSON nested 100,000 deep, invalid UTF-8,
a lone surrogate, more body bytes in flight than the cap, a body that stalls. A store that
can record neither the entry nor its loss withholds the reply behind a retryable 503 in the
harness's dialect. A client that leaves before its reply is noted as unreceived.
"""

from __future__ import annotations

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
from tests.support.frontend import (
    BASH_TOOL,
    both_servers,
    engine_server,
    front_end,
    inspect,
)

HELLO = [{"role": "user", "content": "hello"}]
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    limits = {
        "max_body_bytes": BODY_LIMIT,
        "max_inflight_bytes": BODY_LIMIT + BODY_LIMIT // 2,
        "body_timeout_s": 1.0,
        "body_wait_s": 0.5,
    }
    with both_servers(tmp_path_factory.mktemp("captures"), **limits) as running:
        yield running


def post_raw(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        base + path, content=body, headers={"content-type": "application/json"}, timeout=30
    )


def host_port(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


def open_request(url: str, path: str, content_length: int, sent: bytes) -> socket.socket:
    """A raw HTTP/1.1 request that declares ``content_length`` but sends only ``sent``."""
    sock = socket.create_connection(host_port(url), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {content_length}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
def test_json_nested_100000_deep_is_a_400(servers, path: str) -> None:
    body = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = post_raw(servers.base("deep-1"), path, body)
    assert response.status_code == 400
    assert "nested deeper than" in response.text


def test_count_tokens_refuses_deep_json_too(servers) -> None:
    body = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = post_raw(servers.front, "/v1/messages/count_tokens", body)
    assert response.status_code == 400


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "valid JSON"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (b'{"model": "m", "\\udc00": 1, "messages": []}', "surrogate"),
    ],
    ids=["invalid-utf8", "lone-surrogate-value", "lone-surrogate-key"],
)
def test_undecodable_text_is_a_400_and_nothing_is_recorded(servers, body, message) -> None:
    response = post_raw(servers.base("text-1"), "/v1/messages", body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert inspect(servers.store_dir, "text-1")["state"] == "absent"


def test_a_valid_surrogate_pair_is_served(servers) -> None:
    body = b'{"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    response = post_raw(servers.front, "/v1/messages", body)
    assert response.status_code == 200, response.text


def test_a_body_that_does_not_fit_waits_its_turn_unread(tmp_path: Path) -> None:
    """One body of 200 KiB is being read (and stalls); a second of 200 KiB would pass the
    384 KiB cap, so it waits, unread, until the first is cut (408), then it is served."""
    limits = {
        "max_body_bytes": BODY_LIMIT,
        "max_inflight_bytes": BODY_LIMIT + BODY_LIMIT // 2,
        "body_timeout_s": 1.0,
        "body_wait_s": 30.0,
    }
    big = {
        "model": "m",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "hello world " * 16_000}],
    }
    with both_servers(tmp_path / "captures", **limits) as running:
        first = open_request(running.front, "/v1/messages", 200 * 1024, b"{")
        try:
            time.sleep(0.2)  # the first request's bytes are held now
            started = time.monotonic()
            second = httpx.post(running.base("waited-1") + "/v1/messages", json=big, timeout=30)
            waited = time.monotonic() - started
            assert read_status(first) == 408
        finally:
            first.close()
    assert second.status_code == 200, second.text
    assert waited >= 0.5  # it was served only once the first body's room came free
    assert inspect(running.store_dir, "waited-1")["calls"] == 1


def test_bytes_in_flight_beyond_the_cap_are_a_retryable_503(servers) -> None:
    """One body of 200 KiB is being read; a second of 200 KiB would pass the 384 KiB cap,
    and waits its turn for body_wait_s (0.5 s) before it is refused."""
    first = open_request(servers.front, "/v1/messages", 200 * 1024, b"{")
    try:
        time.sleep(0.2)  # the first request's bytes are held now
        second = open_request(servers.front, "/v1/messages", 200 * 1024, b"")
        try:
            assert read_status(second) == 503
        finally:
            second.close()
    finally:
        first.close()
    time.sleep(0.2)  # the first one's hold is released when it goes away
    small = {"model": "m", "max_tokens": 20, "messages": HELLO}
    assert httpx.post(servers.front + "/v1/messages", json=small, timeout=30).status_code == 200


def test_the_503_for_bytes_in_flight_asks_the_sdk_to_retry(servers) -> None:
    first = open_request(servers.front, "/v1/chat/completions", 200 * 1024, b"{")
    try:
        time.sleep(0.2)
        client = openai.OpenAI(base_url=servers.front + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 200_000}]
            )
    finally:
        first.close()
    assert error.value.status_code == 503
    assert error.value.response.headers["x-should-retry"] == "true"
    assert error.value.response.headers["retry-after"] == "1"


def test_a_body_that_stalls_is_cut_with_a_408(servers) -> None:
    sock = open_request(servers.base("stall-1"), "/v1/messages", 100, b'{"model": "m"')
    try:
        started = time.monotonic()
        assert read_status(sock) == 408
        assert time.monotonic() - started < 10
    finally:
        sock.close()
    assert inspect(servers.store_dir, "stall-1")["state"] == "absent"


class StoreDown(FileTokenStore):
    """The file store behind a link that is down for everything (loaded by the config)."""

    async def _down(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("store unreachable")

    put = mark_incomplete = begin_call = void_call = mark_unreceived = _down


def store_down_settings(engine: str, store_dir: Path) -> ServerSettings:
    capture = TokenIdCaptureConfig(
        enabled=True, sink=f"{__name__}:StoreDown", sink_kwargs={"dir": str(store_dir)}
    )
    return ServerSettings(upstream=engine, capture=capture, capture_timeout_s=0.5)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_no_durable_record_no_reply_an_overloaded_error_instead(tmp_path, streamed) -> None:
    """A whole reply is withheld behind a retryable 503; a stream relayed as the engine
    sampled it ends with the same error as its event, never with its final event."""
    with engine_server() as engine, front_end(store_down_settings(engine, tmp_path)) as front:
        base = f"{front}/ng-rollout/down-1/training-token-capture"
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        kwargs: dict[str, Any] = dict(model="m", max_tokens=50, messages=HELLO, tools=[BASH_TOOL])
        with pytest.raises(anthropic.APIStatusError) as error:
            if streamed:
                with client.messages.stream(**kwargs) as stream:
                    stream.get_final_message()
            else:
                client.messages.create(**kwargs)
        metrics = httpx.get(front + "/metrics", timeout=30).text
    body = error.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    if not streamed:
        assert error.value.status_code == 503
        assert error.value.response.headers["x-should-retry"] == "true"
    assert 'tokcap_calls_total{dialect="anthropic",outcome="unrecorded"} 1.0' in metrics
