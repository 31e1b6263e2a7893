"""A faithful reply relayed id by id (``api.prompts.relay``), with the real Qwen3 renderer.

Whatever the ids so far, what was sent is the start of the whole reply's parse: no split
character, no whitespace the renderer strips later, reasoning before text, tool calls only
at the end; what the whole parse adds goes out last, and a whole parse that does not
continue what was sent fails the call.
"""

from __future__ import annotations

from typing import Any

import pytest

from api.prompts.faithful import FaithfulPrompts, Prompt
from api.prompts.relay import GROWTH, ParsedRelay, RelayDiverged
from api.prompts.renderer import load_renderer
from api.types import Delta

REPLY = (
    "<think>\n  Naïve plan: 東京 then 🎉 — check   \n</think>\n\n"
    "Result:  東京🎉 done.  \n\n"
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo 東京"}}\n</tool_call>'
    "<|im_end|>"
)


@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, Any]:
    return load_renderer("qwen3", "qwen3")


def _prompt(renderer: Any) -> Prompt:
    messages = [{"role": "user", "content": "go"}]
    ids = list(renderer.render_ids(messages, add_generation_prompt=True))
    return Prompt(ids, {}, messages, None, None)  # type: ignore[arg-type]


def _relayed(relay: ParsedRelay, ids: list[int]) -> list[Delta]:
    """Every id fed as its own event, each parsed (as if every event were due)."""
    sent = []
    for upto in range(1, len(ids) + 1):
        relay.events = relay.parsed_at = upto
        sent.append(relay.advance(ids[:upto]))
    return sent


def test_what_is_sent_is_always_the_start_of_the_whole_parse(qwen3: tuple[Any, Any]) -> None:
    renderer, vocab = qwen3
    ids = vocab.encode(REPLY)
    prompt = _prompt(renderer)
    relay = ParsedRelay(renderer, prompt)
    sent = _relayed(relay, ids)
    message = FaithfulPrompts(renderer).parsed_message(ids, prompt)
    rest = relay.rest(message)
    reasoning = "".join(d.reasoning for d in [*sent, rest])
    text = "".join(d.text for d in [*sent, rest])
    assert reasoning == message["reasoning_content"] == "Naïve plan: 東京 then 🎉 — check"
    assert text == message["content"] == "Result:  東京🎉 done."
    assert not any("\ufffd" in d.reasoning + d.text for d in sent), "no split character"
    assert sum(bool(d) for d in sent) > 10, "sent as it came, not at the end"
    first_text = next(n for n, d in enumerate(sent) if d.text)
    assert not any(d.reasoning for d in sent[first_text:]), "reasoning before text"
    assert not any(d.tool_calls for d in sent), "tool calls only once the reply is whole"
    (call,) = rest.tool_calls
    (whole,) = message["tool_calls"]
    assert (call["id"], call["name"]) == (whole["id"], "Bash")
    assert call["arguments"] == whole["function"]["arguments"]


def test_a_whole_parse_that_does_not_continue_what_was_sent_fails(
    qwen3: tuple[Any, Any],
) -> None:
    renderer, vocab = qwen3
    ids = vocab.encode("Hello there, world.<|im_end|>")
    relay = ParsedRelay(renderer, _prompt(renderer))
    _relayed(relay, ids[:4])
    assert relay.text.startswith("Hello")
    with pytest.raises(RelayDiverged) as raised:
        relay.rest({"role": "assistant", "content": "Goodbye."})
    assert raised.value.status == 502
    with pytest.raises(RelayDiverged):  # reasoning after text was sent is out of order
        relay.rest({"role": "assistant", "content": relay.text, "reasoning_content": "late"})


def test_ids_are_parsed_again_only_as_they_grow(qwen3: tuple[Any, Any]) -> None:
    """A fast stream of n events is parsed about GROWTH * ln(n) times, not n."""
    renderer, _ = qwen3
    relay = ParsedRelay(renderer, _prompt(renderer))
    due = sum(relay.due() for _ in range(2000))
    assert 1 <= due <= GROWTH * 10, due
