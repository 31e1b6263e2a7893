"""The ``token_id_capture`` config block: where it lives, what it may hold, what it builds.

The block sits at the top level of a Gym YAML document or under ``env.nemo_gym``. The whole
document is resolved with OmegaConf first, so ``${oc.env:VAR}`` and references to other keys
work. Unknown keys are rejected, so a typo is a startup error naming the key rather than a
setting silently ignored. Settings are validated even while ``enabled: false``, so turning
capture on never reveals an old mistake. Every problem found here is a ``ConfigError``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from capture.build.segments import Delivery
from capture.errors import ConfigError
from capture.protocols import SINK_METHODS, missing_methods

log = logging.getLogger("tokcap.config")

BLOCK_KEY = "token_id_capture"
AGENTS_KEY = "responses_api_agents"
# The places a block may live, most specific first; a document may use only one of them.
BLOCK_PLACES = (("env", "nemo_gym", BLOCK_KEY), (BLOCK_KEY,))
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_SINK_PATH = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")


class TokenIdCaptureConfig(BaseModel):
    """Settings of token id capture, as written in the ``token_id_capture`` block."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    dir: str | None = None
    all_agents: bool = False
    sink: str | None = None
    sink_kwargs: dict[str, Any] = Field(default_factory=dict)
    rebuild_response: bool = True
    max_mask_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    # chain: the main chain only; segments: every other chain too, under _ng_token_segments.
    delivery: Delivery = "chain"
    # A rollout that delivers a smaller share of what it sampled is masked (null: never).
    min_delivered_fraction: float | None = Field(default=None, ge=0.0, le=1.0)

    @field_validator("dir", "sink", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # `${oc.env:TOKCAP_DIR,""}` leaves an empty string where the operator meant "unset".
        return None if value == "" else value

    @field_validator("sink_kwargs", mode="before")
    @classmethod
    def _null_kwargs(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("dir")
    @classmethod
    def _absolute_dir(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(value):
            raise ValueError(
                f"dir {value!r} is relative; give an absolute path (a relative one would "
                "depend on each process's working directory)"
            )
        return value

    @field_validator("sink")
    @classmethod
    def _sink_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.count(":") != 1:
            raise ValueError(f"sink {value!r} must be 'module.path:ClassName' with one colon")
        module, _, attr = value.partition(":")
        if not module or not attr:
            part = "module path" if not module else "class name"
            raise ValueError(f"sink {value!r} has an empty {part}; use 'module.path:ClassName'")
        if not _SINK_PATH.match(value):
            raise ValueError(f"sink {value!r} is not a valid 'module.path:ClassName'")
        return value

    @model_validator(mode="after")
    def _store_named(self) -> TokenIdCaptureConfig:
        if self.enabled and self.rebuild_response and not (self.dir or self.sink):
            raise ValueError(
                "capture is enabled but neither 'dir' nor 'sink' is set; name where entries "
                "are stored, or set rebuild_response: false"
            )
        if self.sink and self.dir:
            log.warning(
                "token_id_capture sets both sink (%s) and dir (%s); the sink is used and dir "
                "is ignored",
                self.sink,
                self.dir,
            )
        return self

    @classmethod
    def from_block(cls, block: Any, where: str = BLOCK_KEY) -> TokenIdCaptureConfig:
        """Validate one block; every error names its key under ``where``."""
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {type(block).__name__}")
        try:
            return cls.model_validate(dict(block))
        except ValidationError as exc:
            raise ConfigError(_describe(exc, where, sorted(cls.model_fields))) from None

    def sink_class(self) -> Any:
        """The object ``sink`` names (a class or any factory), imported now."""
        if self.sink is None:
            raise ConfigError("token_id_capture.sink is not set")
        module_name, _, attr_path = self.sink.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f"sink {self.sink!r}: cannot import module {module_name!r}: {exc}"
            ) from exc
        for attr in attr_path.split("."):
            if not hasattr(target, attr):
                raise ConfigError(
                    f"sink {self.sink!r}: {getattr(target, '__name__', target)!r} has no "
                    f"attribute {attr!r}"
                )
            target = getattr(target, attr)
        if not callable(target):
            raise ConfigError(f"sink {self.sink!r} names a {type(target).__name__}, not a class")
        if isinstance(target, type):
            _check_sink(target, self.sink)
        return target

    def build_sink(self) -> Any:
        """The configured sink, or None while capture is off or no store is named.

        A ``sink`` is built from ``sink_kwargs`` and wins over ``dir``; a ``dir`` gives the
        node-local file store.
        """
        if not self.enabled:
            return None
        if self.sink:
            factory = self.sink_class()
            kwargs = dict(self.sink_kwargs)
            # Name the keys only: values often carry credentials (a Redis URL's password).
            names = ", ".join(sorted(kwargs)) or "none"
            try:
                sink = factory(**kwargs)
            except ConfigError:
                raise
            except TypeError as exc:
                raise ConfigError(
                    f"sink {self.sink!r} rejects sink_kwargs ({names}): {exc}"
                ) from exc
            except Exception as exc:
                raise ConfigError(
                    f"sink {self.sink!r} failed to start with sink_kwargs ({names}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            _check_sink(sink, self.sink)
            return sink
        if self.dir:
            from capture.filestore.store import (
                FileTokenStore,  # the file store loads only when used
            )

            return FileTokenStore(self.dir)
        return None


def _check_sink(obj: Any, path: str) -> None:
    missing = missing_methods(obj, SINK_METHODS)
    if missing:
        raise ConfigError(
            f"sink {path!r} is not a token sink: it has no callable {', '.join(missing)}"
        )


def _describe(exc: ValidationError, where: str, allowed: list[str]) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join([where, *(str(part) for part in error["loc"])])
        if error["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (allowed: {', '.join(allowed)})")
        else:
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {message}")
    return "invalid token id capture config:\n  " + "\n  ".join(lines)


def _looks_like_path(text: str) -> bool:
    # YAML text of a mapping has a colon or a newline; a one-line string without one is a path.
    if "\n" in text:
        return False
    return text.endswith((".yaml", ".yml")) or ":" not in text or os.path.isfile(text)


def _to_omegaconf(source: Any) -> Any:
    if isinstance(source, DictConfig):
        return source
    if isinstance(source, Mapping):
        return OmegaConf.create(dict(source), flags={"allow_objects": True})
    if isinstance(source, Path) or (isinstance(source, str) and _looks_like_path(source)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        return OmegaConf.load(path)
    if isinstance(source, str):
        return OmegaConf.create(source)
    raise ConfigError(f"cannot read a config from a {type(source).__name__}")


def load_document(source: Any) -> dict[str, Any]:
    """The whole document (a YAML path, YAML text, or mapping) as a resolved plain dict."""
    try:
        config = _to_omegaconf(source)
        document = OmegaConf.to_container(config, resolve=True)
    except ConfigError:
        raise
    except (OmegaConfBaseException, yaml.YAMLError, OSError, ValueError) as exc:
        raise ConfigError(f"cannot load config: {type(exc).__name__}: {exc}") from exc
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"a config document must be a mapping, got {type(document).__name__}")
    return document


def find_capture_block(document: Mapping[str, Any]) -> tuple[str, Any]:
    """(where, block) of the document's ``token_id_capture``; ("", None) when it has none."""
    found = []
    for place in BLOCK_PLACES:
        node: Any = document
        for key in place:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is not None:
            found.append((".".join(place), node))
    if len(found) > 1:
        raise ConfigError(
            f"token_id_capture is set both at {found[0][0]} and at {found[1][0]}; keep one"
        )
    return found[0] if found else ("", None)


def load_capture_config(source: Any) -> TokenIdCaptureConfig:
    """The capture config of a document; capture is off when the document has no block."""
    document = load_document(source)
    where, block = find_capture_block(document)
    return TokenIdCaptureConfig.from_block(block, where or BLOCK_KEY)


def _agent_flag(agent: Any, name: str) -> bool:
    if not isinstance(agent, Mapping):
        return False
    places = [(f"{AGENTS_KEY}.{name}", agent)]
    places += [
        (f"{AGENTS_KEY}.{name}.{key}", child)
        for key, child in agent.items()
        if isinstance(child, Mapping)
    ]
    for where, node in places:
        flag = node.get(BLOCK_KEY)
        if flag is None:
            continue
        if not isinstance(flag, bool):
            raise ConfigError(f"{where}.{BLOCK_KEY} must be true or false, got {flag!r}")
        if flag:
            return True
    return False


def agent_opted_in(document: Any, agent_name: str) -> bool:
    """Whether capture applies to ``agent_name``: enabled, and the agent or all_agents opts in."""
    document = load_document(document)
    config = load_capture_config(document)
    agents = document.get(AGENTS_KEY)
    agent = agents.get(agent_name) if isinstance(agents, Mapping) else None
    # The flag is read (and checked) even while capture is off, so a typo shows up now.
    flagged = _agent_flag(agent, agent_name)
    return config.enabled and (config.all_agents or flagged)
