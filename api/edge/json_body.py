"""A request body parsed as one JSON object, refusing what nothing downstream can use.

The stdlib parser accepts nesting beyond any use and lone surrogates; the first would blow
the stack of every later step that walks the body, the second cannot be encoded to send
upstream. Both are a ``BodyError`` (a 400) instead.
"""

from __future__ import annotations

import re
from typing import Any

from api import jsonbytes

MAX_JSON_DEPTH = 128
# Only a \u escape can produce a surrogate (raw surrogate bytes are invalid UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyError(ValueError):
    """A request body that cannot be served; the message says why, for a 400."""


def _check_shape(value: Any, check_strings: bool) -> None:
    """Depth within MAX_JSON_DEPTH and, when asked, every string encodable (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()] if check_strings else item.values()
        elif isinstance(item, list):
            children = item
        else:
            if check_strings and isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise BodyError("request body holds a lone UTF-16 surrogate") from None
            continue
        if depth > MAX_JSON_DEPTH:
            raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a ``BodyError`` that says what is wrong with it."""
    try:
        body = jsonbytes.loads_stdlib(raw)
    except RecursionError:
        raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # invalid JSON or invalid UTF-8
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    _check_shape(body, check_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body
