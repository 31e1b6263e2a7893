"""A process-wide sink and source, for processes that embed tokcap in their own server.

The front end builds its own sink from its config and never reads this registry, except as
a fallback when its config names no store: a process that embeds the front end (or a model
server of its own that calls ``capture_tokens``) installs its sink here; a trainer may
install the source it reads through. Installing checks the structural protocol, so a wrong
object fails at startup rather than on the first call.
"""

from __future__ import annotations

from typing import Any

from capture.errors import ConfigError
from capture.protocols import SINK_METHODS, SOURCE_METHODS, missing_methods

_installed: dict[str, Any] = {"sink": None, "source": None}


def _install(kind: str, obj: Any, methods: tuple[str, ...]) -> Any:
    if obj is not None:
        missing = missing_methods(obj, methods)
        if missing:
            raise ConfigError(
                f"{type(obj).__name__} cannot be installed as the token {kind}: "
                f"it has no callable {', '.join(missing)}"
            )
    previous = _installed[kind]
    _installed[kind] = obj
    return previous


def install_token_sink(sink: Any) -> Any:
    """Install the process-wide sink (None uninstalls); returns the previous one."""
    return _install("sink", sink, SINK_METHODS)


def install_token_source(source: Any) -> Any:
    """Install the process-wide source (None uninstalls); returns the previous one."""
    return _install("source", source, SOURCE_METHODS)


def installed_token_sink() -> Any:
    return _installed["sink"]


def installed_token_source() -> Any:
    return _installed["source"]
