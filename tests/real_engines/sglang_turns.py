"""An SGLang custom logit processor that makes the random tiny Qwen3 act as a tool-calling
agent: the SGLang counterpart of ``scripted_turns`` (followed: SGLang 0.5.23,
``python/sglang/srt/sampling/custom_logit_processor.py``).

SGLang takes a processor per request, not per server: the server runs with
``--enable-custom-logit-processor`` and this folder on its ``PYTHONPATH``, and the recording
proxy adds ``agent_script.SGLANG_PROCESSOR`` (this class by reference) and an empty
``custom_params`` to every sampling request on its way to SGLang (the front end never sends
them). Only when ``custom_params`` is a dict does SGLang hand the live request to the
processor (``__req__``): its prompt ids and the ids sampled so far. The count of those is
exact only with ``--disable-overlap-schedule`` (with overlap it lags a step and a token
repeats). A scripted token is put just above the largest logit for a greedy request and far
above it for a sampled one (``agent_script.lift``).
"""

from __future__ import annotations

import time
from typing import Any

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
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ScriptedTurns(CustomLogitProcessor):
    """Forces each request's scripted reply, token by token, then the end of the turn."""

    def _script(self, request: Any) -> list[int]:
        """The request's scripted ids; a slow prefill is held here, at its first step, and
        whether each of its steps is to be held is noted on it (``request.paced``)."""
        prompt = list(request.origin_input_ids)
        text = request.tokenizer.decode(prompt, skip_special_tokens=False)
        if SLOW_MARK in text:
            time.sleep(SLOW_PREFILL_S)  # holds the whole engine step, as a long prefill would
        request.paced = PACED_MARK in text
        name = script_name(prompt, text)
        if name == FREE:
            return []
        return request.tokenizer.encode(SCRIPTS[name], add_special_tokens=False)

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any]] | None = None) -> Any:
        paced = False
        for row, params in enumerate(custom_param_list or []):
            request = (params or {}).get("__req__")
            if request is None:
                continue
            script = getattr(request, "scripted_ids", None)
            if script is None:  # once per request: its prompt does not change
                script = request.scripted_ids = self._script(request)
            paced = paced or request.paced
            if script:  # a free run ([] ids) is the model's own
                # SGLang samples greedily at top_k 1 (temperature 0 is read as that).
                margin = lift(greedy=request.sampling_params.top_k <= 1)
                logits[row, target(script, len(request.output_ids))] = logits[row].max() + margin
        if paced:
            time.sleep(PACED_STEP_S)  # once a step, however many paced requests it holds
        return logits
