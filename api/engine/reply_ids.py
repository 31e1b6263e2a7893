"""An engine reply whose long list of prompt ids is read off its bytes, not parsed into ints.

A chat reply at a 16k-token prompt is mostly its ``prompt_token_ids``: parsing them makes a
Python int per id, which the checks then pack to uint32 and which are freed again, about
0.4 ms of a captured call's CPU. Here the list is found in the bytes, proven to be nothing
but JSON integers (digits and commas), converted by numpy's C parser straight to packed
uint32, and the rest of the reply parsed with the list left empty. The ids come back as
``PackedIds``, which read like the list they stand for.

The fast read applies only where it cannot be fooled: the field's name occurs once in the
whole reply, its list holds digits and commas alone (no spaces, signs, fractions, exponents,
leading zeros or booleans), and the reply parsed without it has that field, empty, at its top
level. Anything else is parsed whole, as before, so the usual checks name what is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy

from api import jsonbytes
from capture.codec.packed import PackedIds

# Below about 3,000 ids (a list of some 18 KB) numpy's fixed costs exceed what it saves.
FAST_FROM_BYTES = 16_384


def loads_with_ids(raw: bytes, key: str) -> Any:
    """The reply as ``jsonbytes.loads`` parses it, its top-level ``key`` a ``PackedIds`` when
    the fast read applies (see the module docstring); ``ValueError`` for invalid JSON."""
    if len(raw) < FAST_FROM_BYTES:
        return jsonbytes.loads(raw)
    marker = b'"' + key.encode() + b'":['
    at = raw.find(marker)
    if at < 0 or raw.find(marker, at + 1) >= 0:
        return jsonbytes.loads(raw)
    start = at + len(marker)
    end = raw.find(b"]", start)
    packed = _packed_digits(raw[start:end]) if end - start >= FAST_FROM_BYTES else None
    if packed is None:
        return jsonbytes.loads(raw)
    reply = jsonbytes.loads(raw[:start] + raw[end:])
    if not isinstance(reply, dict) or reply.get(key) != []:
        return jsonbytes.loads(raw)
    reply[key] = PackedIds(packed)
    return reply


def _packed_digits(span: bytes) -> bytes | None:
    """Comma-separated JSON integers as little-endian uint32, or None where the span is
    anything else or an id does not fit uint32 (then the whole parse decides)."""
    count = _numbers_in(span)
    if count is None:
        return None
    # numpy's text parser; a number too long for int64 saturates, and is refused below.
    try:
        values = numpy.fromstring(span, dtype=numpy.int64, sep=",")  # type: ignore[call-overload]
    except ValueError:  # not reached for digits and commas; the whole parse decides
        return None
    if len(values) != count or int(values.max()) >= 2**32:
        return None
    return values.astype("<u4").tobytes()


def _numbers_in(span: bytes) -> int | None:
    """How many numbers a span of digits and commas holds, each a JSON integer >= 0; None
    for anything else: another byte, an empty number (``,,``, a comma at either end), a
    leading zero (``01``). Vectorised: bytes methods crawl where every sixth byte is a comma."""
    data = numpy.frombuffer(span, dtype=numpy.uint8)
    comma = data == ord(",")
    digit = (data - ord("0")) <= 9  # uint8: anything below "0" wraps around, above 9
    if not (digit | comma).all() or comma[0] or comma[-1] or (comma[1:] & comma[:-1]).any():
        return None
    starts = numpy.concatenate(([True], comma[:-1]))  # the first byte of each number
    if (starts[:-1] & (data[:-1] == ord("0")) & digit[1:]).any():
        return None
    return int(numpy.count_nonzero(comma)) + 1
