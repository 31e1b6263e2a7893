"""Checks that an output list is one token sequence: each carrier extends the one before."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from capture.build.projection import carriers
from capture.codec.views import IdView


def contiguity_errors(items: Iterable[Any]) -> list[str]:
    """Why the token-bearing items are not contiguous; empty when they are.

    Contiguous: each carrier's prompt starts with the previous carrier's prompt and
    generation, so the whole output is one token sequence. The arrays are lists or views of
    a chain's shared sequence (``IdView``); this check compares ids, never identity.
    """
    errors = []
    previous: list[int] | None = None
    for index, item in enumerate(carriers(items)):
        prompt = item.get("prompt_token_ids")
        generation = item.get("generation_token_ids")
        log_probs = item.get("generation_log_probs")
        if not isinstance(prompt, list | IdView) or not isinstance(generation, list | IdView):
            errors.append(f"carrier {index} lacks prompt_token_ids or generation_token_ids")
            previous = None
            continue
        if not isinstance(log_probs, list) or len(log_probs) != len(generation):
            errors.append(f"carrier {index} has log-probs that do not match its generation")
        if previous is not None and prompt[: len(previous)] != previous:
            errors.append(
                f"carrier {index}'s prompt does not start with carrier {index - 1}'s "
                "prompt and generation"
            )
        previous = [*prompt, *generation]
    return errors


def is_contiguous(items: Iterable[Any]) -> bool:
    return not contiguity_errors(items)
