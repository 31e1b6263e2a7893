"""Faithful prompts on the real Qwen3 vocabulary and the ``renderers`` Qwen3 renderer.

The property: for any tool-using conversation, whatever the harness does to the form of
what it was served (arguments re-serialized, edge whitespace, reasoning dropped), each
faithful prompt extends the previous call's prompt plus its sampled ids, token for token,
even where the sampled ids are not the canonical encoding of their text.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.call.capture import call_entry, output_items
from api.engine.generation import reply_generation
from api.prompts.canonical import lineage_key, lineage_keys
from api.prompts.faithful import BRIDGE_REFUSED, NO_MATCH, FaithfulPrompts
from api.prompts.lineage import ContinuedCall, LineageMemory
from api.prompts.renderer import build_renderer
from api.prompts.vocab import load_vocab, qwen3_tokenizer
from capture.context import capture_call, current_call
from capture.errors import ConfigError
from capture.filestore.store import FileTokenStore
from capture.lineage import FALLBACK_FIELD, LINEAGE_FIELD
from capture.routes import RouteChain

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("Bash", "Read", "Write")
]
WORDS = ["list", "the", "files", "ok", "héllo", "数据", "run", " spaced ", "done.", "x\ny"]


def _noncanonical(text: str, rng: random.Random) -> list[int]:
    """Ids of ``text`` cut at random character boundaries: same bytes, other tokens."""
    vocab = qwen3_tokenizer()
    cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
    ids, start = [], 0
    for cut in [*cuts, len(text)]:
        ids += vocab.encode(text[start:cut])
        start = cut
    return ids


def _sampled(turn: dict, rng: random.Random) -> list[int]:
    """What the policy samples for a turn, in Qwen3's format, with compact JSON."""
    calls = [
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": args}, separators=(",", ":"), ensure_ascii=False)
        + "\n</tool_call>"
        for name, args in turn["calls"]
    ]
    body = turn["text"] + ("\n" if turn["text"] and calls else "") + "\n".join(calls)
    text = f"<think>\n{turn['think']}\n</think>\n\n{body}" if turn["think"] else body
    vocab = qwen3_tokenizer()
    ids: list[int] = []
    # Markers are single added tokens, as an engine samples them; text between is cut anyhow.
    for piece in re.split(r"(<think>|</think>|<tool_call>|</tool_call>)", text):
        if piece in vocab.added:
            ids.append(vocab.added[piece])
        elif piece:
            ids += _noncanonical(piece, rng)
    return ids + [vocab.added["<|im_end|>"]]


def _echo(message: dict, rng: random.Random) -> dict:
    """The served message as a harness sends it back: other JSON, whitespace, no reasoning."""
    echoed = {
        "role": "assistant",
        "content": (message.get("content") or "") + " " * rng.randint(0, 1),
    }
    if message.get("reasoning_content") and rng.random() < 0.5:
        echoed["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        echoed["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.dumps(json.loads(call["function"]["arguments"]), indent=1),
                },
            }
            for call in message["tool_calls"]
        ]
    return echoed


async def _serve(prompts: FaithfulPrompts, request: dict, turn: dict, rng: random.Random):
    prompt = await prompts.build(request)
    ids = _sampled(turn, rng)
    generation = reply_generation(
        {"model": "qwen3"},
        {"role": "assistant", "content": ""},
        finish_reason="stop",
        stop_reason=None,
        prompt_ids=prompt.ids,
        ids=ids,
        log_probs=[-0.5] * len(ids),
    )
    return prompt, ids, prompts.served(prompt, generation)


_args = st.dictionaries(
    st.sampled_from(["command", "path", "n", "flag"]),
    st.one_of(st.sampled_from(WORDS), st.integers(-5, 500), st.booleans(), st.none()),
    max_size=3,
)
_turn = st.fixed_dictionaries(
    {
        "think": st.sampled_from(["", "I should look.", "Let me  think\nabout it"]),
        "text": st.sampled_from(["", "Sure.", "Running it now", "数据 ok"]),
        "calls": st.lists(st.tuples(st.sampled_from(["Bash", "Read"]), _args), max_size=2),
        "user_after": st.booleans(),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(_turn, min_size=2, max_size=6), seed=st.integers(0, 2**16))
async def test_each_faithful_prompt_extends_the_previous_prompt_and_generation(
    tmp_path_factory, turns, seed
):
    rng = random.Random(seed)
    prompts = FaithfulPrompts(build_renderer("qwen3", "qwen3"))
    store = FileTokenStore(tmp_path_factory.mktemp("store"))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "go"}]
    previous: list[int] | None = None
    async with capture_call("prop", store):
        for turn in turns:
            prompt, ids, generation = await _serve(
                prompts, {"messages": list(messages), "tools": TOOLS}, turn, rng
            )
            if previous is not None:
                assert prompt.fallback is None and prompt.continued is not None
                assert prompt.ids[: len(previous)] == previous
            else:
                assert prompt.fallback is None and prompt.continued is None
            previous = prompt.ids + ids
            messages.append(_echo(generation.message, rng))
            for call in generation.message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": " out "})
            if turn["user_after"] or not generation.message.get("tool_calls"):
                messages.append({"role": "user", "content": "next"})
            current_call().model_call_id = f"call-{len(messages)}"
    await store.close()


async def test_the_reply_is_parsed_from_the_sampled_ids():
    prompts = FaithfulPrompts(build_renderer("qwen3", "qwen3"))
    turn = {"think": "plan", "text": "Sure.", "calls": [("Bash", {"command": "ls", "n": 2})]}
    _, ids, generation = await _serve(
        prompts,
        {"messages": [{"role": "user", "content": "go"}], "tools": TOOLS},
        turn,
        random.Random(1),
    )
    message = generation.message
    assert message["reasoning_content"] == "plan" and message["content"] == "Sure."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "ls", "n": 2}
    assert generation.finish_reason == "tool_calls"
    assert generation.generation_token_ids == ids  # served from exactly the captured ids
    assert LINEAGE_FIELD in generation.entry_fields


async def test_another_worker_continues_the_call_through_the_store(tmp_path):
    """Two front-end workers share nothing but the sink: the second finds the call there."""
    store = FileTokenStore(tmp_path)
    first, second = (FaithfulPrompts(build_renderer("qwen3", "qwen3")) for _ in range(2))
    messages = [{"role": "user", "content": "go"}]
    turn = {"think": "", "text": "", "calls": [("Bash", {"command": "pwd"})]}
    async with capture_call("two-workers", store) as call:
        prompt, ids, generation = await _serve(
            first, {"messages": messages, "tools": TOOLS}, turn, random.Random(2)
        )
        await store.put(call_entry(generation, output_items(generation), call))
    tool_id = generation.message["tool_calls"][0]["id"]
    follow = [
        *messages,
        _echo(generation.message, random.Random(3)),
        {"role": "tool", "tool_call_id": tool_id, "content": "/tmp"},
    ]
    async with capture_call("two-workers", store):
        continued = await second.build({"messages": follow, "tools": TOOLS})
    assert continued.continued == call.model_call_id and continued.fallback is None
    assert continued.ids[: len(prompt.ids) + len(ids)] == prompt.ids + ids
    await store.close()


async def test_fallbacks_are_named(tmp_path):
    store = FileTokenStore(tmp_path)
    prompts = FaithfulPrompts(build_renderer("qwen3", "qwen3", "tool_cycle"))
    messages = [{"role": "user", "content": "go"}]
    turn = {"think": "hm", "text": "Hi.", "calls": []}
    async with capture_call("fallbacks", store):
        _, _, generation = await _serve(prompts, {"messages": messages}, turn, random.Random(4))
        follow = [*messages, _echo(generation.message, random.Random(5))]
        # A new user query: tool_cycle retention re-renders (the template drops thinking).
        refused = await prompts.build({"messages": [*follow, {"role": "user", "content": "more"}]})
        assert refused.fallback == BRIDGE_REFUSED and refused.continued is None
        # A history the front end never served: rendered whole, and named.
        foreign = [
            *messages,
            {"role": "assistant", "content": "never said"},
            {"role": "user", "content": "?"},
        ]
        unmatched = await prompts.build({"messages": foreign})
        assert unmatched.fallback == NO_MATCH
    assert unmatched.ids == prompts.render(foreign, None)
    await store.close()


def test_canonical_keys_ignore_form_and_keep_content():
    base = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "ok ",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "function": {"name": "Bash", "arguments": '{"a":1,"b":[true]}'}}
            ],
        },
    ]
    reformatted = [
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {"role": "assistant", "content": "ok", "reasoning_content": "think"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "Bash", "arguments": {"b": [True], "a": 1}}}
            ],
        },
    ]
    assert lineage_key(base, TOOLS) == lineage_key(reformatted, TOOLS)
    changed = json.loads(json.dumps(base))
    changed[1]["tool_calls"][0]["function"]["arguments"] = '{"a":2,"b":[true]}'
    assert lineage_key(changed, TOOLS) != lineage_key(base, TOOLS)
    assert lineage_key(base, TOOLS[:1]) != lineage_key(base, TOOLS)
    without_reasoning = [base[0], {**base[1], "reasoning_content": ""}]
    assert lineage_key(without_reasoning, TOOLS) in lineage_keys(base, TOOLS)
    assert lineage_key(without_reasoning, TOOLS) != lineage_keys(base, TOOLS)[0]


def test_a_renderer_that_cannot_use_the_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="tool_response"):
        build_renderer("qwen3", "devtools/tokcap_devtools/engine/assets/tokenizer.json")
    with pytest.raises(ConfigError, match="unknown"):
        build_renderer("no-such-renderer", "qwen3")
    with pytest.raises(ConfigError, match="tokenizer"):
        build_renderer("qwen3", "/no/such/dir")


def test_entries_carry_the_fallback_reason():
    assert FALLBACK_FIELD == "faithful_fallback"


@pytest.mark.parametrize("spec", ["qwen3", "file", "directory"])
def test_vocabularies_round_trip_text_and_bytes(spec: str, tmp_path) -> None:
    shipped = Path("devtools/tokcap_devtools/engine/assets/tokenizer.json").resolve()
    if spec == "directory":
        (tmp_path / "tokenizer.json").write_bytes(shipped.read_bytes())
    vocab = load_vocab({"qwen3": "qwen3", "file": str(shipped), "directory": str(tmp_path)}[spec])
    text = 'Héllo <|im_start|>wörld\n  数据 {"a": [1, 2]}'
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    assert b"".join(vocab.token_bytes(i) for i in ids) == text.encode()
    assert vocab.convert_tokens_to_ids("<|im_start|>") == vocab.added["<|im_start|>"]
    assert vocab.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "")


def test_route_chains_count_against_the_lineage_memorys_budget() -> None:
    """A call's route chain is charged to the budget with its ids, and given back with
    them: a rollout whose chains fill the budget is dropped first."""
    names = tuple(f"{n:032x}" for n in range(40))  # a chain of 40 blocks: 10 tokens
    memory = LineageMemory(budget_tokens=29)
    memory.remember("r", ["k1"], "c1", [1, 2, 3], [4], RouteChain(names, 8, 320))
    memory.remember("s", ["s1"], "d1", [5, 6, 7], [8])
    assert memory.recall("r", "k1") is not None  # 14 + 4 tokens: within the budget
    memory.remember("s", ["s2"], "d2", [5, 6, 7, 8, 9], [10], RouteChain(names, 8, 320))
    assert memory.recall("r", "k1") is None  # 14 + 4 + 2 + 10 > 29: r went first
    assert memory.recall("s", "s2").routes_chain == RouteChain(names, 8, 320)
    memory.remember("t", ["t1"], "e1", list(range(12)), [0])  # 16 + 13 still fits
    assert memory.recall("s", "s1") is not None and memory.recall("t", "t1") is not None


def test_the_lineage_memory_shares_a_line_and_keeps_branches_within_its_budget() -> None:
    memory = LineageMemory(budget_tokens=40)
    memory.remember("r", ["k1"], "c1", [1, 2, 3], [4, 5])
    memory.remember("r", ["k2", "k2-bare"], "c2", [1, 2, 3, 4, 5, 6], [7])  # extends c1
    memory.remember("r", ["k3"], "c3", [1, 2, 3], [9])  # a retry of c1: a branch
    assert memory.recall("r", "k1") == ContinuedCall("c1", [1, 2, 3], [4, 5])
    assert memory.recall("r", "k2-bare") == ContinuedCall("c2", [1, 2, 3, 4, 5, 6], [7])
    assert memory.recall("r", "k3") == ContinuedCall("c3", [1, 2, 3], [9])
    assert memory.recall("other", "k1") is None and memory.recall("r", "nope") is None
    memory.remember("s", ["s1"], "d1", list(range(30)), [0])  # over budget: r goes first
    assert memory.recall("r", "k1") is None
    assert memory.recall("s", "s1") == ContinuedCall("d1", list(range(30)), [0])
