"""Log-probs and ``token_id:N`` tokens are read all at once when every one is usable, and
one by one otherwise, to name the first problem: both readings must agree on every input,
usable or not (a reply of thousands of tokens is read at C speed, never more leniently)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.engine import sglang
from api.engine.checks import NUMPY_FROM, logprob_problem, usable_logprobs
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


SIZES = [0, 1, 7, NUMPY_FROM - 1, NUMPY_FROM, 150]  # both sides of where numpy starts


def reply(data: Any, size: int) -> tuple[list[Any], list[Any]]:
    """Usable tokens and values of one size, with up to two odd entries put anywhere."""
    tokens = data.draw(st.lists(GOOD_TOKEN, min_size=size, max_size=size))
    values = data.draw(st.lists(GOOD_VALUE, min_size=size, max_size=size))
    for _ in range(data.draw(st.integers(min_value=0, max_value=2)) if size else 0):
        at = data.draw(st.integers(min_value=0, max_value=size - 1))
        if data.draw(st.booleans()):
            tokens[at] = data.draw(ODD_TOKEN)
        else:
            values[at] = data.draw(ODD_VALUE)
    return tokens, values


@pytest.mark.parametrize("size", SIZES)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_vllm_log_probs_read_at_once_as_one_by_one(size: int, data: Any) -> None:
    tokens, values = reply(data, size)
    assert _read_logprobs(tokens, values) == _read_one_by_one(tokens, values)


@pytest.mark.parametrize(
    ("tokens", "values"),
    [
        (["token_id:1,token_id:2"], [-0.5]),  # one token that reads as two
        (["token_id:1", "token_id:٣"], [-0.5, -1.0]),  # a digit, but not an ASCII one
        (["token_id:7"], [LOGPROB_PLACEHOLDER]),
        (["token_id:7"] * NUMPY_FROM, [-0.5] * (NUMPY_FROM - 1) + [LOGPROB_PLACEHOLDER]),
    ],
)
def test_vllm_log_probs_named_cases(tokens: list[Any], values: list[Any]) -> None:
    assert _read_logprobs(tokens, values) == _read_one_by_one(tokens, values)
    assert _read_logprobs(tokens, values)[2] is not None


@pytest.mark.parametrize("size", SIZES)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_usable_log_probs_are_exactly_those_without_a_problem(size: int, data: Any) -> None:
    _, values = reply(data, size)
    usable = usable_logprobs(values)
    if any(logprob_problem(value) is not None for value in values):
        assert usable is None
        assert sglang._values(values)[0] is None
    else:
        assert usable == [float(value) for value in values]
        assert all(type(value) is float and not math.isnan(value) for value in usable)
        assert sglang._values(values) == (usable, None)
