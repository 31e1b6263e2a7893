"""``max_tokens`` lowered to the room the context window leaves.

At once when it alone exceeds ``max_model_len`` (from ``GET /v1/models``), and when the
engine refuses a prompt plus ``max_tokens`` as too long, once more with the room its error
names. The clamp, ``(asked, sent)``, is recorded on the call's entry.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from api.engine.generation import UpstreamError

log = logging.getLogger(__name__)

# How each engine names the prompt length in its context-length error (vLLM 0.10.2, vLLM
# before it, SGLang 0.5.23).
_PROMPT_LENGTH = re.compile(
    r"(\d+) input tokens|\((\d+) in the messages|(\d+) tokens from the input messages"
)

Clamp = tuple[int, int]


def prompt_length_in(message: str) -> int | None:
    """The prompt length an engine's context-length error names, or None."""
    match = _PROMPT_LENGTH.search(message)
    return int(next(group for group in match.groups() if group)) if match else None


def clamped(
    body: dict[str, Any], max_model_len: int | None, prompt_length: int = 1
) -> Clamp | None:
    """Lower ``max_tokens`` to what ``max_model_len`` leaves after the prompt; the clamp."""
    asked = body.get("max_tokens")
    if max_model_len is None or not isinstance(asked, int):
        return None
    room = max_model_len - prompt_length
    if asked <= room or room < 1:
        return None
    body["max_tokens"] = room
    return asked, room


def after_refusal(
    error: UpstreamError, body: dict[str, Any], max_model_len: int | None, clamp: Clamp | None
) -> Clamp:
    """The clamp after a context-length refusal: what the harness asked for, and the room
    the refusal names; the refusal itself, re-raised, when it names none."""
    length = prompt_length_in(error.message) if error.status == 400 else None
    retried = clamped(body, max_model_len, length) if length is not None else None
    if retried is None:
        raise error
    log.info(
        "upstream refused max_tokens %d beside %d prompt tokens; sent %d",
        retried[0],
        length,
        retried[1],
    )
    return (clamp[0] if clamp else retried[0], retried[1])
