"""Rollouts whose calls carry MoE routes, routed the way an engine routes: by prefix."""

from __future__ import annotations

import numpy

from capture.records import TokenEntry
from capture.routes import Routes

LAYERS, TOP_K, EXPERTS = 4, 2, 64


def routes_for(ids: list[int], layers: int = LAYERS, top_k: int = TOP_K) -> numpy.ndarray:
    """Routes that depend only on the prefix up to each position, as an engine's do."""
    rows = []
    running = 0
    for position, token in enumerate(ids[:-1]):
        running = (running * 31 + token + position) % 10_007
        rows.append(
            [[(running + 7 * layer + k) % EXPERTS for k in range(top_k)] for layer in range(layers)]
        )
    return numpy.asarray(rows, dtype=numpy.uint16).reshape(-1, layers, top_k)


def rollout(turns: int, per_turn: int = 40, rollout_id: str = "r") -> list[TokenEntry]:
    """A chain of calls, each prompt the previous sequence plus a user turn."""
    entries, sequence = [], []
    for turn in range(turns):
        prompt = sequence + [100 + (turn * 7 + i) % 900 for i in range(per_turn)]
        generation = [1000 + (turn * 13 + i) % 900 for i in range(per_turn // 2)]
        sequence = prompt + generation
        entries.append(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"c{turn}",
                prompt_token_ids=prompt,
                generation_token_ids=generation,
                generation_log_probs=[-0.5] * len(generation),
                routed_experts=Routes.from_array(routes_for(sequence)),
            )
        )
    return entries
