"""Engines that join and leave while the front end runs: a watched file names the pool.

``model_server.engines_file`` names the pool as ``upstream`` does: a YAML list (of URLs or
``{url, api_key}`` mappings), or one URL per line. Every worker of every front end on a
host reads the same file, so all of them change together without a route each would have
to be sent, and an orchestrator writes it the way it writes any config (a Kubernetes
ConfigMap is a mounted file). Each worker looks at the file's modification time every
``WATCH_S``; a file that is missing, empty or does not parse leaves the pool as it is.

An engine that joins is probed first (``api.engine.probe``): one that does not agree with
the pool (family, model, context window) is not taken, and the log says why. An engine that
leaves is drained (``api.engine.pool``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from api.engine.client import UpstreamClient
from api.engine.pool import EnginePool
from api.engine.probe import EngineReport, odd_engine, probe_client
from api.settings import EngineSettings, ServerSettings, engine_list

log = logging.getLogger(__name__)

WATCH_S = 1.0


def read_engines(path: str | Path) -> list[EngineSettings] | None:
    """The engines the file names; None when it is missing, empty or does not parse."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    try:
        value: Any = yaml.safe_load(text)
        if isinstance(value, str):  # one URL per line reads as one string
            value = [line.strip() for line in text.splitlines() if line.strip()]
        return engine_list(value)
    except (yaml.YAMLError, ValueError) as exc:
        log.warning("engines file %s not read: %s", path, type(exc).__name__)
        return None


def named_engines(settings: ServerSettings) -> list[EngineSettings]:
    """The pool at start-up: the engines file's, while it names one, else ``upstream``'s."""
    named = read_engines(settings.engines_file) if settings.engines_file else None
    return named or settings.engines


def _stamp(path: str | Path) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


async def watch_engines(
    path: str | Path,
    apply: Callable[[list[EngineSettings]], Awaitable[None]],
    every_s: float = WATCH_S,
) -> None:
    """Apply the file's engines whenever it changes, until cancelled."""
    seen = _stamp(path)
    while True:
        await asyncio.sleep(every_s)
        stamp = _stamp(path)
        if stamp == seen:
            continue
        seen = stamp
        engines = read_engines(path)
        if engines is not None:
            try:
                await apply(engines)
            except Exception as exc:  # a failed change leaves the pool as it was
                log.warning("engines file %s not applied: %s", path, exc)


async def apply_engines(
    pool: EnginePool, settings: ServerSettings, prompts: Any, engines: list[EngineSettings]
) -> None:
    """Make ``pool`` the ``engines`` named: those already in it stay, a new one joins once
    its probe agrees with the pool's engines, the rest are drained."""
    clients = [UpstreamClient.from_settings(settings, engine) for engine in engines]
    known = {engine.url for engine in pool.engines if engine.state != "draining"}
    keep = {client.base_url for client in clients}
    joining: dict[str, UpstreamClient] = {}
    reference = await _reference(pool)
    for engine, client in zip(engines, clients, strict=True):
        if client.base_url in known:
            await client.close()
            continue
        try:
            report = await probe_client(UpstreamClient.from_settings(settings, engine), prompts)
        except Exception as exc:  # EngineRefused: it says what is wrong with the engine
            report, problem = None, str(exc)
        else:
            problem = odd_engine(reference, report) if reference is not None else None
        if problem is not None:
            log.warning("engine %s not taken into the pool: %s", client.where, problem)
            await client.close()
            continue
        joining[client.base_url] = client
    pool.change(keep & (known | set(joining)), joining)


async def _reference(pool: EnginePool) -> EngineReport | None:
    """What a joining engine must agree with: the pool's first live engine, as learned."""
    engine = next((e for e in pool.engines if e.state == "up"), None)
    if engine is None:
        return None
    client = engine.client
    await client.learn()
    return EngineReport(
        client.engine, client.where, client.max_model_len, model=client.served_model
    )
