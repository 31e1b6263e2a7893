"""Synthetic calls and chains for the builder and delivery tests, made of fresh token ids."""

from __future__ import annotations

import itertools
from typing import Any

from capture.records import ACKED_BEFORE_FIELD, TokenEntry
from capture.traits import opening_digests, reply_digest

SYSTEM = [11, 12, 13, 14]
_fresh = itertools.count(1000)


def message(text: str) -> dict[str, Any]:
    """A Responses assistant message item."""
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def entry(
    call_id: str,
    prompt: list[int],
    generation: list[int],
    *,
    text: str | None = None,
    items: list[dict[str, Any]] | None = None,
    created_at: float = 0.0,
    rollout_id: str = "r1",
    **extra: Any,
) -> TokenEntry:
    items = items if items is not None else [message(text if text is not None else call_id)]
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="policy",
        prompt_token_ids=list(prompt),
        generation_token_ids=list(generation),
        generation_log_probs=[-0.5 - 0.01 * i for i in range(len(generation))],
        output_items=items,
        token_item_index=0 if items else None,
        created_at=created_at,
        **extra,
    )


def fresh(n: int) -> list[int]:
    """Tokens no other part of a test uses."""
    return [next(_fresh) for _ in range(n)]


def chain_entries(
    turns: int,
    *,
    prefix: str = "c",
    system: list[int] | None = None,
    created_at: float = 0.0,
    rollout_id: str = "r1",
    generated: int = 2,
    tool: int = 1,
) -> list[TokenEntry]:
    """A linear agent loop: each prompt is the previous prompt + generation + tool output."""
    context = list(system if system is not None else SYSTEM)
    entries = []
    for turn in range(turns):
        generation = fresh(generated)
        entries.append(
            entry(
                f"{prefix}{turn:03d}",
                context,
                generation,
                text=f"{prefix} says {turn}",
                created_at=created_at + turn,
                rollout_id=rollout_id,
            )
        )
        context = context + generation + fresh(tool)
    return entries


def full(e: TokenEntry) -> list[int]:
    return e.prompt_token_ids + e.generation_token_ids


# The request traits of the main loop (api.call.traits), for the root checks.
MAIN = {"system": "s-main", "tools": "t-main", "n_tools": 2}


def stamp(
    call: TokenEntry,
    before: TokenEntry | None = None,
    *,
    turns: int | None = None,
    opening: str = "",
    **changes: Any,
) -> TokenEntry:
    """Give ``call`` the traits of a request whose last assistant turn ``before`` sampled
    (None: a conversation start, opening with ``opening``)."""
    found: dict[str, Any] = {
        **MAIN,
        "subagent": False,
        "structured_output": False,
        "summary_request": False,
        "continuation": False,
        "turns_before": turns if turns is not None else (0 if before is None else 1),
        "answered_before": reply_digest(before.output_items) if before is not None else None,
        **changes,
    }
    if before is None:
        found["opening"] = opening_digests(opening)
    call.__pydantic_extra__["request_traits"] = found
    return call


def loop(turns: int, prefix: str = "loop", opening: str = "Task: list the files", **kw: Any):
    """An agent loop whose calls each carry the reply of the one before, each stored by one
    front-end process after the ones before it (``capture.acked``)."""
    calls = chain_entries(turns, prefix=prefix, **kw)
    stamp(calls[0], opening=opening)
    for turn in range(1, turns):
        stamp(calls[turn], calls[turn - 1], turns=turn)
    for count, call in enumerate(calls):
        acked(call, count)
    return calls


def acked(call: TokenEntry, count: int, worker: str = "w-test") -> TokenEntry:
    """Stamp ``call`` as stored by ``worker`` after ``count`` of its rollout's puts."""
    call.__pydantic_extra__[ACKED_BEFORE_FIELD] = {"worker": worker, "count": count}
    return call
