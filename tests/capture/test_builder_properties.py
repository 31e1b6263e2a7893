"""Properties of the rebuild over generated rollouts (hypothesis).

Rollouts mix a main agent loop with what real harnesses add around it: retries, title
calls, forks, sub-agents sharing the system prompt, calls that generated nothing, and twin
calls (identical prompt and generation) that make their children ambiguous.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.build.builder import run_builder
from capture.delivery import finalize_rollout_token_capture
from capture.filestore.store import FileTokenStore
from capture.records import TokenEntry
from tests.support.chains import entry, full, message
from tests.support.contiguity import is_contiguous

EXTRAS = ("retry", "title", "branch", "empty", "twin", "subagent", "last-retry")


@st.composite
def rollouts(draw: Any, rollout_id: str = "prop") -> list[TokenEntry]:
    tokens = itertools.count(10_000)
    names = iter(draw(st.lists(st.integers(0, 999_999), min_size=30, max_size=30, unique=True)))

    def fresh(n: int) -> list[int]:
        return [next(tokens) for _ in range(n)]

    def make(kind: str, prompt: list[int], generation: list[int], text: str) -> TokenEntry:
        return entry(
            f"{next(names):06d}-{kind}",
            prompt,
            generation,
            text=text,
            items=None if generation else [],
            created_at=float(draw(st.integers(0, 4))),
            rollout_id=rollout_id,
        )

    turns = draw(st.integers(1, 7))
    context = fresh(draw(st.integers(1, 40)))  # sometimes longer than the builder's key
    main = []
    for turn in range(turns):
        generation = fresh(draw(st.integers(1, 3)))
        main.append(make("m", context, generation, f"turn {turn}"))
        context = context + generation + fresh(draw(st.integers(0, 2)))
    extras = []
    for kind in draw(st.lists(st.sampled_from(EXTRAS), max_size=4)):
        base = main[draw(st.integers(0, turns - 1))]
        if kind == "retry":
            extras.append(make("r", base.prompt_token_ids, fresh(2), "retry"))
        elif kind == "last-retry":
            extras.append(make("l", main[-1].prompt_token_ids, fresh(1), "again"))
        elif kind == "title":
            extras.append(make("t", fresh(3), fresh(1), "title"))
        elif kind == "branch":
            extras.append(make("b", full(base) + fresh(1), fresh(1), "branch"))
        elif kind == "empty":
            extras.append(make("e", full(base), [], ""))
        elif kind == "twin":
            twin = make("w", base.prompt_token_ids, base.generation_token_ids, "twin")
            # Other log-probs: another sample (an identical one would be the same call).
            twin.generation_log_probs = [v - 1.0 for v in twin.generation_log_probs]
            extras.append(twin)
        elif kind == "subagent":
            extras.append(make("s", main[0].prompt_token_ids + fresh(2), fresh(2), "sub"))
    return main + extras


def answers(entries: list[TokenEntry]) -> st.SearchStrategy[Any]:
    texts = sorted({e.output_items[0]["content"][0]["text"] for e in entries if e.output_items})
    return st.one_of(st.none(), st.sampled_from(texts).map(lambda text: [message(text)]))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_shuffled_arrival_order_gives_the_same_build(data: st.DataObject) -> None:
    entries = data.draw(rollouts())
    shuffled = data.draw(st.permutations(entries))
    answer = data.draw(answers(entries))
    build = run_builder(entries, final_answer=answer)
    assert run_builder(shuffled, final_answer=answer) == build
    # And every build is internally sound.
    assert is_contiguous(build.output)
    assert build.generated_tokens_delivered <= build.generated_tokens_captured
    assert sum(chain.main for chain in build.chains) == (1 if build.main_chain else 0)
    assert set(build.discarded_retries).isdisjoint(build.main_chain)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lost-call-captures")


_rollout_numbers = itertools.count()


async def _record_and_finalize(
    store_dir: Path, entries: list[TokenEntry], lost: str | None
) -> tuple[bool, dict[str, Any]]:
    store = FileTokenStore(store_dir)
    try:
        rollout_id = entries[0].rollout_id
        for call in entries:
            await store.begin_call(rollout_id, call.model_call_id)
        for call in entries:
            if call.model_call_id != lost:
                await store.put(call)
        record = {"_ng_rollout_id": rollout_id, "response": {"output": [message("turn 0")]}}
        built = await finalize_rollout_token_capture(record, store)
        assert record["mask_sample"] is built.masked
        return built.masked, record
    finally:
        await store.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_losing_any_one_entry_after_its_intent_never_delivers_unmasked(
    store_dir: Path, data: st.DataObject
) -> None:
    rollout_id = f"lost-{next(_rollout_numbers)}"
    entries = data.draw(rollouts(rollout_id=rollout_id))
    lost = data.draw(st.sampled_from(entries)).model_call_id
    masked, record = asyncio.run(_record_and_finalize(store_dir, entries, lost))
    assert masked
    assert record["_ng_token_capture"]["capture_incomplete"] is True


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_nothing_lost_masks_only_for_the_builders_own_reasons(
    store_dir: Path, data: st.DataObject
) -> None:
    rollout_id = f"whole-{next(_rollout_numbers)}"
    entries = data.draw(rollouts(rollout_id=rollout_id))
    masked, record = asyncio.run(_record_and_finalize(store_dir, entries, None))
    assert masked == run_builder(entries, final_answer=[message("turn 0")]).masked
    assert record["_ng_token_capture"]["capture_incomplete"] is False
