"""The engine-independent checks of the fail-closed rules, shared by every adapter.

Each adapter reads its own fields (which fields, which placeholders) and then calls these:

- the id counts equal ``usage.prompt_tokens`` and ``usage.completion_tokens`` when the engine
  reports them;
- each log-prob is a number, finite and <= 0;
- a reply that served text, reasoning or a tool call has generated ids;
- ids are integers >= 0, below the vocabulary size when it is configured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy
import orjson

from api.engine.generation import Generation, served, with_changes
from capture.codec.packed import PackedIds, pack_ids


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


# The exact types of a usable log-prob as JSON decodes it: a bool is neither, nor is None.
_NUMBERS = frozenset({float, int})
NUMPY_FROM = 64  # values; fewer are checked one by one, in less time than numpy's calls take


def usable_logprobs(values: list[Any], placeholder: float | None = None) -> list[float] | None:
    """The log-probs as floats when every one is usable, in a few C-speed passes (a reply of
    thousands of tokens cost a millisecond a call one value at a time); None when any one
    is not, for the caller's own loop to name it (``logprob_problem``). ``placeholder``: an
    engine's value for "no log-prob" (vLLM's -9999.0), refused like the rest."""
    if len(values) < NUMPY_FROM:  # numpy's calls cost more than a short loop
        if any(logprob_problem(value) is not None for value in values):
            return None
        if placeholder is not None and placeholder in values:
            return None
        return [float(value) for value in values]
    if not set(map(type, values)) <= _NUMBERS:
        return None
    try:
        array = numpy.asarray(values, dtype=numpy.float64)
    except OverflowError:  # an integer beyond any float
        return None
    if not (numpy.isfinite(array).all() and (array <= 0).all()):
        return None
    if placeholder is not None and (array == placeholder).any():
        return None
    return array.tolist()


def bad_id(what: str, ids: list[Any], vocab_size: int | None) -> str | None:
    """Why a list of ids holds something that is no token (see ``checked_ids``)."""
    return checked_ids(what, ids, vocab_size)[1]


def checked_ids(
    what: str, ids: list[Any] | PackedIds, vocab_size: int | None
) -> tuple[bytes | None, str | None]:
    """The ids packed little-endian uint32, or why one is no token; C-speed passes for the
    good case.

    Packing to unsigned 32-bit refuses anything that is not an integer, negative or beyond
    any vocabulary; a boolean packs too, so ``_no_booleans`` keeps them out. The largest id
    is read off the packed buffer: 0.5 ms at 16k ids less than a Python-level ``min`` and
    ``max``. The packed bytes are the codec's own form of the ids (``capture.codec.packed``).
    """
    try:
        packed: bytes | None = pack_ids(ids)
    except (TypeError, ValueError):
        packed = None  # not an integer, negative, or 2**32 and beyond: the loop below names it
    # Ids read packed off a reply's bytes (``api.engine.reply_ids``) hold no boolean.
    if packed is not None and (isinstance(ids, PackedIds) or _no_booleans(ids)):
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


def _no_booleans(ids: list[Any]) -> bool:
    """Whether ids that packed as uint32 hold no boolean, in half the time of a type per id:
    orjson writes an integer as digits alone and a boolean as ``true`` or ``false``, both
    with an ``e`` (anything else it cannot write, such as a numpy integer, fails closed)."""
    try:
        return b"e" not in orjson.dumps(ids)
    except TypeError:
        return False


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
    if not isinstance(ids, (list, PackedIds)):
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


def finish(generation: Generation, problem: str | None, vocab_size: int | None) -> Generation:
    """The generation after the shared generated-id checks, voided on the first problem."""
    problem = problem or generation_problem(generation, vocab_size)
    return generation if problem is None else with_changes(generation, ids_problem=problem)
