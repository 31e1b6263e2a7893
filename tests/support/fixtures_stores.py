"""Fixtures that build every store, so contract tests run once per store.

Adding a store kind means adding one async factory to ``STORE_FACTORIES``; the ``store``
fixture is parametrized over its keys. A factory gets the pytest ``request`` (to ask for
other fixtures, such as a private redis-server) and a fresh ``tmp_path``.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry

StoreFactory = Callable[[pytest.FixtureRequest, Path], Awaitable[Any]]


async def _file_store(request: pytest.FixtureRequest, tmp_path: Path) -> FileTokenStore:
    return FileTokenStore(tmp_path / "captures")


async def _redis_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from transports.redis import RedisTokenStore

    # A key prefix of its own per test, so stores sharing one server never see each other.
    prefix = request.getfixturevalue("redis_prefix")
    return RedisTokenStore(url=request.getfixturevalue("redis_url"), key_prefix=prefix)


async def _redis_cluster_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from transports.redis import RedisTokenStore

    cluster = request.getfixturevalue("redis_cluster")
    prefix = request.getfixturevalue("redis_prefix")
    return RedisTokenStore(url=cluster.url, cluster=True, key_prefix=prefix)


STORE_FACTORIES: dict[str, StoreFactory] = {
    "file": _file_store,
    "redis": _redis_store,
    "redis-cluster": _redis_cluster_store,
}


@pytest.fixture(params=list(STORE_FACTORIES))
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh, empty store of each kind; closed after the test."""
    made = await STORE_FACTORIES[request.param](request, tmp_path)
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def redis_store(redis_url: str, redis_prefix: str) -> Any:
    """A RedisTokenStore on the test server under the test's own prefix; closed after."""
    from transports.redis import RedisTokenStore

    made = RedisTokenStore(url=redis_url, key_prefix=redis_prefix)
    try:
        yield made
    finally:
        await made.close()


_call_numbers = itertools.count()


def make_token_entry(
    rollout_id: str = "rollout-1",
    model_call_id: str | None = None,
    prompt: list[int] | None = None,
    generation: list[int] | None = None,
    log_probs: list[float] | None = None,
    **extra: Any,
) -> TokenEntry:
    """A valid entry; unspecified arrays are small and distinct per call."""
    number = next(_call_numbers)
    model_call_id = model_call_id or f"call-{number:06d}"
    if prompt is None:
        prompt = [1, 2, 3, 100 + number % 1000]
    if generation is None:
        generation = [7, 8, 9 + number % 1000]
    if log_probs is None:
        log_probs = [-0.125 * (i + 1) for i in range(len(generation))]
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "model": "test-policy",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": log_probs,
        "output_items": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer {model_call_id}"}],
            }
        ],
        "token_item_index": 0,
    }
    fields.update(extra)
    return TokenEntry(**fields)


@pytest.fixture
def make_entry() -> Callable[..., TokenEntry]:
    """Factory of valid entries: ``make_entry(rollout_id, model_call_id, prompt=..., ...)``."""
    return make_token_entry


SHARED_PREFIX = list(range(5000, 5700))  # spans blocks, so writers race to store the same ones


def shared_entry(writer: int, index: int) -> TokenEntry:
    """One writer's call into the rollout every writer shares (deterministic)."""
    return make_token_entry(
        "shared",
        f"w{writer}-c{index:03d}",
        prompt=SHARED_PREFIX + [writer, index] * (index % 5 + 1),
        generation=[writer, index, 7],
        log_probs=[-0.5, -0.25, -1.0 / (index + 1)],
        created_at=1_700_000_000.0 + index,
        writer=writer,
    )
