"""Rollout ids from run bodies, the pattern, and the capture URL scheme."""

from __future__ import annotations

import pytest

from capture.errors import InvalidRolloutIdError
from capture.rollout_ids import (
    ROLLOUT_ID_MAX_LEN,
    capture_base_url,
    rollout_id_from_run_body,
    split_capture_path,
    validate_rollout_id,
)


def test_explicit_id_wins_over_indices():
    body = {"_ng_rollout_id": "run7.task-3_b", "_ng_task_index": 3, "_ng_rollout_index": 1}
    assert rollout_id_from_run_body(body) == "run7.task-3_b"


def test_id_from_indices():
    assert rollout_id_from_run_body({"_ng_task_index": 3, "_ng_rollout_index": 1}) == "3-1"
    assert rollout_id_from_run_body({"_ng_task_index": 0, "_ng_rollout_index": 0}) == "0-0"


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(None, "4-2"), (0, "4-2"), (1, "4-2-a1"), (12, "4-2-a12")],
)
def test_attempt_suffix_only_after_the_first(attempt, expected):
    body = {"_ng_task_index": 4, "_ng_rollout_index": 2}
    if attempt is not None:
        body["_ng_attempt_index"] = attempt
    assert rollout_id_from_run_body(body) == expected


def test_attempt_under_its_short_name():
    body = {"_ng_task_index": 4, "_ng_rollout_index": 2, "_ng_attempt": 3}
    assert rollout_id_from_run_body(body) == "4-2-a3"


def test_explicit_id_ignores_attempt():
    body = {"_ng_rollout_id": "given", "_ng_attempt_index": 2}
    assert rollout_id_from_run_body(body) == "given"


@pytest.mark.parametrize(
    "body",
    [{}, {"_ng_task_index": 1}, {"_ng_rollout_index": 1}, {"input": "hello"}],
)
def test_body_naming_no_rollout(body):
    assert rollout_id_from_run_body(body) is None


@pytest.mark.parametrize(
    "body",
    [
        {"_ng_task_index": -1, "_ng_rollout_index": 0},
        {"_ng_task_index": "3", "_ng_rollout_index": 0},
        {"_ng_task_index": True, "_ng_rollout_index": 0},
        {"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": -2},
        {"_ng_task_index": 1.0, "_ng_rollout_index": 0},
    ],
)
def test_bad_indices_rejected(body):
    with pytest.raises(InvalidRolloutIdError, match="non-negative integer"):
        rollout_id_from_run_body(body)


@pytest.mark.parametrize("rollout_id", ["a", "0", "A.b_c-1", "3-1-a2", "x" * ROLLOUT_ID_MAX_LEN])
def test_valid_ids_returned_unchanged(rollout_id):
    assert validate_rollout_id(rollout_id) is rollout_id


@pytest.mark.parametrize(
    "rollout_id",
    [
        "",
        "-x",
        ".hidden",
        "_x",
        "a/b",
        "../etc",
        "..",
        "a b",
        "a\n",
        "a\tb",
        "é",
        "a:b",
        "a%2Fb",
        "x" * (ROLLOUT_ID_MAX_LEN + 1),
    ],
)
def test_invalid_ids_rejected(rollout_id):
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(rollout_id)


def test_invalid_id_message_states_the_rule():
    with pytest.raises(InvalidRolloutIdError) as raised:
        validate_rollout_id("a/b")
    assert "^[A-Za-z0-9][A-Za-z0-9._-]*$" in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("value", [3, None, b"abc"])
def test_non_string_rejected(value):
    with pytest.raises(InvalidRolloutIdError, match="must be a string"):
        validate_rollout_id(value)


@pytest.mark.parametrize("explicit", ["bad id", "a/../b", "", 17])
def test_invalid_explicit_id_is_rejected_not_rewritten(explicit):
    with pytest.raises(InvalidRolloutIdError):
        rollout_id_from_run_body(
            {"_ng_rollout_id": explicit, "_ng_task_index": 1, "_ng_rollout_index": 0}
        )


def test_capture_base_url():
    assert (
        capture_base_url("http://127.0.0.1:8000", "3-1")
        == "http://127.0.0.1:8000/ng-rollout/3-1/training-token-capture"
    )
    assert (
        capture_base_url("http://127.0.0.1:8000/", "3-1", training=True)
        == "http://127.0.0.1:8000/ng-rollout/3-1/training-token-capture"
    )
    assert capture_base_url("http://h:1/", "3-1", training=False) == "http://h:1/ng-rollout/3-1"


def test_capture_base_url_rejects_invalid_id():
    with pytest.raises(InvalidRolloutIdError):
        capture_base_url("http://h:1", "../../etc")


def test_base_url_round_trips_through_split():
    url = capture_base_url("http://h:1", "7-0-a1")
    path = url.removeprefix("http://h:1") + "/v1/messages"
    assert split_capture_path(path) == ("7-0-a1", True, "/v1/messages")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/ng-rollout/r1/training-token-capture/v1/messages", ("r1", True, "/v1/messages")),
        (
            "/ng-rollout/r1/training-token-capture/v1/chat/completions?x=1",
            ("r1", True, "/v1/chat/completions?x=1"),
        ),
        ("/ng-rollout/r1/training-token-capture", ("r1", True, "/")),
        ("/ng-rollout/r1/training-token-capture/", ("r1", True, "/")),
        ("/ng-rollout/r1/v1/responses", ("r1", False, "/v1/responses")),
        ("/ng-rollout/r1", ("r1", False, "/")),
        ("/ng-rollout/r1/training-token-captured/v1", ("r1", False, "/training-token-captured/v1")),
        ("/v1/responses", (None, False, "/v1/responses")),
        ("/", (None, False, "/")),
        ("/ng-rollout", (None, False, "/ng-rollout")),
        (
            "/v1/ng-rollout/r1/training-token-capture",
            (None, False, "/v1/ng-rollout/r1/training-token-capture"),
        ),
        (
            "ng-rollout/r1/training-token-capture",
            (None, False, "ng-rollout/r1/training-token-capture"),
        ),
    ],
)
def test_split_capture_path(path, expected):
    assert split_capture_path(path) == expected


def test_split_returns_invalid_ids_as_sent_for_the_caller_to_reject():
    rollout_id, captured, rest = split_capture_path(
        "/ng-rollout/bad%20id/training-token-capture/v1/x"
    )
    assert (rollout_id, captured, rest) == ("bad%20id", True, "/v1/x")
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(rollout_id)
    empty, _, _ = split_capture_path("/ng-rollout//training-token-capture/v1/x")
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(empty)
