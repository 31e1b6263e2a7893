"""What the adapters share: the chat body every engine is sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def chat_body(
    params: Mapping[str, Any],
    chat_request: Mapping[str, Any],
    model: str,
    overrides: Mapping[str, Any],
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The chat request with an engine's capture ``params``, then ``sampling_overrides``.

    Returns the body and which sampling keys the overrides replaced or added. Streams are
    never asked for: the ids are read from the whole reply.
    """
    body = {**chat_request, "model": model, **params}
    body.pop("stream_options", None)
    body.update(overrides)
    return body, tuple(sorted(overrides))
