"""Engine adapters: how each engine family is asked for ids and how its reply is read.

An adapter builds the request its engine understands and reads the fields its engine
returns (``vllm``, ``sglang``); the front end never guesses a field's place from another
engine's format. ``detect`` names the family from the engine's own answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.engine import sglang, vllm
from capture.errors import ConfigError

ADAPTERS = {"vllm": vllm, "sglang": sglang}
ENGINES = ("auto", *ADAPTERS)


def engine_family(engine: str) -> str:
    """``engine`` when it names a family this front end speaks (or ``auto``)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return engine


def family_of_models(models: list[Mapping[str, Any]]) -> str | None:
    """The family ``GET /v1/models`` names (``owned_by``), or None when it names none."""
    for card in models:
        owner = str(card.get("owned_by") or "").lower()
        if owner in ADAPTERS:
            return owner
    return None
