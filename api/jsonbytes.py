"""JSON to and from bytes: orjson where it gives the stdlib's result, the stdlib where not.

The upstream reply carries every prompt id (~16,000 numbers for a long agent turn); the
stdlib spends about a millisecond on it each way, orjson a fraction of that. orjson refuses
some input the stdlib accepts (``NaN`` and ``Infinity`` literals, lone surrogates, integers
beyond 64 bits when writing, non-string keys), so each function tries orjson first and
falls back to the stdlib with the settings used before (httpx's request encoder, Starlette's
``JSONResponse``). A non-finite number read by the stdlib is kept as a float subclass that
orjson refuses, so writing it out again takes the stdlib path and fails as it always did
(``allow_nan=False``) instead of becoming ``null``. orjson reads an integer beyond 64 bits
as a float, so a harness body that may hold one is read again by ``loads_stdlib``, where
every integer stays exact (``api.edge.json_body``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response


class NonFiniteFloat(float):
    """``NaN``/``Infinity`` read from a body; orjson will not write it (see module doc)."""


def loads(data: bytes | str) -> Any:
    """Parse JSON; ``ValueError`` (``json.JSONDecodeError``) for what the stdlib refuses."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data, parse_constant=NonFiniteFloat)


def loads_stdlib(data: bytes | str) -> Any:
    """The stdlib's parse (big integers stay exact), non-finite numbers marked as above."""
    return json.loads(data, parse_constant=NonFiniteFloat)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; ``ValueError`` for a non-finite number, as the stdlib raises."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: let the stdlib encode it or say why not
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8"
        )


class JSONBytesResponse(Response):
    """Starlette's ``JSONResponse``, rendered by ``dumps``."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
