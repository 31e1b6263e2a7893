"""What ``tokcap serve`` checks before the server accepts traffic: the engine probe.

Wiring only: the settings name the engine and the prompt mode; the probe itself is the
engine room's (``api.engine.probe``).
"""

from __future__ import annotations

from api.engine.client import UpstreamClient
from api.engine.engines_file import named_engines
from api.engine.probe import EngineReport, probe_pool
from api.prompts.faithful import FaithfulPrompts, faithful_prompts
from api.settings import ServerSettings


async def probe(settings: ServerSettings, prompts: FaithfulPrompts | None = None) -> EngineReport:
    """Probe the engines ``settings`` names, each with its own short-lived client.
    ``prompts`` is the faithful prompt builder the caller already loaded, if any (else it
    is loaded here; a renderer that cannot load fails here)."""
    if prompts is None:
        prompts = faithful_prompts(settings)
    clients = [UpstreamClient.from_settings(settings, e) for e in named_engines(settings)]
    return await probe_pool(clients, prompts)
