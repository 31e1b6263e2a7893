"""Log-probs and ``token_id:N`` tokens are read all at once when every one is usable, and
one by one otherwise, to name the first problem: both readings must agree on every input,
usable or not (a reply of thousands of tokens is read at C speed, never more leniently)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from api.engine import sglang
from api.engine.checks import logprob_problem, usable_logprobs
from api.engine.vllm import LOGPROB_PLACEHOLDER, _read_logprobs, _read_one_by_one

GOOD_VALUE = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
ODD_VALUE = st.one_of(
    st.floats(),  # NaN, infinities, positive values
    st.integers(min_value=-(10**400), max_value=10**400),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.just(LOGPROB_PLACEHOLDER),
    st.just(-0.0),
)
GOOD_TOKEN = st.integers(min_value=0, max_value=2**40).map(lambda n: f"token_id:{n}")
ODD_TOKEN = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["token_id:", "token_id:1,token_id:2", "token_id:٣", "token_id: 4", "5"]),
    st.integers(),
    st.none(),
)


@st.composite
def replies(draw: Any) -> tuple[list[Any], list[Any]]:
    """Token and value lists, each usable or with a few odd entries anywhere."""
    size = draw(st.integers(min_value=0, max_value=40))
    token = st.one_of(GOOD_TOKEN, ODD_TOKEN) if draw(st.booleans()) else GOOD_TOKEN
    value = st.one_of(GOOD_VALUE, ODD_VALUE) if draw(st.booleans()) else GOOD_VALUE
    tokens = draw(st.lists(token, min_size=size, max_size=size))
    values = draw(st.lists(value, min_size=size, max_size=size))
    return tokens, values


@settings(max_examples=400, deadline=None)
@given(replies())
@example((["token_id:1,token_id:2"], [-0.5]))  # one token that reads as two
@example((["token_id:1", "token_id:٣"], [-0.5, -1.0]))  # a digit, but not an ASCII one
@example((["token_id:7"], [LOGPROB_PLACEHOLDER]))
def test_vllm_log_probs_read_at_once_as_one_by_one(reply: tuple[list[Any], list[Any]]) -> None:
    tokens, values = reply
    assert _read_logprobs(tokens, values) == _read_one_by_one(tokens, values)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(GOOD_VALUE, ODD_VALUE), max_size=30))
def test_usable_log_probs_are_exactly_those_without_a_problem(values: list[Any]) -> None:
    usable = usable_logprobs(values)
    if any(logprob_problem(value) is not None for value in values):
        assert usable is None
        assert sglang._values(values)[0] is None
    else:
        assert usable == [float(value) for value in values]
        assert all(type(value) is float and not math.isnan(value) for value in usable)
        assert sglang._values(values) == (usable, None)
