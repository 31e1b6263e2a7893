"""Where each root's conversation began, and what relates it to the main chain (issue 26).

Synthetic rollouts whose entries carry the traits the front end records
(``api.call.traits``): the assistant turns each request carried, the digest of the last, and a
conversation start's opening lines. A rollout that lost its first calls is masked (its
entries' stamps say so), one seeded with turns nobody sampled is delivered; beside
the main chain, only roots the capture relates to it are delivered as segments; a second
harness run under the same id masks the rollout in segments mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from capture.build.builder import run_builder
from capture.build.roots import carries, sampled_pieces
from capture.records import TokenEntry
from capture.traits import line_digests, opening_digests
from tests.support.chains import acked, chain_entries, entry, fresh, full, loop, message, stamp


def answer(call: TokenEntry) -> list[dict[str, Any]]:
    return list(call.output_items)


@pytest.mark.parametrize("delivery", ["chain", "segments"])
def test_a_rollout_that_lost_its_first_calls_is_masked(delivery: str) -> None:
    """The later calls' stamps say two calls were stored before them: both are gone."""
    calls = loop(5)
    whole = run_builder(calls, final_answer=answer(calls[-1]), delivery=delivery)
    assert not whole.masked and len(whole.main_chain) == 5 and whole.seeded_roots == ()
    cut = run_builder(calls[2:], final_answer=answer(calls[-1]), delivery=delivery)
    assert cut.masked and cut.seeded_roots == (calls[2].model_call_id,)
    assert [r for r in cut.mask_reasons if r.startswith("calls missing:")] == [
        "calls missing: front-end process w-test had 2 of this rollout's calls stored before "
        "one it stored later, and 0 of them are in the capture (calls lost from the store "
        "while the harness ran: its rollout deleted or evicted, or a Redis back without its "
        "data)"
    ]


@pytest.mark.parametrize("delivery", ["chain", "segments"])
def test_a_conversation_seeded_with_turns_nobody_sampled_is_delivered(delivery: str) -> None:
    """Few-shot examples or a resumed session: the first request carries assistant turns
    no captured call sampled, and every call the front end stored is there."""
    calls = loop(5)[2:]
    for count, call in enumerate(calls):
        acked(call, count)
    built = run_builder(calls, final_answer=answer(calls[-1]), delivery=delivery)
    assert not built.masked, built.mask_reasons
    assert built.seeded_roots == (calls[0].model_call_id,)
    assert built.main_chain == tuple(c.model_call_id for c in calls)
    assert built.delivered_fraction == 1.0


def test_a_loss_in_one_process_masks_though_another_stored_the_rest() -> None:
    """Two front-end workers: the one that stored the first call stores the fourth too; the
    second worker's entries cannot stand for the first's."""
    calls = loop(4)
    for call, (worker, count) in zip(calls, [("a", 0), ("b", 0), ("b", 1), ("a", 1)], strict=True):
        acked(call, count, worker)
    assert not run_builder(calls, final_answer=answer(calls[-1])).masked
    cut = run_builder(calls[1:], final_answer=answer(calls[-1]))
    assert cut.masked and "front-end process a had 1" in " ".join(cut.mask_reasons)


def test_calls_stored_together_are_each_others_company_not_evidence() -> None:
    """Puts in flight at once carry the same count: each needs the ones before, not each
    other; one stored alone after two acknowledged ones is a loss."""
    calls = loop(4)
    for call, count in zip(calls, [0, 1, 1, 3], strict=True):
        acked(call, count)
    assert not run_builder(calls, final_answer=answer(calls[-1])).masked
    for call, count in zip(calls, [0, 2, 2, 2], strict=True):
        acked(call, count)
    assert run_builder(calls, final_answer=answer(calls[-1])).masked


def test_a_reply_sampled_after_the_root_does_not_stand_for_the_lost_one() -> None:
    """The lost call's reply sampled again by a later call is no evidence of the start."""
    calls = loop(4)
    calls[3].output_items[:] = calls[1].output_items  # the last call repeats turn 1's reply
    cut = run_builder(calls[2:], final_answer=answer(calls[3]))
    assert cut.masked and cut.seeded_roots == (calls[2].model_call_id,)


def test_a_loop_resumed_after_a_kept_round_is_delivered_whole() -> None:
    """Compaction that keeps the last round: the resumed root re-renders the conversation
    (no token prefix), but carries a reply a captured call sampled."""
    first = loop(3)
    summary = stamp(
        entry("summary", full(first[-1]) + fresh(3), fresh(4), text="The summary.", created_at=9),
        first[-1],
        turns=3,
        summary_request=True,
    )
    resumed = chain_entries(2, prefix="resumed", created_at=20.0)
    stamp(resumed[0], first[-1], turns=1, continuation=True)
    stamp(resumed[1], resumed[0], turns=2)
    calls = [*first, summary, *resumed]
    for delivery in ("chain", "segments"):
        built = run_builder(calls, final_answer=answer(resumed[-1]), delivery=delivery)
        assert not built.masked, built.mask_reasons
        assert built.main_chain == tuple(c.model_call_id for c in resumed)
        assert built.unexplained_roots == () and built.seeded_roots == ()
    assert built.delivered_fraction == 1.0


def _subagent(prompt: str, system: str = "s-sub") -> list[TokenEntry]:
    calls = chain_entries(2, prefix="sub", system=fresh(4), created_at=2.5)
    stamp(calls[0], opening=prompt, system=system, tools="t-sub", subagent=True)
    stamp(calls[1], calls[0], system=system, tools="t-sub", subagent=True)
    return calls


def _delegating_loop(prompt: str) -> list[TokenEntry]:
    calls = loop(3)
    agent_call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "Agent",
        "arguments": f'{{"description": "Run it", "prompt": "{prompt}"}}',
    }
    calls[1].output_items[:] = [message("I'll delegate it."), agent_call]
    stamp(calls[2], calls[1], turns=2)
    return calls


def test_a_subagent_is_delivered_when_a_delivered_call_gave_its_prompt() -> None:
    prompt = "SUBTASK-7: run echo hello and report what it printed."
    main = _delegating_loop(prompt)
    sub = _subagent("<system-reminder>Be brief.</system-reminder>\n" + prompt)
    built = run_builder([*main, *sub], final_answer=answer(main[-1]), delivery="segments")
    assert not built.masked and built.delivered_fraction == 1.0
    assert [s.role for s in built.segments] == ["subagent"]


def test_a_subagent_nothing_asked_for_is_not_delivered() -> None:
    main = _delegating_loop("SUBTASK-7: run echo hello and report what it printed.")
    stranger = _subagent("SUBTASK-9: delete every file in the home directory.")
    built = run_builder([*main, *stranger], final_answer=answer(main[-1]), delivery="segments")
    assert built.segments == () and built.unexplained_roots == (stranger[0].model_call_id,)
    assert not built.masked and built.delivered_fraction < 1.0  # min_delivered_fraction decides


@pytest.mark.parametrize("delivery", ["chain", "segments"])
def test_two_harness_runs_under_one_rollout_id(delivery: str) -> None:
    """Same system prompt and tools, its own first message, nothing leads to it."""
    ours = loop(3, opening="Task 7: list the files in /srv and count them.")
    theirs = loop(3, prefix="other", opening="Task 8: find the largest file in /var/log.")
    for call in theirs:
        call.created_at += 0.5
    built = run_builder([*ours, *theirs], final_answer=answer(ours[-1]), delivery=delivery)
    assert built.main_chain == tuple(c.model_call_id for c in ours)
    assert built.unexplained_roots == (theirs[0].model_call_id,)
    if delivery == "chain":  # the main chain is the first run's own calls
        assert not built.masked and built.delivered_fraction < 1.0
    else:
        assert built.masked and built.segments == ()
        assert any("two harness runs share this rollout id" in r for r in built.mask_reasons)


def test_the_same_task_run_twice_is_two_runs_too() -> None:
    """A restarted numbering dispatches the same task again: identical first prompts."""
    ours = loop(3)
    theirs = chain_entries(3, prefix="again", created_at=0.5)
    theirs[0].prompt_token_ids[:] = ours[0].prompt_token_ids
    for turn, call in enumerate(theirs):
        if turn:
            call.prompt_token_ids[:] = full(theirs[turn - 1]) + fresh(1)
        stamp(call, theirs[turn - 1] if turn else None, opening="Task: list the files")
    built = run_builder([*ours, *theirs], final_answer=answer(ours[-1]), delivery="segments")
    assert built.masked and any("two harness runs" in r for r in built.mask_reasons)


def summary_of(loop_calls: list[TokenEntry], text: str) -> TokenEntry:
    """The compaction call that extends ``loop_calls`` and samples ``text``."""
    last = loop_calls[-1]
    call = entry("summary", full(last) + fresh(2), fresh(3), text=text, created_at=5)
    return stamp(call, last, turns=len(loop_calls), summary_request=True)


def test_a_title_call_and_a_continuation_are_related_by_shape_and_by_text() -> None:
    title = stamp(
        entry("title", fresh(3), fresh(2), text='{"title": "Files"}', created_at=-1.0),
        opening="Task: list the files",
        tools="t-none",
        n_tools=0,
        structured_output=True,
    )
    first = loop(2)
    summary_text = "<summary>\nThe user asked for the files; two listings ran.\n</summary>"
    summary = summary_of(first, summary_text)
    resumed = chain_entries(2, prefix="resumed", created_at=10.0)
    opening = (
        "This session is being continued from a previous conversation.\n\nSummary:\n"
        "The user asked for the files;   two listings ran."
    )
    stamp(resumed[0], opening=opening, continuation=True)
    stamp(resumed[1], resumed[0])
    calls = [title, *first, summary, *resumed]
    built = run_builder(calls, final_answer=answer(resumed[-1]), delivery="segments")
    assert not built.masked and built.delivered_fraction == 1.0, built.mask_reasons
    assert sorted(s.role for s in built.segments) == ["compaction_summary", "title"]


def test_line_digests_ignore_markup_and_spacing_and_short_lines() -> None:
    assert line_digests("<summary>  The user asked for the files.</summary>") == line_digests(
        "Summary:\nThe user asked   for the files."
    )
    assert line_digests("Done.\ndir-3") == []
    piece = sampled_pieces(
        entry(
            "c",
            [1],
            [2],
            items=[
                {
                    "type": "function_call",
                    "name": "Agent",
                    "arguments": '{"prompt": "a long enough prompt"}',
                }
            ],
        )
    )
    assert piece == [line_digests("a long enough prompt")]
    assert carries(opening_digests("intro line that is long\na long enough prompt"), piece[0])


def test_a_lost_reply_sampled_again_by_a_sub_agent_does_not_stand_for_it() -> None:
    """Only a call of the same harness loop can be the one a root continues: a parallel
    sub-agent that happened to sample the same short tool call is no evidence."""
    calls = loop(5)
    ls = '{"command": "ls"}'
    calls[2].output_items[:] = [
        {"type": "function_call", "call_id": "a", "name": "Bash", "arguments": ls}
    ]
    stamp(calls[3], calls[2], turns=3)
    sub = _subagent("Look around the repository and report.")
    sub[0].output_items[:] = [
        {"type": "function_call", "call_id": "b", "name": "Bash", "arguments": ls}
    ]
    for delivery in ("chain", "segments"):
        cut = run_builder([*calls[3:], *sub], final_answer=answer(calls[-1]), delivery=delivery)
        assert cut.masked and cut.seeded_roots == (calls[3].model_call_id,)


def test_a_second_run_quoting_the_task_is_still_a_second_run() -> None:
    """The same task dispatched twice: a line of the task repeated in a sampled tool call is
    no relation between two conversations of the main harness."""
    task = "Fix the bug.\nThe failing test is tests/test_parser.py::test_empty\nReport back."
    ours = loop(3, opening=task)
    quoted = '{"command": "The failing test is tests/test_parser.py::test_empty"}'
    ours[1].output_items[:] = [
        {"type": "function_call", "call_id": "x", "name": "Bash", "arguments": quoted}
    ]
    stamp(ours[2], ours[1], turns=2)
    theirs = loop(3, prefix="again", opening=task, created_at=0.5)
    built = run_builder([*ours, *theirs], final_answer=answer(ours[-1]), delivery="segments")
    assert built.masked and built.segments == ()
    assert any("two harness runs" in reason for reason in built.mask_reasons)


def test_a_summary_kept_without_its_analysis_still_explains_the_loop_before_it() -> None:
    """The CLI keeps the ``<summary>`` of a compaction reply and drops its ``<analysis>``:
    each tagged section is matched on its own."""
    first = loop(2)
    analysis = "\n".join(
        f"Analysis point {i}: the user asked about item {i} at length." for i in range(6)
    )
    summary = "\n".join(f"Summary point {i}: listed the files of directory {i}." for i in range(4))
    reply = f"<analysis>\n{analysis}\n</analysis>\n<summary>\n{summary}\n</summary>"
    asked = summary_of(first, reply)
    resumed = chain_entries(2, prefix="resumed", created_at=10.0)
    opening = "This session is being continued from a previous conversation.\nSummary:\n" + summary
    stamp(resumed[0], opening=opening)  # no continuation trait: the text alone relates them
    stamp(resumed[1], resumed[0])
    built = run_builder(
        [*first, asked, *resumed], final_answer=answer(resumed[-1]), delivery="segments"
    )
    assert not built.masked and built.unexplained_roots == (), built.mask_reasons
    assert built.delivered_fraction == 1.0
