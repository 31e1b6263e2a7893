"""One upstream completion, as every engine adapter reads it, and the checks they share.

Whatever engine answered, a call becomes a ``Generation``: the served message, the three id
arrays, and ``ids_problem`` when the ids cannot be captured. The checks here are the
engine-independent ones of the fail-closed rules; each adapter adds its own (which fields,
which placeholders) before calling them:

- the id counts equal ``usage.prompt_tokens`` and ``usage.completion_tokens`` when the engine
  reports them;
- each log-prob is a number, finite and <= 0;
- a reply that served text, reasoning or a tool call has generated ids;
- ids are integers >= 0, below the vocabulary size when it is configured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy

from capture.codec.packed import pack_ids
from capture.routes import Routes


class UpstreamError(Exception):
    """The upstream returned no usable output; ``status`` is what the harness is told."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Generation:
    """One upstream completion, reduced to what the capture and reply steps read."""

    response: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str | None
    stop_reason: Any
    prompt_token_ids: list[int] | None
    generation_token_ids: list[int] | None
    generation_log_probs: list[float] | None
    # Why the ids cannot be captured (None when they can).
    ids_problem: str | None
    overridden_keys: tuple[str, ...] = ()
    usage: dict[str, Any] = field(default_factory=dict)
    # (asked, sent) when max_tokens was lowered to the room the context window leaves.
    max_tokens_clamp: tuple[int, int] | None = None
    # Extra fields the capture step records on the call's entry (faithful prompts' lineage).
    entry_fields: dict[str, Any] = field(default_factory=dict)
    # The prompt ids packed (little-endian uint32) by their check, for the entry to carry.
    prompt_packed: bytes | None = None
    # MoE routes, checked against the ids (``api.engine.routes``), where they are captured.
    routed_experts: Routes | None = None
    # The policy version the call ran under: the engine's report, else the trainer's at
    # dispatch (``api.call.policy``).
    policy_version: str | None = None

    @property
    def text(self) -> str:
        content = self.message.get("content")
        return content if isinstance(content, str) else ""

    @property
    def reasoning(self) -> str:
        # vLLM 0.10 and SGLang name it reasoning_content; later vLLM releases name it reasoning.
        value = self.message.get("reasoning_content") or self.message.get("reasoning")
        return value if isinstance(value, str) else ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        calls = self.message.get("tool_calls") or []
        return [call for call in calls if isinstance(call, Mapping)]

    @property
    def prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)


def reply_generation(
    response: Mapping[str, Any],
    message: Mapping[str, Any],
    *,
    finish_reason: Any,
    stop_reason: Any,
    prompt_ids: Any,
    ids: list[int] | None,
    log_probs: list[float] | None,
    overridden_keys: tuple[str, ...] = (),
    usage: Any = None,
) -> Generation:
    """A Generation as an adapter read it, before the checks (``usage``: the reply's own)."""
    usage = response.get("usage") if usage is None else usage
    return Generation(
        response=dict(response),
        message=dict(message),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        prompt_token_ids=prompt_ids,
        generation_token_ids=ids,
        generation_log_probs=log_probs,
        ids_problem=None,
        overridden_keys=overridden_keys,
        usage=dict(usage) if isinstance(usage, Mapping) else {},
    )


def with_changes(generation: Generation, **changes: Any) -> Generation:
    """A copy with ``changes``; a problem voids all three arrays, so none is half-trusted."""
    if "ids_problem" in changes:
        changes.update(
            prompt_token_ids=None,
            generation_token_ids=None,
            generation_log_probs=None,
            prompt_packed=None,
            routed_experts=None,
        )
    return replace(generation, **changes)


def logprob_problem(value: Any) -> str | None:
    """Why one log-prob value is not usable; float() alone would accept "-0.5" or NaN."""
    if value is None:
        return "is null: the engine had no log-prob for this step"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a JSON number"
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite:
        return f"is {value!r}, not finite"
    if value > 0:
        return f"is {value!r}; a log-probability is at most 0"
    return None


def bad_id(what: str, ids: list[Any], vocab_size: int | None) -> str | None:
    """Why a list of ids holds something that is no token (see ``checked_ids``)."""
    return checked_ids(what, ids, vocab_size)[1]


def checked_ids(
    what: str, ids: list[Any], vocab_size: int | None
) -> tuple[bytes | None, str | None]:
    """The ids packed little-endian uint32, or why one is no token; C-speed passes for the
    good case.

    Packing to unsigned 32-bit refuses anything negative or beyond any vocabulary, and the
    largest id is read off the packed buffer: 0.5 ms at 16k ids instead of 1.3 ms for a
    Python-level ``min`` and ``max``. The type count keeps booleans out (they would pack).
    The packed bytes are the codec's own form of the ids (``capture.codec.packed``).
    """
    if list(map(type, ids)).count(int) == len(ids):
        try:
            packed = pack_ids(ids)
        except ValueError:
            pass  # negative or 2**32 and beyond: the loop below names it
        else:
            largest = int(numpy.frombuffer(packed, dtype="<u4").max()) if ids else -1
            if vocab_size is None or largest < vocab_size:
                return packed, None
    for position, token_id in enumerate(ids):
        if type(token_id) is not int or token_id < 0:
            return None, f"{what} id {position} is {token_id!r}, not an integer >= 0"
        if vocab_size is not None and token_id >= vocab_size:
            return None, (
                f"{what} id {position} is {token_id}, not below the vocabulary size "
                f"{vocab_size} (model_server.vocab_size)"
            )
        if token_id >= 2**32:
            return None, f"{what} id {position} is {token_id}, beyond any vocabulary (2**32)"
    return None, f"{what} ids could not be packed"  # not reached: the loop names the id


def count_problem(what: str, count: int, usage: Mapping[str, Any], key: str) -> str | None:
    """The engine's own count disagrees with the ids it returned: they were cut or shifted."""
    reported = usage.get(key)
    if reported is None:
        return None  # this engine does not report usage
    if type(reported) is not int:
        return f"usage.{key} is {reported!r}, not an integer"
    if reported != count:
        return (
            f"the engine returned {count} {what} ids but counted usage.{key}={reported}; "
            "the ids are not the sequence it processed"
        )
    return None


def prompt_check(
    ids: Any, usage: Mapping[str, Any], vocab_size: int | None = None, *, missing: str = ""
) -> tuple[bytes | None, str | None]:
    """The prompt ids packed when they can be trusted, else why not; ``missing`` says what
    an absent list means."""
    if ids is None:
        return None, missing or "the engine returned no prompt ids"
    if not isinstance(ids, list):
        return None, "the prompt ids are not a list"
    if not ids:
        return None, "the prompt ids are empty; a rendered chat prompt has tokens"
    packed, problem = checked_ids("prompt", ids, vocab_size)
    problem = problem or count_problem("prompt", len(ids), usage, "prompt_tokens")
    return (packed, None) if problem is None else (None, problem)


def sent_prompt_check(ids: list[int], usage: Mapping[str, Any]) -> tuple[bytes | None, str | None]:
    """The prompt of a token-in call packed when it can be trusted, else why not.

    The front end built these ids itself, so only the engine's own count of them is read;
    a vocabulary other than the engine's is refused once, at start-up (``api.engine.probe``).
    """
    if not ids:
        return None, "the prompt ids are empty; a rendered chat prompt has tokens"
    problem = count_problem("prompt", len(ids), usage, "prompt_tokens")
    if problem is not None:
        return None, problem
    try:
        return pack_ids(ids), None
    except (ValueError, TypeError) as exc:  # an id beyond uint32, or not an integer
        return None, f"the prompt ids sent do not pack: {exc}"


def served(generation: Generation) -> str:
    """What the harness is shown of a generation, named for a message ('' for nothing)."""
    shown = [
        name
        for name, present in (
            ("text", generation.text),
            ("reasoning", generation.reasoning),
            ("a tool call", generation.tool_calls),
        )
        if present
    ]
    return " and ".join(shown)


def generation_problem(generation: Generation, vocab_size: int | None) -> str | None:
    """Generated ids in the vocabulary, present for what was served, and as many as counted."""
    ids = generation.generation_token_ids or []
    problem = bad_id("generated", ids, vocab_size)
    if problem is None and not ids and served(generation):
        problem = (
            f"the engine returned no generated ids but served {served(generation)}; "
            "what the harness was told has no tokens to train on"
        )
    return problem or count_problem("generated", len(ids), generation.usage, "completion_tokens")


def first_choice(response: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The only choice and its message; without them nothing can be served (502)."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError(502, "upstream answered without a choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise UpstreamError(502, "upstream choice has no message")
    return choice, message


def finish(generation: Generation, problem: str | None, vocab_size: int | None) -> Generation:
    """The generation after the shared generated-id checks, voided on the first problem."""
    problem = problem or generation_problem(generation, vocab_size)
    return generation if problem is None else with_changes(generation, ids_problem=problem)
