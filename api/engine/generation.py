"""One upstream completion, as every engine adapter reads it.

Whatever engine answered, a call becomes a ``Generation``: the served message, the three id
arrays, and ``ids_problem`` when the ids cannot be captured (``api.engine.checks`` decides
that). An engine that gave no usable reply at all raises ``UpstreamError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from capture.codec.packed import PackedIds
from capture.codec.route_blocks import ChainedRoutes
from capture.routes import Routes


class UpstreamError(Exception):
    """The upstream returned no usable output; ``status`` is what the harness is told.
    ``engine_down``: the engine could not be reached or failed (5xx), rather than refusing
    this request; a pool takes such an engine out (``api.engine.pool``)."""

    def __init__(self, status: int, message: str, *, engine_down: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.engine_down = engine_down


@dataclass(frozen=True)
class Generation:
    """One upstream completion, reduced to what the capture and reply steps read."""

    response: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str | None
    stop_reason: Any
    # A list, or ``PackedIds`` where the reply's bytes were read packed (``reply_ids``).
    prompt_token_ids: list[int] | PackedIds | None
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
    # Faithful prompts hand the store them cut into blocks (``ChainedRoutes``).
    routed_experts: Routes | ChainedRoutes | None = None
    # The first position ``routed_experts`` covers: the engine was asked to leave out the
    # rows of a prefix the rollout stored already (``api.prompts.route_prefix``).
    routes_start: int = 0
    # The policy version the call ran under: the engine's report, else the trainer's at
    # dispatch (``api.call.policy``).
    policy_version: str | None = None
    # A call resumed after its engine cut it: each part's generated ids [start, stop) and
    # the version that sampled them (``api.call.resume``); empty for a call made in one go.
    version_spans: tuple[tuple[int, int, str | None], ...] = ()
    # How many times the engine cut this call and it was continued (``api.call.resume``).
    resumes: int = 0

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


_FIELDS = frozenset(item.name for item in fields(Generation))


def with_changes(generation: Generation, **changes: Any) -> Generation:
    """A copy with ``changes``; a problem voids all three arrays, so none is half-trusted.

    The copy takes the fields as they are and the changes over them, as ``replace`` would
    through ``__init__`` (a generation has no post-init step), in a fifth of its time: a
    call makes several."""
    if "ids_problem" in changes:
        changes.update(
            prompt_token_ids=None,
            generation_token_ids=None,
            generation_log_probs=None,
            prompt_packed=None,
            routed_experts=None,
        )
    unknown = changes.keys() - _FIELDS
    if unknown:
        raise TypeError(f"a Generation has no field {sorted(unknown)[0]!r}")
    copy = object.__new__(Generation)
    copy.__dict__.update(generation.__dict__)
    copy.__dict__.update(changes)
    return copy


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
