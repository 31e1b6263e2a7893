"""A vLLM logits processor that makes a random tiny model act as a tool-calling agent.

Loaded by vLLM itself (``--logits-processors scripted_turns:ScriptedTurns``, with this folder
on its ``PYTHONPATH``), through the logits-processor interface of vLLM's v1 model runner,
which its CPU runner uses (``vllm.v1.sample.logits_processor.LogitsProcessor``, followed:
vLLM 0.32.0). Every request gets a scripted reply chosen from its prompt: with tools on
offer and no tool result yet, thinking and one hermes tool call; after a tool result,
thinking and a final answer; otherwise thinking and a greeting (another one after an
earlier reply, so a chat's turns differ). A prompt that holds ``[slow prefill]`` is held
``SLOW_PREFILL_S`` before its first token, as a long prefill under load would hold it. At
each step the scripted token's logit is lifted far above the rest, so the engine samples it
and its log-prob stays the model's own (processed) value, a hair below zero; after the
script, the end-of-turn token. vLLM's reasoning and tool parsers, its stream and its id and
log-prob fields then all run on real output.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

IM_END = 151645
TOOL_CALL = 151657  # <tool_call>: the system turn names it when tools are on offer
TOOL_RESPONSE = 151665  # <tool_response>: a tool result in the prompt
LIFT = 50.0  # how far above the largest logit the scripted token is put
SLOW_MARK = "[slow prefill]"
SLOW_PREFILL_S = 3.0

CALL_TOOL = (
    "<think>\nThe user wants the files listed, so I will call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "list_files", "arguments": {"path": "."}}\n</tool_call>'
)
ANSWER = "<think>\nThe tool has answered; I can reply now.\n</think>\n\nThe directory holds a.txt."
GREETING = "<think>\nA greeting needs no tool.\n</think>\n\nHello from the tiny model."
AGAIN = "<think>\nWe spoke before.\n</think>\n\nHello again from the tiny model."
ASSISTANT_TURN = "<|im_start|>assistant"


class ScriptedTurns(LogitsProcessor):
    """Forces each request's scripted reply, token by token, then the end of the turn."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        path = Path(vllm_config.model_config.tokenizer) / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer = tokenizer
        self.scripts = {
            name: tokenizer.encode(text, add_special_tokens=False).ids
            for name, text in (
                ("call", CALL_TOOL),
                ("answer", ANSWER),
                ("greet", GREETING),
                ("again", AGAIN),
            )
        }
        # batch row -> (the scripted ids, the request's running output ids, held yet)
        self.rows: dict[int, tuple[list[int], list[int], list[bool]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def _script(self, prompt: list[int], text: str) -> list[int]:
        if TOOL_RESPONSE in prompt:
            return self.scripts["answer"]
        if TOOL_CALL in prompt:
            return self.scripts["call"]
        # The prompt ends with the turn to write: more than one means an earlier reply.
        return self.scripts["again" if text.count(ASSISTANT_TURN) > 1 else "greet"]

    def _row(self, prompt: list[int] | None, output: list[int]) -> tuple[Any, ...]:
        text = self.tokenizer.decode(prompt or [], skip_special_tokens=False)
        return self._script(prompt or [], text), output, [SLOW_MARK in text]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows, batch_update, lambda _params, prompt, output: self._row(prompt, output)
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (script, output, slow) in self.rows.items():
            step = len(output)
            if slow[0]:
                slow[0] = False
                time.sleep(SLOW_PREFILL_S)  # holds the whole engine step: a slow prefill
            target = script[step] if step < len(script) else IM_END
            logits[row, target] = logits[row].max() + LIFT
        return logits
