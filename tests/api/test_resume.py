"""``api.call.resume`` on its own: a cut generation is continued or refused, never served."""

from __future__ import annotations

import pytest

from api.call.resume import Cut, continued
from api.engine.generation import Generation, reply_generation, with_changes


def _part(ids: list[int], finish: str, prompt: list[int]) -> Generation:
    return reply_generation(
        {"usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}},
        {"role": "assistant", "content": "x" * len(ids)},
        finish_reason=finish,
        stop_reason=None,
        prompt_ids=prompt,
        ids=ids,
        log_probs=[-0.5] * len(ids),
    )


async def _never(ids: list[int], sampling: object) -> Generation:
    raise AssertionError("not continued")


async def _version() -> str:
    return "2"


async def test_a_cut_part_whose_ids_cannot_be_captured_is_refused_not_served() -> None:
    cut = with_changes(_part([5, 6], "abort", [1, 2]), ids_problem="log-probs missing")
    with pytest.raises(Cut):
        await continued(cut, [1, 2], {"max_tokens": 10}, _never, _version)


async def test_a_cut_call_is_continued_from_its_prompt_and_sampled_ids() -> None:
    sent: list[tuple[list[int], dict]] = []

    async def complete(ids: list[int], sampling: dict) -> Generation:
        sent.append((ids, sampling))
        return _part([7, 8, 9], "stop", ids)

    first = with_changes(_part([5, 6], "abort", [1, 2]), policy_version="1")
    whole = await continued(first, [1, 2], {"max_tokens": 10}, complete, _version)
    assert sent == [([1, 2, 5, 6], {"max_tokens": 8})]
    assert whole.generation_token_ids == [5, 6, 7, 8, 9] and whole.finish_reason == "stop"
    assert whole.version_spans == ((0, 2, "1"), (2, 5, "2")) and whole.resumes == 1
    assert whole.ids_problem is None and whole.prompt_token_ids == [1, 2]
