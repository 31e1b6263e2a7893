"""A vLLM logits processor that makes a random tiny model act as a tool-calling agent.

Loaded by vLLM itself (``--logits-processors scripted_turns:ScriptedTurns``, with this folder
on its ``PYTHONPATH``), through the logits-processor interface of vLLM's v1 model runner,
which its CPU runner uses (``vllm.v1.sample.logits_processor.LogitsProcessor``, followed:
vLLM 0.32.0). Each request gets the scripted reply ``agent_script`` chooses from its prompt.
At each step the scripted token's logit is lifted far above the rest, so the engine samples
it and its log-prob stays the model's own (processed) value, a hair below zero; after the
script, the end-of-turn token. vLLM's reasoning and tool parsers, its stream and its id and
log-prob fields then all run on real output.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from agent_script import FREE, LIFT, SCRIPTS, SLOW_MARK, SLOW_PREFILL_S, script_name, target
from tokenizers import Tokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


class ScriptedTurns(LogitsProcessor):
    """Forces each request's scripted reply, token by token, then the end of the turn."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        path = Path(vllm_config.model_config.tokenizer) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        self.scripts = {
            name: self.tokenizer.encode(text, add_special_tokens=False).ids
            for name, text in SCRIPTS.items()
        }
        # batch row -> (the scripted ids, the request's running output ids, held yet)
        self.rows: dict[int, tuple[list[int], list[int], list[bool]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def _row(self, prompt: list[int] | None, output: list[int]) -> tuple[Any, ...]:
        text = self.tokenizer.decode(prompt or [], skip_special_tokens=False)
        name = script_name(prompt or [], text)
        return self.scripts.get(name) if name != FREE else None, output, [SLOW_MARK in text]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows, batch_update, lambda _params, prompt, output: self._row(prompt, output)
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (script, output, slow) in self.rows.items():
            if slow[0]:
                slow[0] = False
                time.sleep(SLOW_PREFILL_S)  # holds the whole engine step: a slow prefill
            if script is None:  # a free run is the model's own, among the tokenizer's ids
                logits[row, self.tokenizer.get_vocab_size() :] = float("-inf")
            else:
                logits[row, target(script, len(output))] = logits[row].max() + LIFT
        return logits
