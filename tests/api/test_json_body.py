"""A request body is checked at C speed where it can be (no surrogate escape: its depth is
walked over its containers, and its bytes scanned for 19 digits, or its few elements walked
for a huge number); the result, or the 400 and its message, must be the full walk's on any
body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from api import jsonbytes
from api.edge import json_body
from api.edge.json_body import MAX_JSON_DEPTH, BodyError, parse_json_object


def full_walk(raw: bytes) -> dict[str, Any]:
    """The body as every value of it is walked (strings, numbers, depth)."""
    check_strings = json_body._SURROGATE_ESCAPE.search(raw) is not None
    body = json_body._parsed(raw, jsonbytes.loads)
    if json_body._check_shape(body, check_strings):
        body = json_body._parsed(raw, jsonbytes.loads_stdlib)
        json_body._check_shape(body, check_strings)
    return body


def outcome(parse: Any, raw: bytes) -> str:
    try:
        return "ok " + repr(parse(raw))  # repr: an exact integer and a float differ
    except BodyError as exc:
        return f"400 {exc}"


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), 2**64, 10**18]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["1234567890123456789", "id 12345678901234567890", "\ud800x", "ok"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=30,
)


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@settings(max_examples=300, deadline=None)
@given(VALUES, st.integers(min_value=0, max_value=MAX_JSON_DEPTH + 4))
@example({"max_tokens": 10**30}, 0)
@example(["x" * 5000, 10**30], 0)  # few elements in many bytes: walked, not scanned
@example(["x" * 5000, 2**63 - 1], 0)
@example(["x" * 5000, 1e300, "1234567890123456789"], 2)
@example({"n": "x"}, MAX_JSON_DEPTH - 1)
@example({"n": "x"}, MAX_JSON_DEPTH)
def test_a_body_reads_as_the_full_walk_reads_it(value: Any, depth: int) -> None:
    body = {"messages": [], "value": nested(depth, value)}
    raw = json.dumps(body, ensure_ascii=True).encode()
    assert outcome(parse_json_object, raw) == outcome(full_walk, raw)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_the_depth_limit_is_exact(depth: int) -> None:
    # The body's object is level 1, so its deepest container is at level depth + 1.
    raw = json.dumps({"v": nested(depth, 1)}).encode()
    if depth + 1 <= MAX_JSON_DEPTH:
        assert parse_json_object(raw)["v"] is not None
    else:
        with pytest.raises(BodyError, match="nested deeper"):
            parse_json_object(raw)
