"""Server-sent events: the framing every dialect's stream uses.

The upstream is called without streaming so the ids can be captured whole; each dialect
(``stream`` in its module) then replays the finished reply as the events its SDK expects.
The capture put has completed before the first event is produced, so it has certainly
completed before the final one.
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
