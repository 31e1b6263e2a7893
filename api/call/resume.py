"""Calls that survive a weight update: a call the engine cut is continued, never ended.

An engine stops generating for a weight update (vLLM ``/pause?mode=abort``, SGLang
``/pause_generation``) by finishing every request in flight with ``abort``: a stop that is
not the model's choice (``api.engine.adapter.ENGINE_STOPS``). Passed on, the harness would
take the cut text for the policy's whole answer. Instead a cut call is continued token-in
from exactly where it stopped: the call's prompt ids plus the ids sampled so far, with
``max_tokens`` less what was sampled, on the same engine. The engine holds a request that
arrives while it is paused until it resumes, so the continuation is sent at once and
sampled on the new weights. The parts become one generation, checked as one: the ids and
log-probs in order, each part's span of generated ids with the version that sampled it.

Only a token-in call (faithful prompts) is continued: its reply is parsed from the ids, so
the stitched reply is exact (relayed, its stream goes on through the continuation: the parse
of every id so far, ``api.prompts.relay``). A text-mode call is not: the engine's reasoning
and tool-call parsers saw only the first part, and a relayed stream already showed the
harness that part's parse. Such a call, and one cut more than ``MAX_RESUMES`` times, fails
with the dialect's retryable error (``Cut``), so the harness resends it; nothing reached it
as an answer, so nothing is lost from the rollout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from api.engine.adapter import ENGINE_STOPS
from api.engine.checks import generation_problem
from api.engine.generation import Generation, UpstreamError, with_changes

# How many times one call may be cut and continued before it fails (each is an update).
MAX_RESUMES = 8
CUT_MESSAGE = (
    "the engine stopped this call before the model finished (a weight update's pause, "
    "finish_reason {reason!r}); it was not passed on as the model's answer: retry the request"
)

Span = tuple[int, int, str | None]
# A token-in call: prompt ids and sampling in, a checked generation out.
Complete = Callable[[list[int], Mapping[str, Any]], Awaitable[Generation]]
# The policy version in force now (refreshed from the store), for a continued part.
VersionNow = Callable[[], Awaitable[str | None]]


class Cut(UpstreamError):
    """A call the engine cut and that could not be continued: a retryable 503."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(503, CUT_MESSAGE.format(reason=reason))


def is_cut(generation: Generation) -> bool:
    """Whether the engine, not the model, ended this generation."""
    return generation.finish_reason in ENGINE_STOPS


def refuse_cut(generation: Generation) -> Generation:
    """A generation that cannot be continued is never a turn's end: ``Cut`` if it was cut."""
    if is_cut(generation):
        raise Cut(generation.finish_reason)
    return generation


async def continued(
    first: Generation,
    prompt_ids: list[int],
    sampling: Mapping[str, Any],
    complete: Complete,
    version_now: VersionNow,
) -> Generation:
    """``first``, continued token-in for as long as the engine cuts it, as one generation;
    ``Cut`` when it still ends cut (a part whose ids cannot be captured stops the
    continuing, and an ``abort`` is never served as the model's end)."""
    parts = [first]
    while is_cut(parts[-1]) and parts[-1].ids_problem is None:
        if len(parts) > MAX_RESUMES:
            raise Cut(parts[-1].finish_reason)
        sampled = [token for part in parts for token in part.generation_token_ids or []]
        params = dict(sampling)
        if isinstance(params.get("max_tokens"), int):
            params["max_tokens"] -= len(sampled)
            if params["max_tokens"] < 1:  # the budget is spent: the model's length stop
                parts[-1] = with_changes(parts[-1], finish_reason="length")
                break
        part = await complete(prompt_ids + sampled, params)
        version = part.policy_version or await version_now()
        parts.append(with_changes(part, policy_version=version))
    return refuse_cut(parts[0] if len(parts) == 1 else stitched(parts, prompt_ids))


def stitched(parts: list[Generation], prompt_ids: list[int]) -> Generation:
    """The parts of one call as one generation: the first part's prompt, every part's ids
    and log-probs in order, the last part's finish; checked as one generation."""
    first, last = parts[0], parts[-1]
    problem = next((part.ids_problem for part in parts if part.ids_problem), None)
    if problem is not None:
        return with_changes(first, ids_problem=f"a continued part: {problem}")
    ids: list[int] = []
    log_probs: list[float] = []
    spans: list[Span] = []
    for part in parts:
        generated = part.generation_token_ids or []
        if generated:  # a part cut before it sampled anything names no tokens
            spans.append((len(ids), len(ids) + len(generated), part.policy_version))
        ids += generated
        log_probs += part.generation_log_probs or []
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)}
    whole = with_changes(
        first,
        # The version of its first sampled token: a first part cut before it sampled
        # anything ran under nothing.
        policy_version=spans[0][2] if spans else first.policy_version,
        response=last.response,
        message={"role": "assistant", "content": "".join(part.text for part in parts)},
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        generation_token_ids=ids,
        generation_log_probs=log_probs,
        usage=usage,
        version_spans=tuple(spans),
        resumes=len(parts) - 1,
    )
    problem = generation_problem(whole, vocab_size=None)
    return whole if problem is None else with_changes(whole, ids_problem=problem)
