"""The tier's value check: what tokcap captured holds the engine's own log-probs, each at
its position, and those values could show a capture that moved one.

Equal lists prove nothing when every log-prob is the same: a scripted token lifted far above
the rest has log-prob 0.0 at every position, so a swapped or shifted capture would still
equal the engine's reply. The tier samples its scripted turns greedily, with the scripted
token just above the largest logit, so each log-prob is the model's own value there (about
-10 for the tiny model, varying by position). The check asserts that they are: none near 0,
nearly all different from one another; then that each entry holds its reply's log-probs
position by position, naming the first position that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capture.records import TokenCaptureSnapshot, TokenEntry
from tests.support.frontend import assert_entries_equal_ground_truth

NEAR_ZERO = 1e-3  # a log-prob this close to 0 is what a token lifted far above the rest has
# The share of one reply's log-probs that must differ from one another. Greedy positions of a
# random model can tie exactly (a bf16 logit is coarse), but rarely.
DISTINCT = 0.8


def assert_log_probs_vary(log_probs: Sequence[float], what: str) -> None:
    """One reply's log-probs are values a swap or a one-position shift would change."""
    assert log_probs, f"{what}: no log-probs"
    assert max(log_probs) < -NEAR_ZERO, f"{what}: a log-prob is ~0 ({max(log_probs)})"
    distinct = len(set(log_probs))
    assert distinct >= DISTINCT * len(log_probs), (
        f"{what}: only {distinct} different log-probs in {len(log_probs)}"
    )


def first_difference(captured: Sequence[float], sent: Sequence[float]) -> int | None:
    """The first position where two lists of log-probs differ (their length, if one is a
    prefix of the other); None when equal."""
    for position, (mine, theirs) in enumerate(zip(captured, sent, strict=False)):
        if mine != theirs:
            return position
    return None if len(captured) == len(sent) else min(len(captured), len(sent))


def reply_of(entry: TokenEntry, sampled: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's reply with the entry's prompt and generated ids (the first, if several:
    ``assert_entries_equal_ground_truth`` then refuses the capture)."""
    replies = [
        reply
        for reply in sampled
        if reply["prompt_token_ids"] == entry.prompt_token_ids
        and reply["token_ids"] == entry.generation_token_ids
    ]
    assert replies, f"entry {entry.model_call_id} is none of the engine's replies"
    return replies[0]


def assert_same_log_probs(captured: Sequence[float], sent: Sequence[float], what: str) -> None:
    """Captured log-probs are the engine's, position by position."""
    position = first_difference(captured, sent)
    if position is not None:
        mine = captured[position] if position < len(captured) else "none"
        theirs = sent[position] if position < len(sent) else "none"
        raise AssertionError(f"{what}: log-prob {position} is {mine}, the engine sent {theirs}")


def assert_captured_as_sampled(
    snapshot: TokenCaptureSnapshot, sampled: list[dict[str, Any]]
) -> None:
    """Every entry is exactly one of the engine's replies, ids and log-probs position by
    position, none is missing, and its log-probs are real values of the model's."""
    for entry in snapshot.entries:
        what = f"entry {entry.model_call_id}"
        captured = list(entry.generation_log_probs)
        assert_same_log_probs(captured, reply_of(entry, sampled)["logprobs"], what)
        assert_log_probs_vary(captured, what)
    assert_entries_equal_ground_truth(snapshot, sampled)
