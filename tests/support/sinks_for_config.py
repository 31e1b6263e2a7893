"""Sink factories that tests/capture/test_config.py names by 'module:Class' path.

They are real classes loaded through the config's import path, so the factory code runs
exactly as it does for a production sink such as transports.redis:RedisTokenSink.
"""

from __future__ import annotations

from typing import Any


class ListSink:
    """Keeps entries in a list; enough for the config to build and check it."""

    def __init__(self, label: str = "default", *, capacity: int = 10) -> None:
        self.label = label
        self.capacity = capacity
        self.entries: list[Any] = []
        self.incomplete: list[tuple[str, str]] = []
        self.closed = False

    async def put(self, entry: Any) -> None:
        self.entries.append(entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        self.incomplete.append((rollout_id, model_call_id))

    async def close(self) -> None:
        self.closed = True


class NeedsUrlSink(ListSink):
    """Requires a url, as a networked sink would."""

    def __init__(self, *, url: str) -> None:
        super().__init__(label=url)


class NoMarkIncompleteSink:
    async def put(self, entry: Any) -> None:
        return None

    async def close(self) -> None:
        return None


class PutNotCallableSink:
    put = "not a method"

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        return None

    async def close(self) -> None:
        return None


class FailingStartSink(ListSink):
    def __init__(self, url: str = "") -> None:
        raise RuntimeError("cannot reach the store")


def make_list_sink(**kwargs: Any) -> ListSink:
    """A plain factory function works as well as a class."""
    return ListSink(**kwargs)


def make_object_without_close(**kwargs: Any) -> Any:
    class HalfSink:
        async def put(self, entry: Any) -> None:
            return None

        async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
            return None

    return HalfSink()


class Namespace:
    """A nested attribute path: 'tests.support.sinks_for_config:Namespace.InnerSink'."""

    InnerSink = ListSink


NOT_CALLABLE = 42
