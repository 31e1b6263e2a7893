"""Settings of the model-server front end, read from a Gym-style YAML and the environment.

The document's ``model_server`` block holds this server's own keys (upstream URL, the model
name sent upstream, sampling overrides, the body limit); its ``token_id_capture`` block is
read by ``capture.config``. Unknown keys in ``model_server`` are a startup error, like a typo
in the capture block. Environment variables override the file so one YAML serves many hosts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.engines import ENGINES
from capture.config import TokenIdCaptureConfig, find_capture_block, load_document
from capture.context import DEFAULT_CAPTURE_TIMEOUT_S
from capture.errors import ConfigError
from capture.protocols import TokenSink

SERVER_KEY = "model_server"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Request bytes in flight per process; parsed, each body byte costs several bytes of memory.
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024 * 1024
# A streamed call not done by then opens its stream and sends a keep-alive this often: well
# inside the shortest idle limit a harness sets (the Claude Code CLI's byte idle watchdog
# goes down to 10 s), and often enough that a load balancer's idle timeout never fires.
DEFAULT_KEEPALIVE_S = 5.0
# Connections to the engine open at once, per worker; 0: no limit, so every call the
# harnesses send reaches the engine's own queue (the engine admits them, not tokcap).
DEFAULT_UPSTREAM_CONNECTIONS = 0
# Environment overrides: variable -> settings field.
ENV_CONFIG = "TOKCAP_CONFIG"
ENV_OVERRIDES = {
    "TOKCAP_UPSTREAM": "upstream",
    "TOKCAP_MODEL": "model",
    "TOKCAP_MAX_BODY_BYTES": "max_body_bytes",
    "TOKCAP_MAX_INFLIGHT_BYTES": "max_inflight_bytes",
    "TOKCAP_ENGINE": "engine",
    "TOKCAP_UPSTREAM_API_KEY": "upstream_api_key",
    "TOKCAP_PROMPTS": "prompts",
    "TOKCAP_RENDERER": "renderer_name",
    "TOKCAP_RENDERER_TOKENIZER": "renderer_tokenizer",
    "TOKCAP_AUTH_SECRET": "auth_secret",
    "TOKCAP_DOCS": "docs",
    "TOKCAP_KEEPALIVE_S": "keepalive_s",
    "TOKCAP_UPSTREAM_CONNECTIONS": "upstream_connections",
}
PROMPT_MODES = ("text", "faithful")
INTEGER_SETTINGS = ("max_body_bytes", "max_inflight_bytes", "upstream_connections")
FLOAT_SETTINGS = ("keepalive_s",)
BOOLEAN_SETTINGS = ("docs",)
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class RendererBlock(BaseModel):
    """``model_server.renderer``: what faithful prompts are rendered with."""

    model_config = ConfigDict(extra="forbid")

    name: str = "qwen3"  # a renderer of the ``renderers`` package
    tokenizer: str | None = None  # qwen3, or a local tokenizer file or directory
    thinking_retention: Literal["all", "tool_cycle", "template"] = "all"


class ModelServerBlock(BaseModel):
    """The ``model_server`` block as written in the YAML."""

    model_config = ConfigDict(extra="forbid")

    upstream: str = "http://127.0.0.1:8001"  # tokcap engine's default port
    model: str | None = None
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    max_inflight_bytes: int = Field(default=DEFAULT_MAX_INFLIGHT_BYTES, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connections: int = Field(default=DEFAULT_UPSTREAM_CONNECTIONS, ge=0)
    keepalive_s: float = Field(default=DEFAULT_KEEPALIVE_S, gt=0)
    vocab_size: int | None = Field(default=None, gt=0)
    capture_timeout_s: float = Field(default=DEFAULT_CAPTURE_TIMEOUT_S, gt=0)
    engine: Literal["auto", "vllm", "sglang"] = "auto"
    upstream_api_key: str | None = Field(default=None, repr=False)
    prompts: Literal["text", "faithful"] = "text"
    renderer: RendererBlock = Field(default_factory=RendererBlock)
    auth_secret: str | None = Field(default=None, repr=False)
    docs: bool = False


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``create_app`` needs; the sink comes from the capture config."""

    upstream: str = "http://127.0.0.1:8001"  # tokcap engine's default port
    # Model name sent upstream; None asks the upstream's /v1/models once.
    model: str | None = None
    sampling_overrides: Mapping[str, Any] = field(default_factory=dict)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # 503 (retry) while the bodies in flight would exceed it; at least max_body_bytes.
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    body_timeout_s: float = 30.0  # a body not received by then is cut with a 408
    upstream_timeout_s: float = 600.0
    # Connections to the engine per worker (0: no limit; see DEFAULT_UPSTREAM_CONNECTIONS).
    upstream_connections: int = DEFAULT_UPSTREAM_CONNECTIONS
    # A streamed call not done by then opens its stream and is kept alive this often.
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    # The model's vocabulary size; when set, an upstream id at or beyond it is not captured.
    vocab_size: int | None = None
    # How long a call waits for its entry, or its loss, to become durable before the
    # harness is answered 503 instead of the reply.
    capture_timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S
    # The engine family whose wire format the upstream speaks; auto asks it at the first call.
    engine: str = "auto"
    # Sent as Authorization: Bearer to the upstream; never shown (not even in this repr).
    upstream_api_key: str | None = field(default=None, repr=False)
    # text: the engine renders the harness's messages; faithful: the front end renders
    # them with ``renderer_name`` on ``renderer_tokenizer`` and calls the engine token-in.
    prompts: str = "text"
    renderer_name: str = "qwen3"
    renderer_tokenizer: str | None = None
    thinking_retention: str = "all"
    # When set, every path but the probes (/, /v1, /health, /ready, /metrics) needs a key:
    # this secret, or on a rollout's own paths that rollout's token (``capture.rollout_token``).
    # Never shown, like upstream_api_key.
    auth_secret: str | None = field(default=None, repr=False)
    # Serve /docs, /redoc and /openapi.json; off by default, the schema is no one's business.
    docs: bool = False
    capture: TokenIdCaptureConfig = field(default_factory=TokenIdCaptureConfig)

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_MODES:
            raise ConfigError(
                f"model_server.prompts must be text or faithful, not {self.prompts!r}"
            )
        if self.prompts == "faithful" and not self.renderer_tokenizer:
            raise ConfigError(
                "model_server.prompts: faithful needs model_server.renderer.tokenizer "
                "(qwen3, or a local tokenizer file or directory)"
            )
        if self.engine not in ENGINES:
            raise ConfigError(
                f"model_server.engine must be one of {', '.join(ENGINES)}, not {self.engine!r}"
            )
        if self.auth_secret is not None and len(self.auth_secret) < 16:
            raise ConfigError(
                "model_server.auth_secret must be at least 16 characters (a rollout token is "
                "only as hard to forge as the secret is to guess); leave it unset for no keys"
            )
        if self.keepalive_s <= 0 or self.upstream_connections < 0:
            raise ConfigError(
                "model_server.keepalive_s must be > 0 and upstream_connections >= 0 (0: no limit)"
            )
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ConfigError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}), or no body of the largest size fits"
            )

    def build_sink(self) -> TokenSink | None:
        """A new sink for this worker, or None when capture is off or names no store."""
        return self.capture.build_sink()

    @classmethod
    def from_document(cls, source: Any, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from a YAML path, YAML text or mapping, then environment overrides."""
        document = load_document(source)
        block = document.get(SERVER_KEY) or {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"{SERVER_KEY} must be a mapping, got {type(block).__name__}")
        try:
            server = ModelServerBlock.model_validate(dict(block))
        except ValidationError as exc:
            problems = "; ".join(
                f"{SERVER_KEY}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                for e in exc.errors()
            )
            raise ConfigError(f"invalid model server config: {problems}") from None
        where, capture_block = find_capture_block(document)
        capture = TokenIdCaptureConfig.from_block(capture_block, where or "token_id_capture")
        fields = server.model_dump(exclude={"renderer"})
        fields.update(
            renderer_name=server.renderer.name,
            renderer_tokenizer=server.renderer.tokenizer,
            thinking_retention=server.renderer.thinking_retention,
        )
        settings = cls(capture=capture, **fields)
        return settings.with_environment(os.environ if environ is None else environ)

    def with_environment(self, environ: Mapping[str, str]) -> ServerSettings:
        """A copy with the TOKCAP_* environment overrides applied."""
        changes: dict[str, Any] = {}
        for variable, name in ENV_OVERRIDES.items():
            value = environ.get(variable)
            if not value:
                continue
            if name in INTEGER_SETTINGS:
                try:
                    changes[name] = int(value)
                except ValueError:
                    raise ConfigError(f"{variable} must be an integer, got {value!r}") from None
            elif name in FLOAT_SETTINGS:
                try:
                    changes[name] = float(value)
                except ValueError:
                    raise ConfigError(f"{variable} must be a number, got {value!r}") from None
            elif name in BOOLEAN_SETTINGS:
                if value.lower() not in TRUE_WORDS + FALSE_WORDS:
                    raise ConfigError(f"{variable} must be 1 or 0, got {value!r}")
                changes[name] = value.lower() in TRUE_WORDS
            else:
                changes[name] = value
        return replace(self, **changes) if changes else self


def settings_from_environment(environ: Mapping[str, str] | None = None) -> ServerSettings:
    """What a uvicorn worker builds: the file named by TOKCAP_CONFIG (if any) plus overrides."""
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_CONFIG)
    if path:
        return ServerSettings.from_document(path, environ)
    return ServerSettings().with_environment(environ)
