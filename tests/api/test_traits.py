"""Request traits: what the builder labels segments by, read off real request shapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from api.call import traits as traits_module
from api.call.traits import request_traits
from api.dialects import anthropic
from capture.filestore.store import FileTokenStore
from capture.traits import reply_digest
from tests.support import dialect_loops
from tests.support.frontend import both_servers, run

TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def traits(body: dict) -> dict:
    return request_traits(body, anthropic.to_chat(body))


def test_a_title_call_a_summary_request_and_a_resumed_session_are_told_apart() -> None:
    loop = {"model": "m", "max_tokens": 9, "system": "You are Claude Code.", "tools": TOOLS}
    first = traits({**loop, "messages": [{"role": "user", "content": "run ls"}]})
    assert first["n_tools"] == 1 and not first["structured_output"]
    assert not first["summary_request"] and not first["continuation"]
    title = traits(
        {
            "model": "m",
            "max_tokens": 9,
            "tools": [],
            "output_config": {"format": {"type": "json_schema", "schema": {}}},
            "messages": [{"role": "user", "content": "<session>run ls</session> Write the title"}],
        }
    )
    assert title["structured_output"] and title["n_tools"] == 0
    ask = "x " * 3000 + "Your task is to create a detailed summary of the conversation so far."
    summary = traits(
        {
            **loop,
            "messages": [
                {"role": "user", "content": "run ls"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": ask},
            ],
        }
    )
    assert summary["summary_request"] and summary["system"] == first["system"]
    resumed = traits(
        {
            **loop,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "<system-reminder>" + "y " * 3000 + "</system-reminder>",
                        },
                        {
                            "type": "text",
                            "text": "This session is being continued from a previous conversation that ran out of context.",
                        },
                    ],
                }
            ],
        }
    )
    assert resumed["continuation"] and not resumed["summary_request"]
    sub = traits(
        {
            **loop,
            "system": "You are a sub-agent.",
            "messages": [{"role": "user", "content": "SUBTASK"}],
        }
    )
    assert sub["system"] != first["system"] and sub["tools"] == first["tools"]


def test_kept_facts_give_each_text_its_own_traits_within_their_bound(monkeypatch) -> None:
    """A rollout's system prompt and opening are read once; a text that differs by one
    character, or a text seen often, never takes another's traits, and what is kept stays
    bounded."""
    opening = "\n".join(f"line {n} of the task, long enough to count" for n in range(300))
    body = {"model": "m", "max_tokens": 9, "system": "You are Claude Code.", "tools": TOOLS}
    ask = "Please write a detailed summary of"
    fresh = traits({**body, "messages": [{"role": "user", "content": opening + ask}]})
    again = traits({**body, "messages": [{"role": "user", "content": opening + ask}]})
    assert again == fresh and fresh["summary_request"] and len(fresh["opening"]) == 256
    changed = traits({**body, "messages": [{"role": "user", "content": "L" + opening[1:] + ask}]})
    assert changed["first_user"] != fresh["first_user"]
    assert changed["opening"][1:] == fresh["opening"][1:]
    assert changed["opening"][0] != fresh["opening"][0]
    later = traits(
        {
            **body,
            "messages": [
                {"role": "user", "content": opening + ask},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "done"},
            ],
        }
    )
    assert later["first_user"] == fresh["first_user"] and not later["summary_request"]
    texts = [f"{n:04d} {opening}" for n in range(200)]
    budget = 50 * len(texts[0]) + len(body["system"])  # and the system prompt of each call
    monkeypatch.setattr(traits_module, "FACTS_CHARS", budget)
    for text in texts:
        traits({**body, "messages": [{"role": "user", "content": text}]})
    huge = opening * (traits_module.KEPT_CHARS // len(opening) + 1)
    traits({**body, "messages": [{"role": "user", "content": huge}]})
    assert [text for text in traits_module._known if text in texts] == texts[-50:]
    assert sum(map(len, traits_module._known)) <= budget
    assert huge not in traits_module._known


def test_the_clis_billing_line_is_not_the_system_prompt_and_names_a_sub_agent() -> None:
    prompt = "You are Claude Code, Anthropic's official CLI."
    line = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
    base = {
        "model": "m",
        "max_tokens": 9,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "go"}],
    }
    main = traits(
        {
            **base,
            "system": [
                {"type": "text", "text": line.format("c40")},
                {"type": "text", "text": prompt},
            ],
        }
    )
    resumed = traits(
        {
            **base,
            "system": [
                {"type": "text", "text": line.format("f9d")},
                {"type": "text", "text": prompt},
            ],
        }
    )
    assert main["system"] == resumed["system"] and not main["subagent"]
    sub = traits(
        {
            **base,
            "system": [
                {"type": "text", "text": line.format("18b") + " cc_is_subagent=true;"},
                {"type": "text", "text": "You are an agent."},
            ],
        }
    )
    assert sub["subagent"] and sub["system"] != main["system"]


def test_each_call_names_the_reply_before_it_in_every_dialect(tmp_path: Path) -> None:
    """Through the front end, streamed and not: each call's ``answered_before`` is the
    digest of the reply the call before it served (the harness re-sends it as history),
    computed the same way from the request's message as from the stored output items."""
    store_dir = tmp_path / "captures"
    script = dialect_loops.write_script(tmp_path / "script.yaml")
    loops = dialect_loops.loops_for("traits", 6, first_turns=3)
    with both_servers(store_dir, engine={"script_path": script}) as servers:
        harness = dialect_loops.Harness([servers.front])
        done = asyncio.run(dialect_loops.run_loops(harness, loops))
    for loop in done:
        assert loop.error is None, loop.error
        calls = sorted(run(_peek(store_dir, loop.rollout_id)), key=lambda e: e.created_at)
        assert len(calls) == loop.turns
        found = [call.model_extra["request_traits"] for call in calls]
        assert found[0]["turns_before"] == 0 and found[0]["answered_before"] is None
        assert "opening" in found[0], "a conversation start records its opening lines"
        for turn in range(1, len(calls)):
            assert found[turn]["turns_before"] == turn and "opening" not in found[turn]
            assert found[turn]["answered_before"] == reply_digest(calls[turn - 1].output_items)


async def _peek(store_dir: Path, rollout_id: str) -> list:
    store = FileTokenStore(store_dir)
    try:
        return await store.peek(rollout_id)
    finally:
        await store.close()
