"""The real Claude Code CLI with ``delivery: segments``: every sampled token, once, labelled.

A CLI run is several chains: the agent loop, the title call, a sub-agent's loop, the loop
that a compaction summarized and the one that resumes from the summary. The worker of this
module runs with ``--delivery segments`` (``worker_delivery`` below overrides the
conftest's), on this module's own Redis, so it is the only consumer of the jobs. The engine
speaks Qwen3 and the front end builds faithful prompts, so each loop stays one chain.

Every test checks the same property: the record is unmasked, ``delivered_fraction`` is 1,
the main output and every segment are one contiguous sequence each, and the delivered
calls (prompt ids, generated ids, log-probs) are exactly the engine's ground truth, each
sampled sequence once; then the roles the scenario implies.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from capture import training_samples
from capture.build.projection import carriers
from capture.samples import sample_of
from tests.e2e.test_claude_code_e2e import (
    FINAL_TEXT,
    SCRIPT,
    TITLE_TEXT,
    run_rollout,
    sampled,
    token_items,
)
from tokcap_devtools.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(300)

QWEN3 = ("--tokenizer", "qwen3")
FAITHFUL_ENV = {"TOKCAP_PROMPTS": "faithful", "TOKCAP_RENDERER_TOKENIZER": "qwen3"}
TITLE_ENTRY = SCRIPT["entries"][0]  # must stay first: the title call has no turn of its own

# The main loop hands the task to a sub-agent through the CLI's ``Agent`` tool. The
# sub-agent's requests carry their own system prompt and tools; its first user message is
# the prompt below, so SUBTASK-7 picks its turns out, and its Bash output carries
# SUBTASK-7-ran, which picks out its second turn (listed first: it matches SUBTASK-7 too).
SUBAGENT_ANSWER = "The sub-agent ran it: hello"
SUBAGENT_SCRIPT = {
    "entries": [
        TITLE_ENTRY,
        {"match": "SUBTASK-7-ran", "text": SUBAGENT_ANSWER},
        {
            "match": "SUBTASK-7",
            "turn": 0,
            "think": "A shell command; Bash runs it.",
            "tool_calls": [
                {
                    "name": "Bash",
                    "arguments": {
                        "command": "echo hello SUBTASK-7-ran",
                        "description": "Print hello",
                    },
                }
            ],
        },
        {
            "turn": 0,
            "think": "A sub-agent can do this.",
            "text": "I'll delegate it.",
            "tool_calls": [
                {
                    "name": "Agent",
                    "arguments": {
                        "description": "Run echo hello",
                        "prompt": "SUBTASK-7: run echo hello and report what it printed.",
                        "subagent_type": "general-purpose",
                    },
                }
            ],
        },
        {"turn": 1, "think": "The sub-agent reported hello.", "text": FINAL_TEXT},
    ],
    "default": {"text": "Done."},
}

# Auto-compaction at half of a 100k window: two Bash calls of ~24k tokens each (Qwen3
# spells every digit as a token; under the CLI's 30k-character limit, so the output is
# inlined, not saved to a file) take the context past it. The CLI then asks for a summary
# of everything but the last tool round (a user message after the first Bash output) and
# resumes from it, that round kept verbatim after the summary message: the resumed
# request's last message is the second Bash output, whose SEQ-2-DONE calls for the answer.
COMPACT_ENV = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "50"}
SUMMARY_TEXT = "<summary>The user asked to run echo hello; two listings of 1..5000 ran.</summary>"
COMPACT_SCRIPT = {
    "entries": [
        TITLE_ENTRY,
        {"match": r"(?i)create a detailed summary of the conversation", "text": SUMMARY_TEXT},
        {"match": "SEQ-2-DONE", "think": "Both commands ran.", "text": FINAL_TEXT},
        *(
            {
                "turn": turn,
                "think": f"Listing {turn + 1}; Bash runs it.",
                "text": f"Listing {turn + 1}.",
                "tool_calls": [
                    {
                        "name": "Bash",
                        "arguments": {"command": command, "description": f"Listing {turn + 1}"},
                    }
                ],
            }
            for turn, command in enumerate(
                ["echo hello; seq 1 5000", "seq 1 5000; echo SEQ-2-DONE"]
            )
        ),
    ],
    "default": {"text": "Done."},
}
CONTINUATION = "This session is being continued from a previous conversation"


@pytest.fixture(scope="module")
def worker_delivery() -> str:
    return "segments"


def segments(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result.get("_ng_token_segments") or []


def call_key(item: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A delivered item's (prompt ids, generated ids)."""
    return tuple(item["prompt_token_ids"]), tuple(item["generation_token_ids"])


def truth_key(call: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The same for one of the engine's ground truth records."""
    return tuple(call["prompt_token_ids"]), tuple(call["token_ids"])


def assert_every_sampled_token_once(
    summary: dict[str, Any], result: dict[str, Any]
) -> list[dict[str, Any]]:
    """The property every scenario must hold; the ground truth records, for the roles."""
    metrics = result["_ng_token_capture"]
    assert result.get("mask_sample") is False, metrics
    assert metrics["error"] is None and metrics["capture_incomplete"] is False, metrics
    assert metrics["delivered_fraction"] == 1.0, metrics
    assert metrics["main_chain_by"] == "final_answer", metrics

    # One contiguous sequence each: sample_of raises ValueError otherwise.
    main = sample_of(result["response"]["output"], "main")
    parts = [sample_of(segment["output"], segment["role"]) for segment in segments(result)]
    for segment, part in zip(segments(result), parts, strict=True):
        assert part.n_calls == len(segment["calls"]) == segment["metrics"]["n_calls"] > 0
    assert metrics["segments"] == dict(Counter(s["role"] for s in segments(result)))

    # Every sampled sequence delivered once, with its own prompt and log-probs.
    delivered = token_items(result) + [
        item for segment in segments(result) for item in carriers(segment["output"])
    ]
    truth = sampled(summary)
    assert Counter(map(call_key, delivered)) == Counter(map(truth_key, truth))
    log_probs = {truth_key(call): call["logprobs"] for call in truth}
    for item in delivered:
        assert item["generation_log_probs"] == log_probs[call_key(item)]

    # What a trainer gets: the same tokens, the main chain first.
    samples = training_samples(result)
    assert [s.role for s in samples] == ["main", *(s["role"] for s in segments(result))]
    assert [s.input_ids for s in samples] == [main.input_ids, *(p.input_ids for p in parts)]
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(c["token_ids"]) for c in truth)
    assert metrics["generated_tokens_delivered"] == metrics["generated_tokens_captured"]
    return truth


def sampled_texts(items: list[Any], truth: list[dict[str, Any]]) -> list[str]:
    """What each delivered call sampled, as text, from the ground truth."""
    text_of = {truth_key(call): call["text"] for call in truth}
    return [text_of[call_key(item)] for item in carriers(items)]


def test_title_call_is_a_title_segment(
    claude_cli: Path, netns: None, redis_socket: str, worker: subprocess.Popen, tmp_path: Path
) -> None:
    summary, _record, result = run_rollout(
        claude_cli,
        redis_socket,
        tmp_path,
        nonessential_traffic=True,
        engine_args=QWEN3,
        frontend_env=FAITHFUL_ENV,
    )
    truth = assert_every_sampled_token_once(summary, result)
    assert len(truth) == 3, "the title call, the Bash call, the answer"
    assert [s["role"] for s in segments(result)] == ["title"]
    (title,) = segments(result)
    assert sampled_texts(title["output"], truth) == [TITLE_TEXT]
    main = sampled_texts(result["response"]["output"], truth)
    assert len(main) == 2 and '"Bash"' in main[0] and main[1].endswith(FINAL_TEXT)


def test_subagent_is_a_subagent_segment(
    claude_cli: Path, netns: None, redis_socket: str, worker: subprocess.Popen, tmp_path: Path
) -> None:
    summary, _record, result = run_rollout(
        claude_cli,
        redis_socket,
        tmp_path,
        nonessential_traffic=False,
        script=SUBAGENT_SCRIPT,
        engine_args=QWEN3,
        frontend_env=FAITHFUL_ENV,
    )
    truth = assert_every_sampled_token_once(summary, result)
    assert len(truth) == 4, "the Agent call, the sub-agent's Bash call and answer, the answer"
    assert [s["role"] for s in segments(result)] == ["subagent"]
    # The main loop is the Agent call and the answer; the sub-agent's two calls are one chain.
    main = sampled_texts(result["response"]["output"], truth)
    assert len(main) == 2 and '"Agent"' in main[0] and main[1].endswith(FINAL_TEXT)
    (subagent,) = segments(result)
    sub = sampled_texts(subagent["output"], truth)
    assert len(sub) == 2 and '"Bash"' in sub[0] and sub[1] == SUBAGENT_ANSWER


@pytest.fixture(scope="module")
def compacted_run(
    claude_cli: Path,
    netns: None,
    redis_socket: str,
    worker: subprocess.Popen,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One auto-compacted rollout, (driver summary, rebuilt record), for the tests below."""
    summary, _record, result = run_rollout(
        claude_cli,
        redis_socket,
        tmp_path_factory.mktemp("compaction"),
        nonessential_traffic=False,
        script=COMPACT_SCRIPT,
        engine_args=QWEN3,
        frontend_env=FAITHFUL_ENV,
        env_extra=COMPACT_ENV,
    )
    return summary, result


def test_auto_compaction_delivers_the_summary_and_the_loop_around_it(
    compacted_run: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """Three chains: the first listing then the summary call (the summary covers everything
    but the last tool round), the first listing then the second (the round the CLI keeps
    verbatim after the summary), and the loop resumed from the summary, which answers.

    The first listing is shared by two segments and delivered once, in the chain whose
    leaf came first: the second listing's, which the CLI sampled before the summary.
    """
    summary, result = compacted_run
    events = summary["claude"]["events"]
    boundaries = [e for e in events if e.get("subtype") == "compact_boundary"]
    assert len(boundaries) == 1, "the CLI compacts once, on its own"
    assert boundaries[0]["compact_metadata"]["trigger"] == "auto"
    truth = assert_every_sampled_token_once(summary, result)
    assert len(truth) == 4, "two Bash calls, the summary, the resumed loop's answer"
    first, second, summary_call, answer = truth
    assert summary_call["text"] == SUMMARY_TEXT
    # The summary request continues the first listing's call, not the second's.
    ran_first = first["prompt_token_ids"] + first["token_ids"]
    assert summary_call["prompt_token_ids"][: len(ran_first)] == ran_first
    ran_second = second["prompt_token_ids"] + second["token_ids"]
    assert summary_call["prompt_token_ids"][: len(ran_second)] != ran_second

    # Each segment ends with its own leaf: the summary call, or the second listing.
    last_texts = {
        segment["role"]: sampled_texts(segment["output"], truth)[-1] for segment in segments(result)
    }
    assert len(last_texts) == 2 and last_texts.pop("compaction_summary") == SUMMARY_TEXT
    assert list(last_texts.values()) == [second["text"]]
    by_role = {s["role"]: sampled_texts(s["output"], truth) for s in segments(result)}
    assert by_role == {
        "other": [first["text"], second["text"]],
        "compaction_summary": [SUMMARY_TEXT],
    }
    # The main chain is the loop resumed from the summary: it gave the final answer.
    assert sampled_texts(result["response"]["output"], truth) == [answer["text"]]
    assert answer["text"].endswith(FINAL_TEXT)
    (resumed,) = token_items(result)
    assert CONTINUATION in load_tokenizer("qwen3").decode(resumed["prompt_token_ids"])


def test_the_round_kept_after_the_summary_is_not_a_subagent(
    compacted_run: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The second listing is the main agent's own call, with the main system prompt and
    tools: not a summary, not a continuation, not a sub-agent, so by the builder's rules
    it is ``other``."""
    summary, result = compacted_run
    second = sampled(summary)[1]
    (kept,) = [
        segment
        for segment in segments(result)
        if sampled_texts(segment["output"], sampled(summary))[-1] == second["text"]
    ]
    assert kept["role"] == "other"
