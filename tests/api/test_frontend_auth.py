"""Keys (issue 14): with ``model_server.auth_secret`` every path but the probes needs a key.

The key travels as harnesses send one (``x-api-key`` or ``Authorization: Bearer``); a
rollout's own paths also take its token (``capture.rollout_token``), which no other path
takes; the secret opens every path. Refusals are 401s in the caller's dialect, read by the
official SDKs as their authentication errors, and no key shows in a body or a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from api.settings import ServerSettings
from capture import rollout_token
from capture.errors import ConfigError, InvalidRolloutIdError
from tests.support.frontend import Servers, both_servers, inspect

SECRET = "s3cret-for-tests-0123456789abcdef"
MESSAGE = {"model": "policy", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": "policy", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with both_servers(tmp_path_factory.mktemp("captures"), auth_secret=SECRET) as running:
        yield running


@pytest.fixture
def every_log_line(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


def claude(base: str, key: str | None = None, token: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, auth_token=token, max_retries=0)


def gpt(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


# The token ------------------------------------------------------------------------------


def test_rollout_token_is_a_prefixed_hmac_of_the_rollout_id() -> None:
    import hashlib
    import hmac

    token = rollout_token(SECRET, "17-4")
    digest = hmac.new(SECRET.encode(), b"17-4", hashlib.sha256).hexdigest()
    assert token == "tkr_" + digest
    assert token == rollout_token(SECRET, "17-4"), "the collector and the front end agree"
    assert token != rollout_token(SECRET, "17-5")
    assert token != rollout_token(SECRET + "x", "17-4")
    with pytest.raises(InvalidRolloutIdError):
        rollout_token(SECRET, "../17-4")
    with pytest.raises(ValueError):
        rollout_token("", "17-4")


def test_auth_secret_from_yaml_or_environment_and_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GYM_TOKCAP_SECRET", SECRET)
    path = tmp_path / "serve.yaml"
    path.write_text("model_server:\n  auth_secret: ${oc.env:GYM_TOKCAP_SECRET}\n")
    from_yaml = ServerSettings.from_document(str(path), environ={})
    assert from_yaml.auth_secret == SECRET
    assert SECRET not in repr(from_yaml)
    from_env = ServerSettings.from_document({}, environ={"TOKCAP_AUTH_SECRET": SECRET})
    assert from_env.auth_secret == SECRET and SECRET not in repr(from_env)
    assert ServerSettings.from_document({}, environ={}).auth_secret is None
    with pytest.raises(ConfigError, match="at least 16") as refused:
        ServerSettings(auth_secret="short-secret")
    assert "short-secret" not in str(refused.value)


# Refusals, per dialect ------------------------------------------------------------------


@pytest.mark.parametrize("tagged", [True, False], ids=["rollout-path", "untagged"])
def test_anthropic_routes_refuse_a_call_without_the_key(servers: Servers, tagged: bool) -> None:
    base = servers.base("auth-a") if tagged else servers.front
    sdk = claude(base, key="not-the-key")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        sdk.messages.create(**MESSAGE)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        sdk.messages.count_tokens(model="policy", messages=MESSAGE["messages"])
    with pytest.raises(anthropic.AuthenticationError):
        sdk.models.list()
    assert inspect(servers.store_dir, "auth-a")["state"] == "absent", "nothing was captured"


@pytest.mark.parametrize("tagged", [True, False], ids=["rollout-path", "untagged"])
def test_openai_routes_refuse_a_call_without_the_key(servers: Servers, tagged: bool) -> None:
    base = servers.base("auth-o") if tagged else servers.front
    sdk = gpt(base, "not-the-key")
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk.chat.completions.create(**CHAT)
    assert refused.value.status_code == 401
    assert "API key" in refused.value.message
    with pytest.raises(openai.AuthenticationError):
        sdk.responses.create(model="policy", input="hi", max_output_tokens=20)
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()
    assert inspect(servers.store_dir, "auth-o")["state"] == "absent"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/messages",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages/count_tokens",
    ],
)
def test_no_header_at_all_is_a_401_before_the_body_is_read(servers: Servers, path: str) -> None:
    for base in (servers.front, servers.base("auth-raw")):
        response = httpx.post(base + path, content=b"{not json", timeout=30)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(servers.front + "/v1/models", timeout=30).status_code == 401


@pytest.mark.parametrize(
    "path", ["//v1/messages", "/v1/messages/", "/V1/messages", "/v1/nothing", "/openapi.json"]
)
def test_any_other_spelling_is_closed_too(servers: Servers, path: str) -> None:
    for base in (servers.front, servers.base("auth-odd")):
        assert httpx.post(base + path, json=MESSAGE, timeout=30).status_code == 401
    assert inspect(servers.store_dir, "auth-odd")["state"] == "absent"


def test_docs_pages_when_turned_on_need_no_key(tmp_path: Path) -> None:
    with both_servers(tmp_path, auth_secret=SECRET, docs=True) as servers:
        for page in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(servers.front + page, timeout=30).status_code == 200
        assert httpx.post(servers.front + "/v1/messages", json=MESSAGE).status_code == 401


def test_probes_stay_open(servers: Servers) -> None:
    for base in (servers.front, servers.base("auth-probe")):
        for path in ("/", "/v1"):
            assert httpx.head(base + path, timeout=30).status_code == 200
            assert httpx.get(base + path, timeout=30).status_code == 200
    assert httpx.get(servers.front + "/health", timeout=30).status_code == 200
    assert httpx.get(servers.front + "/ready", timeout=30).status_code == 200


# Tokens and the secret ------------------------------------------------------------------


def test_a_rollout_token_opens_its_own_rollout_only(servers: Servers) -> None:
    token = rollout_token(SECRET, "auth-mine")
    # x-api-key (ANTHROPIC_API_KEY) and Bearer (ANTHROPIC_AUTH_TOKEN, OpenAI SDKs) alike.
    reply = claude(servers.base("auth-mine"), key=token).messages.create(**MESSAGE)
    assert reply.content
    claude(servers.base("auth-mine"), token=token).messages.create(**MESSAGE)
    gpt(servers.base("auth-mine"), token).chat.completions.create(**CHAT)
    assert inspect(servers.store_dir, "auth-mine")["calls"] == 3
    # The same rollout without capture is still its own path.
    uncaptured = f"{servers.front}/ng-rollout/auth-mine"
    assert claude(uncaptured, key=token).messages.create(**MESSAGE).content

    for elsewhere in (servers.base("auth-theirs"), servers.front):
        with pytest.raises(anthropic.AuthenticationError):
            claude(elsewhere, key=token).messages.create(**MESSAGE)
        with pytest.raises(openai.AuthenticationError):
            gpt(elsewhere, token).chat.completions.create(**CHAT)
    assert inspect(servers.store_dir, "auth-theirs")["state"] == "absent"


def test_the_secret_opens_every_path(servers: Servers) -> None:
    claude(servers.front, key=SECRET).messages.create(**MESSAGE)
    gpt(servers.front, SECRET).models.list()
    claude(servers.base("auth-collector"), token=SECRET).messages.create(**MESSAGE)
    assert inspect(servers.store_dir, "auth-collector")["calls"] == 1


def test_no_key_in_any_reply_or_log_line(
    servers: Servers, every_log_line: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
) -> None:
    mine, theirs = rollout_token(SECRET, "auth-leak"), rollout_token(SECRET, "auth-other")
    seen: list[str] = []
    attempts: list[tuple[str, dict[str, Any]]] = [
        (servers.base("auth-leak"), {"x-api-key": theirs}),
        (servers.base("auth-leak"), {"authorization": f"Bearer {SECRET}x"}),
        (servers.base("auth-other"), {"x-api-key": mine}),
        (servers.front, {"authorization": f"Bearer {mine}"}),
        (servers.base("auth-leak"), {"x-api-key": mine}),
        (servers.front, {"x-api-key": SECRET}),
    ]
    with httpx.Client(timeout=30) as client:
        for base, headers in attempts:
            for path, body in (("/v1/messages", MESSAGE), ("/v1/chat/completions", CHAT)):
                response = client.post(base + path, json=body, headers=headers)
                seen.append(response.text)
                seen.extend(f"{name}: {value}" for name, value in response.headers.items())
            response = client.post(base + "/v1/messages", content=b"{", headers=headers)
            seen.append(response.text)
    assert any("authentication_error" in text for text in seen)
    out, err = capfd.readouterr()
    seen += [out, err, *(record.getMessage() for record in every_log_line.records)]
    for secret in (SECRET, mine, theirs, mine[4:], SECRET + "x"):
        assert not [text for text in seen if secret in text], "a key was shown"
