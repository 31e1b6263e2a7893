"""Synthetic rollouts for tests and benches, with nothing but the capture records.

One generator of the agent loop's shape (each call's prompt extends the previous call's
prompt and generation by a tool output), so the tests, the store fixtures and the benches
measure and check the same thing. No pytest here: the benches import it too.
"""

from __future__ import annotations

import random
from typing import Any

from capture.records import TokenEntry


def growing_rollout(
    rollout_id: str,
    turns: int,
    *,
    system_tokens: int = 2000,
    generated_per_turn: int = 200,
    tool_tokens_per_turn: int = 300,
    vocab: int = 151_000,
    seed: int = 0,
    final_item: dict[str, Any] | None = None,
) -> list[TokenEntry]:
    """An agent-like rollout: each call's prompt extends the previous prompt + generation.

    Every call but the last makes a tool call; the last one's output item is ``final_item``
    (the harness's final answer) when given. Deterministic for a given seed, so a child
    process, a test and a bench can build the same one.
    """
    rng = random.Random(f"{seed}-{rollout_id}")
    context = [rng.randrange(vocab) for _ in range(system_tokens)]
    entries = []
    for turn in range(turns):
        generation = [rng.randrange(vocab) for _ in range(generated_per_turn)]
        log_probs = [-rng.random() * 5 for _ in range(generated_per_turn)]
        entries.append(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"turn-{turn:05d}",
                model="test-policy",
                prompt_token_ids=list(context),
                generation_token_ids=generation,
                generation_log_probs=log_probs,
                output_items=[
                    final_item
                    if final_item is not None and turn == turns - 1
                    else {
                        "type": "function_call",
                        "name": "bash",
                        "call_id": f"t{turn}",
                        "arguments": "{}",
                    }
                ],
                token_item_index=0,
                created_at=1_700_000_000.0 + turn,
            )
        )
        context += generation + [rng.randrange(vocab) for _ in range(tool_tokens_per_turn)]
    return entries
