"""The front end on the Redis sink the config names: the same capture, shared by workers.

The sink is built from ``token_id_capture.sink`` / ``sink_kwargs`` in each worker's startup;
a Redis that is not durable is refused there, before any call is served.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from api.app import create_app
from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.delivery import finalize_rollout_token_capture
from tests.support.frontend import (
    BASH_TOOL,
    assert_entries_equal_ground_truth,
    assert_one_contiguous_chain,
    engine_server,
    front_end,
    run,
)
from transports.redis import RedisTokenStore


def redis_settings(upstream: str, url: str, prefix: str) -> ServerSettings:
    capture = TokenIdCaptureConfig(
        enabled=True,
        sink="transports.redis:RedisTokenSink",
        sink_kwargs={"url": url, "key_prefix": prefix},
    )
    return ServerSettings(
        upstream=upstream, capture=capture, sampling_overrides={"temperature": 0.5}
    )


def test_streamed_tool_loop_on_the_redis_sink(redis_url: str, redis_prefix: str) -> None:
    rollout_id = "redis-loop-1"
    with (
        engine_server() as engine,
        front_end(redis_settings(engine, redis_url, redis_prefix)) as front,
    ):
        sdk = anthropic.Anthropic(
            base_url=f"{front}/ng-rollout/{rollout_id}/training-token-capture",
            api_key="dummy",
            max_retries=0,
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "run echo hello"}]
        while True:
            with sdk.messages.stream(
                model="m", max_tokens=64000, messages=messages, tools=[BASH_TOOL]
            ) as events:
                reply = events.get_final_message()
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in reply.content],
                }
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": u.id, "content": "hello"}
                        for u in uses
                    ],
                }
            )
        truth = httpx.get(engine + "/tokcap/ground_truth").json()

    async def rebuild() -> tuple[Any, dict, Any]:
        store = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
        try:
            record = {"_ng_rollout_id": rollout_id, "response": {"output": []}}
            build = await finalize_rollout_token_capture(record, store)
            return await store.freeze(rollout_id), record, build
        finally:
            await store.close()

    snapshot, record, build = run(rebuild())
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)
    assert_one_contiguous_chain(build, record, 3)


async def test_an_undurable_redis_is_refused_at_startup(
    redis_server_factory, redis_prefix: str
) -> None:
    server = redis_server_factory(appendonly="no")
    app = create_app(redis_settings("http://127.0.0.1:1", server.url, redis_prefix))
    with pytest.raises(Exception, match="(?i)appendonly|AOF|durab"):
        async with app.router.lifespan_context(app):
            pass
