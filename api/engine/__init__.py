"""The engine room: one neutral client, and an adapter per engine family.

An adapter (``api.engine.adapter.EngineAdapter``) builds the requests its engine
understands and reads the fields its engine returns (``vllm``, ``sglang``); the client
(``api.engine.client``) never guesses a field's place from another engine's format. The
family is named by ``model_server.engine``, or with ``auto`` detected from the engine's own
answers (``detect``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from api.engine.adapter import Ask, EngineAdapter
from api.engine.sglang import SGLang
from api.engine.vllm import VLLM
from capture.errors import ConfigError

FAMILIES: dict[str, Callable[[], EngineAdapter]] = {"vllm": VLLM, "sglang": SGLang}
ENGINES = ("auto", *FAMILIES)
# A route only that family serves, asked in this order when the models name no family:
# vLLM answers /version, SGLang has no such route but /get_server_info.
FAMILY_ROUTES = (("vllm", "/version"), ("sglang", "/get_server_info"))


def engine_family(engine: str) -> str:
    """``engine`` when it names a family this front end speaks (or ``auto``)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return engine


def family_of_models(models: list[Mapping[str, Any]]) -> str | None:
    """The family ``GET /v1/models`` names (``owned_by``), or None when it names none."""
    for card in models:
        owner = str(card.get("owned_by") or "").lower()
        if owner in FAMILIES:
            return owner
    return None


async def detect(models: list[Mapping[str, Any]], ask: Ask) -> str:
    """The family of an engine that answered: what its models name, else the first family
    whose own route it serves, else vLLM."""
    named = family_of_models(models)
    if named is not None:
        return named
    for family, path in FAMILY_ROUTES:
        status, _ = await ask(path)
        if status == 200:
            return family
    return "vllm"
