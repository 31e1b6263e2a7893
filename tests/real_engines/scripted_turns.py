"""A vLLM logits processor that makes a random tiny model act as a tool-calling agent.

Loaded by vLLM itself (``--logits-processors scripted_turns:ScriptedTurns``, with this folder
on its ``PYTHONPATH``), through the logits-processor interface of vLLM's v1 model runner,
which its CPU runner uses (``vllm.v1.sample.logits_processor.LogitsProcessor``, followed:
vLLM 0.32.0). Each request gets the scripted reply ``agent_script`` chooses from its prompt.
At each step the scripted token's logit is put above the largest (``agent_script.lift``):
just above it for a greedy request, whose log-prob then stays the model's own (processed)
value, far above it for a sampled one; after the script, the end-of-turn token. vLLM's
reasoning and tool parsers, its stream and its id and log-prob fields then all run on real
output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from agent_script import (
    FREE,
    PACED_MARK,
    PACED_STEP_S,
    SCRIPTS,
    SLOW_MARK,
    SLOW_PREFILL_S,
    lift,
    script_name,
    target,
)
from tokenizers import Tokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

# vLLM samples a request whose temperature is below this greedily (``vllm.v1.sample.sampler``).
SAMPLING_EPS = 1e-5


@dataclass
class Row:
    """One request in the batch: its scripted ids (None: a free run), its running output
    ids (vLLM's own list, which grows as it samples), whether its first step is still to be
    held, how far its scripted tokens are lifted, and whether each of its steps is held."""

    script: list[int] | None
    output: list[int]
    slow: bool
    lift: float
    paced: bool


class ScriptedTurns(LogitsProcessor):
    """Forces each request's scripted reply, token by token, then the end of the turn."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        path = Path(vllm_config.model_config.tokenizer) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        self.scripts = {
            name: self.tokenizer.encode(text, add_special_tokens=False).ids
            for name, text in SCRIPTS.items()
        }
        self.rows: dict[int, Row] = {}  # batch row -> its request

    def is_argmax_invariant(self) -> bool:
        return False

    def _row(self, params: Any, prompt: list[int] | None, output: list[int]) -> Row:
        text = self.tokenizer.decode(prompt or [], skip_special_tokens=False)
        name = script_name(prompt or [], text)
        script = self.scripts.get(name) if name != FREE else None
        greedy = params.temperature < SAMPLING_EPS
        return Row(script, output, SLOW_MARK in text, lift(greedy), PACED_MARK in text)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if any(row.paced for row in self.rows.values()):
            time.sleep(PACED_STEP_S)  # once a step, however many paced rows it holds
        for index, row in self.rows.items():
            if row.slow:
                row.slow = False
                time.sleep(SLOW_PREFILL_S)  # holds the whole engine step: a slow prefill
            if row.script is None:  # a free run is the model's own, among the tokenizer's ids
                logits[index, self.tokenizer.get_vocab_size() :] = float("-inf")
            else:
                scripted = target(row.script, len(row.output))
                logits[index, scripted] = logits[index].max() + row.lift
        return logits
