"""Server-sent events: the framing every dialect's stream uses.

Each dialect builds its events with it: relayed as the engine samples (``Relay`` in its
module), or replayed from the finished reply (``events``); ``api.call.serve`` decides which,
sends the keep-alive, and sends the final event only once the call's entry is durable.
"""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(name: str | None, data: Any) -> bytes:
    """One SSE event; ``name`` None gives a data-only event (OpenAI Chat style)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {payload}\n\n".encode()
