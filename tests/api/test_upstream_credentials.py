"""An upstream URL's user and password reach the engine as basic auth, never a log line.

httpx logs each request's URL at INFO; the client is built on the URL without them.
"""

from __future__ import annotations

import asyncio
import base64
import logging

import httpx

from api.upstream import UpstreamClient, where, without_credentials
from tests.support.frontend import engine_server

USER, SECRET = "gym", "pw-0c61e5"


def test_the_url_is_split_from_its_credentials() -> None:
    bare, auth = without_credentials(f"http://{USER}:{SECRET}@127.0.0.1:9/v1")
    assert bare == "http://127.0.0.1:9/v1"
    request = next(auth.auth_flow(httpx.Request("GET", bare)))
    expected = base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
    assert request.headers["authorization"] == f"Basic {expected}"
    assert without_credentials("http://127.0.0.1:9") == ("http://127.0.0.1:9", None)
    assert where(f"https://{USER}:{SECRET}@example.org:8443/v1") == "https://example.org:8443"


def test_no_credential_in_the_clients_log_lines(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with engine_server() as engine:
        url = engine.replace("http://", f"http://{USER}:{SECRET}@")

        async def call() -> None:
            client = UpstreamClient(url)
            try:
                await client.chat({"messages": [{"role": "user", "content": "hi"}]})
            finally:
                await client.close()

        asyncio.run(call())
    assert "HTTP Request" in caplog.text  # httpx did log the request
    assert SECRET not in caplog.text and USER not in caplog.text
