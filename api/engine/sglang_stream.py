"""An SGLang token-in stream (``/generate``), read as it arrives.

Followed: SGLang 0.5.23's ``/generate`` with ``stream`` (``tokenizer_manager.py``): by
default every event carries everything so far (``text``, ``output_ids``, ``meta_info``
with the cumulative ``output_token_logprobs``), so the last event is the whole reply, in
exactly the shape ``sglang.read_tokens`` checks. An event is parsed only when its ids are
asked for: a relay that looks at the ids every few events pays for those, and the last
event, not for each of a reply's growing copies. A server started with
``--stream-output`` (disjoint segments) ends with a partial last event, whose counts the
checks refuse: such a call is lost, never captured short.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from api.engine.http import sse_chunk


@dataclass
class StreamedGenerate:
    """The latest event of one ``/generate`` stream, parsed when asked."""

    latest: str | None = None  # the last event's data, not parsed yet
    parsed: Any = None  # the last event parsed

    def add(self, data: str) -> None:
        self.latest = data

    def _last(self) -> Any:
        if self.latest is not None:
            self.parsed, self.latest = sse_chunk(self.latest), None
        return self.parsed

    def sampled(self) -> list[Any]:
        """The ids sampled so far: the last event's ``output_ids``."""
        event = self._last()
        ids = event.get("output_ids") if isinstance(event, Mapping) else None
        return ids if isinstance(ids, list) else []

    def unfinished(self) -> str | None:
        if not isinstance(self._last(), Mapping):
            return "the stream ended without a reply event"
        return None

    def response(self) -> dict[str, Any]:
        event = self._last()
        return dict(event) if isinstance(event, Mapping) else {}
