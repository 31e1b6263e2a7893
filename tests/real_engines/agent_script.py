"""The scripted agent turns both real engines are made to sample (test tooling).

Imported by each engine's own logits processor (``scripted_turns`` for vLLM,
``sglang_turns`` for SGLang), inside that engine's process and venv, so it needs nothing but
the standard library. A reply is chosen from the request's prompt: with tools on offer and
no tool result yet, thinking and one hermes tool call (``list_files``, or the CLI's ``Bash``
running ``ls`` where that is on offer); after a tool result, thinking and a final answer;
otherwise thinking and a greeting (another one after an earlier reply, so a chat's turns
differ). A prompt that holds ``FREE_MARK`` is not scripted at all. A prompt that holds
``SLOW_MARK`` asks the processor to hold its first step, as a long prefill under load would;
one that holds ``PACED_MARK`` holds every step a little, so a long free run lasts long
enough, however fast the machine, to be cut. Each scripted token is put just above the
largest logit for a greedy request, so its log-prob stays a real value of the model's, and
far above it for a request sampled at a temperature, so the engine cannot miss it
(``lift``).
"""

from __future__ import annotations

import json

IM_END = 151645  # <|im_end|>: sampled once the script is done
TOOL_CALL = 151657  # <tool_call>: the system turn names it when tools are on offer
TOOL_RESPONSE = 151665  # <tool_response>: a tool result in the prompt
# How far above the largest logit the scripted token is put. A greedy request takes the
# largest logit, so a margin picks it and its log-prob stays the model's own value (about -10
# here, varying by position), which the tier compares position by position. A request sampled
# at a temperature takes it only when it is all but certain: there the log-prob is ~0 whatever
# the lift, as it is the log-prob of the distribution sampled from.
GREEDY_MARGIN = 2.0
SAMPLED_LIFT = 50.0
SLOW_MARK = "[slow prefill]"
SLOW_PREFILL_S = 3.0
# A prompt that holds it makes every engine step it is in last at least PACED_STEP_S: at most
# 50 tokens a second, so a test can act while such a call is generating.
PACED_MARK = "[paced]"
PACED_STEP_S = 0.02
# A prompt that holds it is left to the random model: a long free run (a call a weight
# update can cut mid-generation), ended by ``max_tokens``.
FREE_MARK = "[free run]"
FREE = "free"
ASSISTANT_TURN = "<|im_start|>assistant"
# The Claude Code CLI offers its own tools (an engine may drop a call to a tool not on
# offer, as SGLang's parsers do): where it offers Bash, the call runs ``ls`` with it.
BASH_ON_OFFER = '"name": "Bash"'
# What a request to SGLang names its processor with: ``sglang_turns.ScriptedTurns`` by
# reference (a protocol-0 pickle), in the ``{"callable": hex}`` form SGLang's
# ``CustomLogitProcessor.to_str`` writes; building it needs neither dill nor SGLang.
SGLANG_PROCESSOR = json.dumps({"callable": b"csglang_turns\nScriptedTurns\n.".hex()})

SCRIPTS = {
    "call": (
        "<think>\nThe user wants the files listed, so I will call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "list_files", "arguments": {"path": "."}}\n</tool_call>'
    ),
    "bash": (
        "<think>\nThe user wants the files listed, so I will run ls.\n</think>\n\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", '
        '"description": "List the files"}}\n</tool_call>'
    ),
    "answer": (
        "<think>\nThe tool has answered; I can reply now.\n</think>\n\nThe directory holds a.txt."
    ),
    "greet": "<think>\nA greeting needs no tool.\n</think>\n\nHello from the tiny model.",
    "again": "<think>\nWe spoke before.\n</think>\n\nHello again from the tiny model.",
}


def script_name(prompt: list[int], text: str) -> str:
    """Which script answers a prompt, from its ids and its text (``FREE``: none)."""
    if FREE_MARK in text:
        return FREE
    if TOOL_RESPONSE in prompt:
        return "answer"
    if TOOL_CALL in prompt:
        return "bash" if BASH_ON_OFFER in text else "call"
    # The prompt ends with the turn to write: more than one means an earlier reply.
    return "again" if text.count(ASSISTANT_TURN) > 1 else "greet"


def target(script: list[int], step: int) -> int:
    """The id to sample at ``step`` of a script: its next id, then the end of the turn."""
    return script[step] if step < len(script) else IM_END


def lift(greedy: bool) -> float:
    """How far above the largest logit to put a scripted token (see ``GREEDY_MARGIN``)."""
    return GREEDY_MARGIN if greedy else SAMPLED_LIFT
