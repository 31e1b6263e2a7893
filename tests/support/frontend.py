"""Shared pieces of the front-end tests: both servers on 127.0.0.1, and the checks.

The engine (the tokcap engine's app, scripted policy) and the front end (``create_app``
with the file store) run for real under uvicorn; clients are the official SDKs. The checks
compare what the store captured with the engine's ground truth, and rebuild the rollout
with ``finalize_rollout_token_capture`` on the same store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.delivery import RolloutBuild, finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.records import TokenCaptureSnapshot
from tests.support.servers import serve_app
from tokcap_devtools.engine.server import create_app as create_engine_app
from tokcap_devtools.engine.settings import EngineSettings

OVERRIDES = {"temperature": 0.75, "top_p": 0.95}
# ``tokcap serve --config`` for the tokcap engine and the Redis TOKCAP_REDIS_URL names (its
# password stays in the environment, out of the file and the command line).
REDIS_SERVE_CONFIG = """
model_server:
  model: tokcap-engine
  sampling_overrides: {temperature: 1.0, top_p: 1.0, top_k: -1, min_p: 0.0,
                       repetition_penalty: 1.0}
token_id_capture:
  enabled: true
  sink: transports.redis:RedisTokenSink
  sink_kwargs: {url: "${oc.env:TOKCAP_REDIS_URL}"}
  rebuild_response: false
"""
BASH_TOOL = {
    "name": "Bash",
    "description": "Run a shell command and return its output.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}


def sdk_tool_loop(
    sdk: Any,
    messages: list[dict[str, Any]],
    *,
    before_call: Callable[[int], None] | None = None,
    max_calls: int = 8,
    **create: Any,
) -> tuple[int, Any]:
    """An Anthropic SDK tool loop from ``messages`` (extended in place) until the model stops
    calling tools, each tool answered "ok"; ``before_call(n)`` runs before call ``n``
    (0-based). Returns (the number of calls, the last reply)."""
    create = {"model": "m", "max_tokens": 2000, "tools": [BASH_TOOL], **create}
    for n in range(max_calls):
        if before_call is not None:
            before_call(n)
        reply = sdk.messages.create(messages=messages, **create)
        content = [block.model_dump(exclude_none=True) for block in reply.content]
        messages.append({"role": "assistant", "content": content})
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            return n + 1, reply
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "ok"} for u in uses]
        messages.append({"role": "user", "content": results})
    raise AssertionError(f"the tool loop did not end in {max_calls} calls")


@dataclass
class Servers:
    engine: str
    front: str
    store_dir: Path

    def base(self, rollout_id: str) -> str:
        return f"{self.front}/ng-rollout/{rollout_id}/training-token-capture"

    def ground_truth(self) -> list[dict[str, Any]]:
        response = httpx.get(self.engine + "/tokcap/ground_truth", timeout=30)
        response.raise_for_status()
        return response.json()

    def clear_ground_truth(self) -> None:
        httpx.delete(self.engine + "/tokcap/ground_truth", timeout=30).raise_for_status()


@contextlib.contextmanager
def engine_server(port: int | None = None, **settings: Any) -> Iterator[str]:
    """The engine in a thread (on ``port``, else a free one); its ground-truth route is on
    (the checks read it)."""
    settings.setdefault("ground_truth", True)
    with serve_app(create_engine_app(EngineSettings(**settings)), port=port) as url:
        yield url


def file_store_settings(upstream: str, store_dir: Path, **overrides: Any) -> ServerSettings:
    """Front-end settings with capture on the file store, built through the capture config."""
    capture = TokenIdCaptureConfig(enabled=True, dir=str(store_dir))
    fields: dict[str, Any] = {
        "upstream": upstream,
        "capture": capture,
        "sampling_overrides": OVERRIDES,
    }
    fields.update(overrides)
    return ServerSettings(**fields)


@contextlib.contextmanager
def front_end(settings: ServerSettings) -> Iterator[str]:
    with serve_app(create_app(settings)) as url:
        yield url


@contextlib.contextmanager
def both_servers(
    store_dir: Path, engine: dict[str, Any] | None = None, **front: Any
) -> Iterator[Servers]:
    with engine_server(**(engine or {})) as engine_url:
        with front_end(file_store_settings(engine_url, store_dir, **front)) as front_url:
            yield Servers(engine_url, front_url, store_dir)


def run(coro: Any) -> Any:
    """Run store work on a fresh loop (the SDK clients in these tests are synchronous)."""
    return asyncio.run(coro)


async def _with_store(store_dir: Path, work: Any) -> Any:
    store = FileTokenStore(store_dir)
    try:
        return await work(store)
    finally:
        await store.close()


def inspect(store_dir: Path, rollout_id: str) -> dict[str, Any]:
    return run(_with_store(store_dir, lambda store: store.inspect(rollout_id)))


def freeze(store_dir: Path, rollout_id: str) -> TokenCaptureSnapshot:
    return run(_with_store(store_dir, lambda store: store.freeze(rollout_id)))


def finalize(
    store_dir: Path, rollout_id: str, output: list[dict[str, Any]], delivery: str = "chain"
) -> tuple[dict, RolloutBuild]:
    """Rebuild the rollout as a trainer would; returns (the record, the build)."""
    record = {"_ng_rollout_id": rollout_id, "response": {"output": output}}

    async def work(store: FileTokenStore) -> RolloutBuild:
        return await finalize_rollout_token_capture(record, store, delivery=delivery)

    return record, run(_with_store(store_dir, work))


def answer_output(text: str) -> list[dict[str, Any]]:
    """The harness's final answer as a Responses output list."""
    return [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    ]


def assert_entries_equal_ground_truth(
    snapshot: TokenCaptureSnapshot, truth: list[dict[str, Any]]
) -> None:
    """Every entry is one sampled sequence, exactly (ids and log-probs), and none is missing."""
    assert len(snapshot.entries) == len(truth), (len(snapshot.entries), len(truth))
    remaining = list(truth)
    for entry in snapshot.entries:
        match = [
            record
            for record in remaining
            if record["prompt_token_ids"] == entry.prompt_token_ids
            and record["token_ids"] == entry.generation_token_ids
        ]
        assert len(match) == 1, (
            f"entry {entry.model_call_id} matches {len(match)} ground-truth records"
        )
        assert entry.generation_log_probs == match[0]["logprobs"]
        remaining.remove(match[0])


def assert_one_contiguous_chain(build: RolloutBuild, record: dict[str, Any], n_calls: int) -> None:
    """The rebuilt rollout is one chain through every call, delivered whole."""
    assert build.ok and not build.masked, build.metrics
    assert build.metrics["n_calls"] == n_calls
    assert build.metrics["chains"] == 1
    assert build.metrics["delivered_fraction"] == 1.0
    carriers = [item for item in record["response"]["output"] if "generation_token_ids" in item]
    assert len(carriers) == n_calls
    running: list[int] = []
    for item in carriers:
        # Each call's prompt extends everything before it: one token sequence, no gaps.
        assert item["prompt_token_ids"][: len(running)] == running
        running = item["prompt_token_ids"] + item["generation_token_ids"]


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(event name, data) pairs of an SSE body."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                raw = line[len("data: ") :]
                data = raw if raw == "[DONE]" else json.loads(raw)
        events.append((name, data))
    return events
