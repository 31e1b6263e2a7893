"""The front end's watch for two harness runs under one rollout id (issue 26).

Calls of one rollout in flight at once: the same harness with different histories is a
collision, counted and logged once per rollout; a resend of the same request, a title call
and a marked sub-agent beside the loop are not.
"""

from __future__ import annotations

import contextlib
import logging

from prometheus_client import CollectorRegistry, Counter

from api.call import collisions
from api.call.collisions import CollisionWatch
from capture.context import CallCapture

LOOP = {"system": "s", "tools": "t", "n_tools": 2, "first_user": "task-a"}


def call(**changes: object) -> dict:
    return {**LOOP, "turns_before": 0, "answered_before": None, **changes}


def watch() -> tuple[CollisionWatch, Counter]:
    total = Counter("collisions", "test", registry=CollectorRegistry())
    return CollisionWatch(total), total


def counted(total: Counter) -> float:
    return total._value.get()


def in_flight(watcher: CollisionWatch, rollout: str, *calls: dict) -> None:
    """Hold every call of ``calls`` in flight at once, then let them all end."""
    with contextlib.ExitStack() as stack:
        for traits in calls:
            stack.enter_context(watcher.watching(CallCapture(rollout, sink=None), traits))


def test_another_task_or_the_same_task_elsewhere_is_a_collision(caplog) -> None:
    watcher, total = watch()
    with caplog.at_level(logging.WARNING, logger="tokcap.frontend"):
        in_flight(watcher, "r-1", call(), call(first_user="task-b"))
        in_flight(watcher, "r-1", call(), call(first_user="task-b"))  # logged once
        in_flight(watcher, "r-2", call(turns_before=3, answered_before="x"), call(turns_before=3))
    assert counted(total) == 2
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2 and "r-1" in named[0] and "r-2" in named[1]


def test_a_resend_a_title_and_a_sub_agent_beside_the_loop_are_not() -> None:
    watcher, total = watch()
    title = call(structured_output=True, n_tools=0, tools="none", first_user="title")
    sub = call(system="sub", subagent=True, first_user="subtask")
    in_flight(watcher, "r-1", call(), call(), title, sub)
    in_flight(watcher, "r-1", call(), call(system="other-harness", first_user="task-b"))
    assert counted(total) == 0


def test_calls_one_after_another_never_collide_and_nothing_is_left_behind() -> None:
    watcher, total = watch()
    for turn in range(3):
        in_flight(watcher, "r-1", call(turns_before=turn, answered_before=str(turn)))
    in_flight(watcher, "r-1", call(first_user="continued from a summary"))
    assert counted(total) == 0 and watcher._in_flight == {}


def test_each_rollout_is_reported_once_within_what_is_remembered(monkeypatch) -> None:
    monkeypatch.setattr(collisions, "REMEMBERED", 2)
    watcher, total = watch()
    for rollout in ("a", "b", "a", "c", "a"):  # "a" stays remembered: it was seen again
        in_flight(watcher, rollout, call(), call(first_user="other"))
    assert counted(total) == 3
    for rollout in ("b", "d"):  # "b" was forgotten for "c": reported again
        in_flight(watcher, rollout, call(), call(first_user="other"))
    assert counted(total) == 5


def test_untagged_calls_are_not_watched() -> None:
    watcher, total = watch()
    with watcher.watching(None, call()), watcher.watching(None, call(first_user="b")):
        assert watcher._in_flight == {}
    assert counted(total) == 0
