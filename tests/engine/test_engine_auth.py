"""``--api-key``: each wire asks for the key on exactly the paths its engine guards."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.support.servers import free_port, run_process, serve_app
from tokcap_devtools.engine import EngineSettings, create_app

KEY = "test-key-0123456789"
GOOD = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
UNAUTHORIZED = {"error": "Unauthorized"}


def call(base: str, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    body = CHAT if method == "POST" else None
    return httpx.request(method, base + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("wire", "guarded", "open_paths"),
    [
        ("vllm", ["/v1/models", "/v1/chat/completions"], ["/health", "/version", "/nope"]),
        (
            "sglang",
            ["/v1/models", "/v1/chat/completions", "/get_server_info", "/generate", "/nope"],
            ["/health", "/health_generate", "/metrics"],
        ),
    ],
)
def test_key_is_required_where_the_engine_requires_it(wire, guarded, open_paths):
    with serve_app(create_app(EngineSettings(wire=wire, api_key=KEY))) as base:
        for path in guarded:
            method = "POST" if path in ("/v1/chat/completions", "/generate") else "GET"
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                refused = call(base, method, path, headers)
                assert (refused.status_code, refused.json()) == (401, UNAUTHORIZED), path
            assert call(base, method, path, GOOD).status_code != 401, path
            assert KEY not in call(base, method, path).text
        for path in open_paths:
            assert call(base, "GET", path).status_code != 401, path
        assert httpx.options(base + "/v1/models", timeout=30).status_code != 401


def test_cli_takes_the_key_from_the_environment_and_never_shows_it():
    shown = subprocess.run(
        [sys.executable, "-m", "tokcap_devtools.engine.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"TOKCAP_ENGINE_API_KEY": KEY, "PATH": ""},
    )
    assert "--api-key" in shown.stdout and KEY not in shown.stdout + shown.stderr
    assert KEY not in repr(EngineSettings(api_key=KEY))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["python", "-m", "tokcap_devtools.engine.cli", "--port", str(port), "--wire", "sglang"]
    with run_process(args, ready_url=f"{base}/health", env={"TOKCAP_ENGINE_API_KEY": KEY}):
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=GOOD, timeout=30).status_code == 200
