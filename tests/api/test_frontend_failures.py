"""Every failure rule of the front end, on the real servers.

Upstream down: a dialect error, the intent voided, the rollout not masked for it. An invalid
rollout id: 400 naming the rule. Untagged paths: served, not captured. A body beyond the
limit: 413. A sink whose put fails: the call succeeds and the rollout is incomplete. An
upstream without ``return_token_ids`` (vLLM before 0.10.2) still yields exact ids through
``/tokenize``; one whose two id sources disagree is not trusted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry
from tests.support.frontend import (
    BASH_TOOL,
    answer_output,
    assert_entries_equal_ground_truth,
    both_servers,
    engine_server,
    file_store_settings,
    finalize,
    freeze,
    front_end,
    inspect,
)
from tests.support.servers import free_port, serve_app

HELLO = [{"role": "user", "content": "hello"}]


class PutFailsStore(FileTokenStore):
    """The file store with a disk that refuses entries (loaded by the config's sink path)."""

    async def put(self, entry: Any) -> None:
        raise OSError("No space left on device")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    with both_servers(tmp_path_factory.mktemp("captures"), max_body_bytes=8192) as running:
        yield running


def anthropic_client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="dummy", max_retries=0)


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="dummy", max_retries=0)


def test_upstream_down_is_a_dialect_error_and_a_void_intent(servers, tmp_path: Path) -> None:
    rollout_id = "upstream-down"
    dead = f"http://127.0.0.1:{free_port()}"
    settings = file_store_settings(dead, servers.store_dir, model="tokcap-engine")
    with front_end(settings) as front:
        base = f"{front}/ng-rollout/{rollout_id}/training-token-capture"
        with pytest.raises(anthropic.APIStatusError) as messages_error:
            anthropic_client(base).messages.create(model="m", max_tokens=10, messages=HELLO)
        with pytest.raises(anthropic.APIStatusError) as stream_error:
            with anthropic_client(base).messages.stream(
                model="m", max_tokens=10, messages=HELLO
            ) as events:
                list(events)
        with pytest.raises(openai.APIStatusError) as chat_error:
            openai_client(base).chat.completions.create(model="m", messages=HELLO)
        with pytest.raises(openai.APIStatusError) as responses_error:
            openai_client(base).responses.create(model="m", input="hello")
    for error in (messages_error.value, stream_error.value):
        assert error.status_code == 502
        assert error.body["type"] == "error"
        assert error.body["error"]["type"] == "api_error"
        assert "unreachable" in error.body["error"]["message"]
    for error in (chat_error.value, responses_error.value):
        assert error.status_code == 502
        assert "unreachable" in error.body["message"]  # the SDK unwraps {"error": {...}}
    state = inspect(servers.store_dir, rollout_id)
    # Four intents were recorded and each resolved as void: nothing pending, nothing lost.
    assert state["calls"] == 0 and state["pending_intents"] == 0
    assert state["version"] >= 8 and not state["incomplete"]
    # The harness's retry, through a working upstream, is captured; the rollout is not masked.
    reply = anthropic_client(servers.base(rollout_id)).messages.create(
        model="m", max_tokens=200, messages=HELLO
    )
    record, build = finalize(servers.store_dir, rollout_id, answer_output(reply.content[-1].text))
    assert build.ok and not build.masked and build.metrics["capture_incomplete"] is False


@pytest.mark.parametrize("rollout_id", ["-starts-with-dash", "has$dollar", "x" * 201])
def test_invalid_rollout_id_is_a_400_naming_the_rule(servers, rollout_id: str) -> None:
    base = f"{servers.front}/ng-rollout/{rollout_id}/training-token-capture"
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        anthropic_client(base).messages.create(model="m", max_tokens=10, messages=HELLO)
    with pytest.raises(openai.BadRequestError) as chat_error:
        openai_client(base).chat.completions.create(model="m", messages=HELLO)
    for error in (messages_error.value, chat_error.value):
        message = str(error)
        assert "rollout id" in message
        assert "does not match" in message or "limit is 200" in message


def test_untagged_paths_are_served_but_not_captured(servers) -> None:
    body = {"model": "m", "max_tokens": 50, "messages": HELLO}
    for path in ("/ng-rollout/untagged-1/v1/messages", "/v1/messages"):
        response = httpx.post(servers.front + path, json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["type"] == "message"
    completion = openai_client(servers.front).chat.completions.create(model="m", messages=HELLO)
    assert completion.choices[0].message.content
    assert inspect(servers.store_dir, "untagged-1")["state"] == "absent"


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/v1",
        "/ng-rollout/probe-1",
        "/ng-rollout/probe-1/training-token-capture",
        "/ng-rollout/probe-1/training-token-capture/v1",
    ],
)
def test_head_and_get_on_base_paths_answer(servers, path: str) -> None:
    assert httpx.head(servers.front + path).status_code == 200
    assert httpx.get(servers.front + path).status_code == 200
    assert inspect(servers.store_dir, "probe-1")["state"] == "absent"


def test_query_string_models_health_and_metrics(servers) -> None:
    base = servers.base("query-1")
    body = {"model": "m", "max_tokens": 50, "messages": HELLO}
    assert httpx.post(base + "/v1/messages?beta=true", json=body, timeout=30).status_code == 200
    assert len(freeze(servers.store_dir, "query-1").entries) == 1
    assert httpx.get(servers.front + "/health").status_code == 200
    assert [model.id for model in openai_client(base).models.list()] == ["tokcap-engine"]
    assert [model.id for model in anthropic_client(base).models.list()] == ["tokcap-engine"]
    metrics = httpx.get(servers.front + "/metrics").text
    assert 'tokcap_calls_total{dialect="anthropic",outcome="captured"}' in metrics
    assert "tokcap_capture_put_seconds_count" in metrics
    assert 'tokcap_upstream_seconds_count{dialect="anthropic"}' in metrics


def test_body_beyond_the_limit_is_413(servers) -> None:
    big = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x" * 9000}]}
    declared = httpx.post(servers.base("big-1") + "/v1/messages", json=big, timeout=30)
    assert declared.status_code == 413
    assert declared.json()["error"]["type"] == "request_too_large"
    # Without a Content-Length (chunked), the limit is enforced while reading.
    import json

    payload = json.dumps(big).encode()
    chunks = (payload[i : i + 1000] for i in range(0, len(payload), 1000))
    chunked = httpx.post(
        servers.base("big-1") + "/v1/chat/completions",
        content=chunks,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert chunked.status_code == 413
    with pytest.raises(anthropic.APIStatusError) as error:
        anthropic_client(servers.base("big-1")).messages.create(**big)
    assert error.value.status_code == 413
    assert inspect(servers.store_dir, "big-1")["state"] == "absent"


def test_bad_requests_are_400_in_the_dialect_format(servers) -> None:
    base = servers.base("bad-1")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        openai_client(base).responses.create(model="m", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="n=2"):
        openai_client(base).chat.completions.create(model="m", messages=HELLO, n=2)
    not_json = httpx.post(base + "/v1/messages", content=b"{not json", timeout=30)
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"
    bad_role = httpx.post(
        base + "/v1/messages",
        json={"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert bad_role.status_code == 400 and "messages[0].role" in bad_role.json()["error"]["message"]
    # Rejected before dispatch: no intent, nothing to mask.
    assert inspect(servers.store_dir, "bad-1")["state"] == "absent"


def test_a_failing_put_still_serves_the_call_and_marks_the_rollout(tmp_path: Path) -> None:
    capture = TokenIdCaptureConfig(
        enabled=True, sink=f"{__name__}:PutFailsStore", sink_kwargs={"dir": str(tmp_path)}
    )
    with engine_server() as engine:
        settings = ServerSettings(upstream=engine, capture=capture, capture_timeout_s=0.6)
        with front_end(settings) as front:
            base = f"{front}/ng-rollout/put-fails/training-token-capture"
            with anthropic_client(base).messages.stream(
                model="m", max_tokens=200, messages=HELLO, tools=[BASH_TOOL]
            ) as events:
                reply = events.get_final_message()
            completion = openai_client(base).chat.completions.create(model="m", messages=HELLO)
            metrics = httpx.get(front + "/metrics").text
    assert reply.content and completion.choices[0].message.content
    snapshot = freeze(tmp_path, "put-fails")
    assert snapshot.incomplete and snapshot.entries == ()
    assert "tokcap_incomplete_calls_total 2.0" in metrics
    record, build = finalize(tmp_path, "put-fails", answer_output("x"))
    assert build.masked and record["mask_sample"] is True


# Upstreams that are not quite vLLM >= 0.10.2: a real proxy in front of the engine. -------


@contextlib.contextmanager
def proxy(engine: str, rewrite_request: Any, rewrite_response: Any) -> Iterator[str]:
    app = FastAPI()
    http = httpx.AsyncClient(base_url=engine, timeout=60)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> JSONResponse:
        body = await request.json() if request.method == "POST" else None
        if path == "v1/chat/completions":
            body = rewrite_request(body)
        upstream = await http.request(request.method, "/" + path, json=body)
        data = upstream.json()
        if path == "v1/chat/completions":
            data = rewrite_response(data)
        return JSONResponse(data, status_code=upstream.status_code)

    with serve_app(app) as url:
        yield url


def _without_return_token_ids(body: dict) -> dict:
    body = dict(body)
    body.pop("return_token_ids", None)  # an older vLLM does not know the field
    return body


def _tampered(data: dict) -> dict:
    data["choices"][0]["token_ids"] = data["choices"][0]["token_ids"][:-1]
    return data


def test_upstream_without_return_token_ids_falls_back_to_tokenize(tmp_path: Path) -> None:
    # The engine says it is a vLLM before 0.10.2 at /version; only then is /tokenize trusted.
    legacy = engine_server(token_id_fields=False)
    with legacy as engine, proxy(engine, _without_return_token_ids, lambda d: d) as old:
        with front_end(file_store_settings(old, tmp_path)) as front:
            base = f"{front}/ng-rollout/old-vllm/training-token-capture"
            anthropic_client(base).messages.create(
                model="m", max_tokens=200, system="Be brief.", messages=HELLO, tools=[BASH_TOOL]
            )
            truth = httpx.get(engine + "/tokcap/ground_truth").json()
    snapshot = freeze(tmp_path, "old-vllm")
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)


def test_disagreeing_id_sources_are_not_captured(tmp_path: Path) -> None:
    with engine_server() as engine, proxy(engine, lambda b: b, _tampered) as broken:
        with front_end(file_store_settings(broken, tmp_path)) as front:
            base = f"{front}/ng-rollout/disagree/training-token-capture"
            reply = anthropic_client(base).messages.create(
                model="m", max_tokens=200, messages=HELLO
            )
    assert reply.content[-1].text  # the harness is served all the same
    snapshot = freeze(tmp_path, "disagree")
    assert snapshot.incomplete and snapshot.entries == ()


def test_entries_round_trip_with_the_recorded_override_keys(servers) -> None:
    anthropic_client(servers.base("extras-1")).messages.create(
        model="m", max_tokens=50, messages=HELLO
    )
    (entry,) = freeze(servers.store_dir, "extras-1").entries
    again = TokenEntry.coerce(entry.model_dump())
    assert again.overridden_sampling_keys == ["temperature", "top_p"]


STREAMS = {
    "/v1/messages": {"model": "m", "max_tokens": 100, "messages": HELLO, "stream": True},
    "/v1/chat/completions": {"model": "m", "messages": HELLO, "stream": True},
    "/v1/responses": {"model": "m", "input": "hello", "stream": True},
}


def _final(line: str) -> bool:
    return line == "data: [DONE]" or '"message_stop"' in line or '"response.completed"' in line


@pytest.mark.parametrize("path", list(STREAMS))
def test_the_entry_is_stored_before_the_stream_ends(servers, path: str) -> None:
    """The final event reaches the harness only over a durable entry: the moment it
    arrives, the store already holds the call."""
    rollout_id = "durable-first-" + path.strip("/").replace("/", "-")
    seen = []
    with httpx.stream(
        "POST", servers.base(rollout_id) + path, json=STREAMS[path], timeout=30
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            seen.append(line)
            if _final(line):
                assert inspect(servers.store_dir, rollout_id)["calls"] == 1
                break
    assert len(seen) > 1 and _final(seen[-1])
