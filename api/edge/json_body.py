"""A request body parsed as one JSON object, refusing what nothing downstream can use.

The stdlib parser accepts nesting beyond any use and lone surrogates; the first would blow
the stack of every later step that walks the body, the second cannot be encoded to send
upstream. Both are a ``BodyError`` (a 400) instead.

orjson parses a body in a third of the stdlib's time and gives the same values, except
that it reads an integer beyond 64 bits as a float, where the stdlib keeps it exact (so
that ``max_tokens: 10**30`` is refused by name). A float of 2**63 or more is the only form
such an integer takes, and it is written with 19 digits at least; a body that may hold one
is walked value by value, and one that does is parsed again by the stdlib. Most bodies are
not walked value by value: their depth is checked over their containers alone, and their
bytes scanned for 19 digits (a body of few elements in many bytes is walked, sooner done).
A body orjson refuses (``NaN``, a lone surrogate, another encoding) is read by the stdlib
as before (``api.jsonbytes.loads``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from api import jsonbytes

MAX_JSON_DEPTH = 128
# orjson reads an integer beyond 64 bits (below -2**63 or above 2**64 - 1) as a float at
# least this large; the stdlib reads such a body again.
HUGE_FLOAT = float(2**63)
# Only a \u escape can produce a surrogate (raw surrogate bytes are invalid UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# An integer of 2**63 or more, or below -2**63, is written with 19 digits at least: found
# as 19 zeros once every digit reads as 0 and every other byte as a space (a regex takes
# 20 times as long).
_DIGITS_AS_ZERO = bytes(ord("0") if chr(i).isdigit() and i < 128 else ord(" ") for i in range(256))
_LONG_DIGITS = b"0" * 19
# The walk looks at an element in about the time the scan takes for this many bytes.
BYTES_PER_ELEMENT = 200
_CONTAINERS = (dict, list)


class BodyError(ValueError):
    """A request body that cannot be served; the message says why, for a 400."""


def _check_shape(value: Any, check_strings: bool) -> bool:
    """Depth within MAX_JSON_DEPTH and, when asked, every string encodable (no recursion);
    whether a float of 2**63 or more is in it (orjson's reading of a larger integer)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    huge = False
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
            elif isinstance(item, float) and not -HUGE_FLOAT < item < HUGE_FLOAT:
                huge = True
            continue
        if depth > MAX_JSON_DEPTH:
            raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)
    return huge


def _depth_and_size(value: Any) -> tuple[bool, int]:
    """Whether a container lies deeper than MAX_JSON_DEPTH, and how many elements the body
    holds: walked a level at a time over its containers alone (a harness's body holds
    thousands of scalars: tool schemas, content blocks)."""
    level, depth, elements = [value], 1, 0
    while level:
        if depth > MAX_JSON_DEPTH:
            return True, elements
        elements += sum(map(len, level))
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) in _CONTAINERS
        ]
        depth += 1
    return False, elements


def _parsed(raw: bytes, loads: Callable[[bytes], Any]) -> dict[str, Any]:
    try:
        body = loads(raw)
    except RecursionError:
        raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # invalid JSON or invalid UTF-8
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a ``BodyError`` that says what is wrong with it."""
    check_strings = _SURROGATE_ESCAPE.search(raw) is not None
    body = _parsed(raw, jsonbytes.loads)
    huge = _check_shape(body, True) if check_strings else _may_be_huge(body, raw)
    if huge:  # perhaps an integer beyond 64 bits: read it exactly
        body = _parsed(raw, jsonbytes.loads_stdlib)
        _check_shape(body, check_strings)
    return body


def _may_be_huge(body: Any, raw: bytes) -> bool:
    """Whether a body without a surrogate escape holds a float of 2**63 or more, its depth
    checked on the way: a body of few elements (one long message) is walked for one sooner
    than its bytes are scanned for 19 digits; a body of many is walked only when the scan
    finds them (perhaps in a string)."""
    too_deep, elements = _depth_and_size(body)
    if too_deep:
        raise BodyError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    walked = elements * BYTES_PER_ELEMENT < len(raw)
    if not walked and _LONG_DIGITS not in raw.translate(_DIGITS_AS_ZERO):
        return False
    return _check_shape(body, False)
