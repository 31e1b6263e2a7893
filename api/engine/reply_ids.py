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

A rollout's next prompt starts with the ids of its last one, so ``SpanMemo`` keeps each
rollout's last list (bytes and packed): the ids of the bytes the two lists share, up to a
comma, are taken packed, and only the rest is parsed. Equal bytes are equal ids, whatever
rollout or engine sent them, so the memo can only save work, never change a result.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy

from api import jsonbytes
from capture.codec.packed import ID_WIDTH, PackedIds

# Below about 3,000 ids (a list of some 18 KB) numpy's fixed costs exceed what it saves.
FAST_FROM_BYTES = 16_384


# What a worker keeps of its rollouts' last prompt lists (bytes and packed), at most: about
# 400 lists of 16,000 ids, or 64 of 100,000 (a list shorter than FAST_FROM_BYTES is not kept).
MEMO_BYTES = 64 * 2**20


class SpanMemo:
    """Each rollout's last prompt list, as its bytes and packed, least recently used first
    out once they hold more than ``budget`` bytes."""

    def __init__(self, budget: int = MEMO_BYTES) -> None:
        self.budget = budget
        self.held = 0
        self._spans: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()

    def get(self, rollout: str) -> tuple[bytes, bytes] | None:
        return self._spans.get(rollout)

    def keep(self, rollout: str, span: bytes, packed: bytes) -> None:
        old = self._spans.pop(rollout, None)
        if old is not None:
            self.held -= len(old[0]) + len(old[1])
        self._spans[rollout] = (span, packed)
        self.held += len(span) + len(packed)
        while self.held > self.budget and self._spans:
            _, (dropped, dropped_packed) = self._spans.popitem(last=False)
            self.held -= len(dropped) + len(dropped_packed)


def loads_with_ids(
    raw: bytes, key: str, memo: SpanMemo | None = None, rollout: str | None = None
) -> Any:
    """The reply as ``jsonbytes.loads`` parses it, its top-level ``key`` a ``PackedIds`` when
    the fast read applies (see the module docstring); ``ValueError`` for invalid JSON.
    ``memo`` and ``rollout``: the rollout's last list, whose shared ids are not parsed again."""
    if len(raw) < FAST_FROM_BYTES:
        return jsonbytes.loads(raw)
    marker = b'"' + key.encode() + b'":['
    at = raw.find(marker)
    if at < 0 or raw.find(marker, at + 1) >= 0:
        return jsonbytes.loads(raw)
    start = at + len(marker)
    end = raw.find(b"]", start)
    if end - start < FAST_FROM_BYTES:
        return jsonbytes.loads(raw)
    span = raw[start:end]
    known = memo.get(rollout) if memo is not None and rollout is not None else None
    packed = _packed_after(span, known) if known is not None else _packed_digits(span)
    if packed is None:
        return jsonbytes.loads(raw)
    reply = jsonbytes.loads(raw[:start] + raw[end:])
    if not isinstance(reply, dict) or reply.get(key) != []:
        return jsonbytes.loads(raw)
    if memo is not None and rollout is not None:
        memo.keep(rollout, span, packed)
    reply[key] = PackedIds(packed)
    return reply


def _packed_after(span: bytes, known: tuple[bytes, bytes]) -> bytes | None:
    """``span`` packed: the ids of the bytes it shares with a list read before (``known``:
    its bytes, packed), up to their last shared comma, taken as they were; the rest parsed."""
    old_span, old_packed = known
    shared = _shared_ids(span, old_span, len(old_packed) // ID_WIDTH)
    if shared is None:
        return _packed_digits(span)
    at, count = shared
    rest = _packed_digits(span[at:]) if at < len(span) else b""
    return None if rest is None else old_packed[: count * ID_WIDTH] + rest


def _shared_ids(span: bytes, old: bytes, old_count: int) -> tuple[int, int] | None:
    """(where the new ids start in ``span``, how many ids before it are ``old``'s): the
    whole numbers both lists begin with; None when they share none."""
    if span.startswith(old):
        if len(span) == len(old):
            return len(span), old_count
        if span[len(old)] == ord(","):
            return len(old) + 1, old_count
        common = len(old)  # the last old number goes on in ``span``: it is not shared
    else:
        length = min(len(span), len(old))
        new_bytes = numpy.frombuffer(span, dtype=numpy.uint8, count=length)
        old_bytes = numpy.frombuffer(old, dtype=numpy.uint8, count=length)
        differ = numpy.flatnonzero(new_bytes != old_bytes)
        common = int(differ[0]) if len(differ) else length
    comma = span.rfind(b",", 0, common)  # both lists hold this comma and all before it
    if comma < 0:
        return None
    before = numpy.frombuffer(span, dtype=numpy.uint8, count=comma)
    return comma + 1, int(numpy.count_nonzero(before == ord(","))) + 1


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
