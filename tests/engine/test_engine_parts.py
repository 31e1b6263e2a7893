"""The tokcap engine's parts on their own: tokenizer, template, tool parser, pseudo-model,
policies. No server here; the HTTP behaviour is in test_engine_server / test_engine_prefix.
"""

from __future__ import annotations

import json
import math
import random

import pytest
from tokenizers import Tokenizer

from tokcap_devtools.engine import train_tokenizer
from tokcap_devtools.engine.generation import Engine, SamplingParams
from tokcap_devtools.engine.policies import (
    Conversation,
    RandomPolicy,
    Reply,
    ScriptedPolicy,
    reply_text,
)
from tokcap_devtools.engine.sampler import FLOOR, PseudoModel
from tokcap_devtools.engine.settings import EngineSettings
from tokcap_devtools.engine.template import (
    COMPACT_SEPARATORS,
    TEMPLATE_SEPARATORS,
    messages_from_prompt,
    render,
    tools_from_prompt,
)
from tokcap_devtools.engine.tokenizer import DEFAULT_TOKENIZER_PATH, StreamDecoder, load_tokenizer
from tokcap_devtools.engine.tool_parser import parse_reply

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_shipped_tokenizer_has_the_chat_tokens(tok):
    assert 4000 <= tok.vocab_size <= 4200
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.token_to_id(name) in tok.special_ids
    for name in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        token_id = tok.token_to_id(name)
        assert token_id in tok.added_ids and token_id not in tok.special_ids
        assert tok.encode(f"a {name} b").count(token_id) == 1


def test_training_reproduces_the_shipped_tokenizer():
    corpus = train_tokenizer.CORPUS_PATH.read_text(encoding="utf-8")
    trained = train_tokenizer.train(corpus)
    assert trained.to_str() == Tokenizer.from_file(str(DEFAULT_TOKENIZER_PATH)).to_str()


def test_encode_decode_round_trip_and_stream_decoding(tok):
    text = 'Grüße, 世界! naïve café — emoji 🎉 and code: {"a": [1, 2]}'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    decoder = StreamDecoder(tok)
    pieces = [decoder.feed(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert "" in pieces, "a multi-byte character spans tokens, so some token adds no text yet"


def test_noncanonical_splits_keep_bytes_but_change_ids(tok):
    ids = tok.encode("Let me check the working directory")
    split_any = False
    for token_id in ids:
        for left, right in tok.splits(token_id):
            assert tok.token_bytes[left] + tok.token_bytes[right] == tok.token_bytes[token_id]
            assert tok.encode(tok.decode([left, right])) == [token_id]
            split_any = True
    assert split_any
    assert tok.splits(tok.im_end_id) == () and tok.splits(tok.token_to_id("<think>")) == ()


def test_template_renders_chatml_tools_think_and_tool_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "run "}, {"type": "text", "text": "ls"}],
        },
        {
            "role": "assistant",
            "content": "Sure.",
            "reasoning_content": "use bash",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command":"ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "system", "content": "mid-conversation note"},
    ]
    text = render(messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert (
        "<|im_start|>assistant\n<think>\nuse bash\n</think>\n\nSure.\n<tool_call>\n"
        '{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>tool\n<tool_response>\na.txt\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>system\nmid-conversation note<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not render(messages, tools=TOOLS, add_generation_prompt=False).endswith("assistant\n")
    stripped = render(messages, tools=TOOLS, think_strip=True)
    assert "<think>" not in stripped and "Sure.\n<tool_call>" in stripped
    assert tools_from_prompt(text) == TOOLS
    assert [m["role"] for m in messages_from_prompt(text)] == [
        "system",
        "user",
        "assistant",
        "tool",
        "system",
    ]


@pytest.mark.parametrize(
    "reply",
    [
        Reply(text="Hello there."),
        Reply(think="plan it", text="Running it.", tool_calls=(("Bash", {"command": "ls -la"}),)),
        Reply(tool_calls=(("Bash", {"command": "pwd"}), ("Bash", {"command": "echo é"}))),
        Reply(think="only thinking", text="Answer."),
    ],
)
def test_parse_then_render_gives_back_the_generated_text(reply):
    text = reply_text(reply, TEMPLATE_SEPARATORS)
    parsed = parse_reply(text)
    assistant = {
        "role": "assistant",
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
        "tool_calls": [c.as_openai() for c in parsed.tool_calls],
    }
    rendered = render([assistant], add_generation_prompt=False)
    assert rendered == f"<|im_start|>assistant\n{text}<|im_end|>\n"
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)
    compact = reply_text(reply, COMPACT_SEPARATORS)
    if reply.tool_calls:
        assert compact != text and [c.arguments for c in parse_reply(compact).tool_calls] == [
            c.arguments for c in parsed.tool_calls
        ]


def test_parser_leaves_broken_tool_calls_as_content():
    parsed = parse_reply('Hi\n<tool_call>\n{"name": "Bash", "arguments": {oops}\n</tool_call>')
    assert parsed.tool_calls == [] and parsed.content.startswith("Hi\n<tool_call>")
    assert (
        parse_reply('<tool_call>\n{"name": "X"}\n</tool_call>', parse_tools=False).tool_calls == []
    )


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.8), (0.3, 0.5)])
def test_pseudo_model_is_a_normalized_distribution(temperature, top_p):
    model = PseudoModel(211)
    step = model.step([5, 6, 7], 42, temperature=temperature, top_p=top_p, top_logprobs=211)
    assert step.top[0] == (42, step.logprob)
    assert len({token for token, _ in step.top}) == 211
    mass = sum(math.exp(lp) for _, lp in step.top if lp > FLOOR)
    assert mass == pytest.approx(1.0, abs=1e-9)
    assert all(step.logprob >= lp for _, lp in step.top)
    if top_p < 1.0:
        assert any(lp == FLOOR for _, lp in step.top), "tokens outside the nucleus get -inf"
    again = model.step([5, 6, 7], 42, temperature=temperature, top_p=top_p, top_logprobs=211)
    assert again == step
    other = model.step([5, 6, 8], 42, temperature=temperature, top_p=1.0).logprob
    assert other != model.step([5, 6, 7], 42, temperature=temperature, top_p=1.0).logprob


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.5, 0.8)])
def test_pseudo_model_samples_from_the_distribution_it_reports(temperature, top_p):
    model = PseudoModel(301)
    allowed = list(range(0, 301, 3))
    rng = random.Random(5)
    draws = 4000
    counts: dict[int, int] = {}
    reported: dict[int, float] = {}
    for _ in range(draws):
        step = model.sample(
            [9, 9], allowed, rng, temperature=temperature, top_p=top_p, top_logprobs=3
        )
        assert step.token_id in allowed and step.top[0] == (step.token_id, step.logprob)
        counts[step.token_id] = counts.get(step.token_id, 0) + 1
        reported[step.token_id] = step.logprob
    assert sum(math.exp(lp) for lp in reported.values()) == pytest.approx(1.0, abs=0.02)
    for token, count in counts.items():
        p = math.exp(reported[token])
        assert abs(count / draws - p) < 4 * math.sqrt(p * (1 - p) / draws) + 1e-3
    greedy = model.sample([9, 9], allowed, rng, temperature=0.0, top_p=1.0)
    assert greedy.token_id == max(reported, key=reported.get)


def test_scripted_policy_by_turn_index_regex_and_default():
    policy = ScriptedPolicy(
        {
            "entries": [
                {"match": "(?i)title", "text": "A title"},
                {
                    "turn": 0,
                    "text": "first",
                    "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}],
                },
                {"turn": 1, "match": "needle", "text": "second with needle"},
            ],
            "default": {"text": "fallback"},
        }
    )
    rng = random.Random(0)
    user = {"role": "user", "content": "hello"}
    assistant = {"role": "assistant", "content": "x"}
    assert policy.reply(Conversation([user], TOOLS), rng).tool_calls == (
        ("Bash", {"command": "ls"}),
    )
    assert policy.reply(Conversation([user], []), rng).tool_calls == (), "no tools offered"
    assert (
        policy.reply(Conversation([{"role": "user", "content": "Write a TITLE"}]), rng).text
        == "A title"
    )
    turn1 = [user, assistant, {"role": "tool", "content": "needle here"}]
    assert policy.reply(Conversation(turn1, TOOLS), rng).text == "second with needle"
    turn1[-1] = {"role": "tool", "content": "nothing"}
    assert policy.reply(Conversation(turn1, TOOLS), rng).text == "fallback"


def test_random_policy_is_seeded():
    policy = RandomPolicy()
    conversation = Conversation([{"role": "user", "content": "go"}], TOOLS)
    first = [policy.reply(conversation, random.Random(s)) for s in range(8)]
    assert first == [policy.reply(conversation, random.Random(s)) for s in range(8)]
    assert len({repr(r) for r in first}) > 1
    assert any(r.sampled_words for r in first), "the engine samples the text"
    assert any(r.tool_calls for r in first) and all(
        name == "Bash" and isinstance(args["command"], str)
        for r in first
        for name, args in r.tool_calls
    )


def test_generation_ends_with_im_end_and_stops_like_vllm():
    engine = Engine(EngineSettings())
    prompt = engine.chat_prompt_ids([{"role": "user", "content": "hi"}], None)
    conversation = Conversation([{"role": "user", "content": "hi"}])
    [full] = engine.generate(prompt, conversation, SamplingParams(seed=1))
    assert full.token_ids[-1] == engine.tokenizer.im_end_id and full.finish_reason == "stop"
    assert full.stop_reason is None and "".join(full.deltas) == full.text
    [stopped] = engine.generate(prompt, conversation, SamplingParams(seed=1, stop=("command",)))
    assert stopped.stop_reason == "command" and stopped.finish_reason == "stop"
    assert "command" not in stopped.text and full.text.startswith(stopped.text)
    assert "command" in engine.tokenizer.decode(stopped.token_ids), "stop token kept in ids"
    [short] = engine.generate(prompt, conversation, SamplingParams(seed=1, max_tokens=3))
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]
