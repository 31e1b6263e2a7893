"""An upstream URL's user and password reach the engine as basic auth, never a log line.

The client is built on the URL without them, so nothing that names the URL can show them.
"""

from __future__ import annotations

import asyncio
import base64
import logging

from api.engine.client import UpstreamClient, where, without_credentials
from api.engine.generation import Generation, UpstreamError
from tests.support.frontend import engine_server
from tests.support.servers import free_port

USER, SECRET = "gym", "pw-0c61e5"


def test_the_url_is_split_from_its_credentials() -> None:
    bare, auth = without_credentials(f"http://{USER}:{SECRET}@127.0.0.1:9/v1")
    assert bare == "http://127.0.0.1:9/v1"
    expected = base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
    assert auth == f"Basic {expected}"
    assert without_credentials("http://127.0.0.1:9") == ("http://127.0.0.1:9", None)
    assert where(f"https://{USER}:{SECRET}@example.org:8443/v1") == "https://example.org:8443"


def test_no_credential_in_the_clients_log_lines_or_errors(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with engine_server() as engine:
        url = engine.replace("http://", f"http://{USER}:{SECRET}@")

        async def call() -> Generation:
            client = UpstreamClient(url)
            try:
                return await client.chat({"messages": [{"role": "user", "content": "hi"}]})
            finally:
                await client.close()

        generation = asyncio.run(call())
    assert generation.ids_problem is None and generation.generation_token_ids

    async def unreachable() -> str:
        client = UpstreamClient(f"http://{USER}:{SECRET}@127.0.0.1:{free_port()}/v1")
        try:
            await client.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        except UpstreamError as exc:
            return str(exc) + exc.message
        finally:
            await client.close()
        raise AssertionError("a closed port answered")

    message = asyncio.run(unreachable())
    assert "unreachable" in message
    for text in (caplog.text, message):
        assert SECRET not in text and USER not in text
