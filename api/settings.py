"""Settings of the model-server front end, read from a Gym-style YAML and the environment.

The document's ``model_server`` block holds this server's own keys (upstream URL, the model
name sent upstream, sampling overrides, the body limit); its ``token_id_capture`` block is
read by ``capture.config``. ``ServerSettings`` is that block's one model: the YAML, the
``TOKCAP_*`` environment overrides (so one YAML serves many hosts) and a test's keywords are
all validated by it, once; an unknown key is a startup error, like a typo in the capture block.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from api.engine import engine_family
from capture.config import TokenIdCaptureConfig, find_capture_block, load_document
from capture.context import DEFAULT_CAPTURE_TIMEOUT_S
from capture.errors import ConfigError
from capture.protocols import TokenSink

SERVER_KEY = "model_server"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Request bytes in flight per process; parsed, each body byte costs several bytes of memory.
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024 * 1024
# How long a body waits for room among the bodies in flight before a 503: well inside the
# SDKs' 600 s request timeout, and long enough for a burst of large bodies to drain.
DEFAULT_BODY_WAIT_S = 120.0
# A streamed call not done by then opens its stream and sends a keep-alive this often: well
# inside the shortest idle limit a harness sets (the Claude Code CLI's byte idle watchdog
# goes down to 10 s), and often enough that a load balancer's idle timeout never fires.
DEFAULT_KEEPALIVE_S = 5.0
# Connections to the engine open at once, per worker; 0: no limit, so every call the
# harnesses send reaches the engine's own queue (the engine admits them, not tokcap).
DEFAULT_UPSTREAM_CONNECTIONS = 0
ENV_CONFIG = "TOKCAP_CONFIG"
# Environment overrides: variable -> the key it sets in the block (a nested key: two names).
ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "TOKCAP_UPSTREAM": ("upstream",),
    "TOKCAP_ENGINES_FILE": ("engines_file",),
    "TOKCAP_MODEL": ("model",),
    "TOKCAP_MAX_BODY_BYTES": ("max_body_bytes",),
    "TOKCAP_MAX_INFLIGHT_BYTES": ("max_inflight_bytes",),
    "TOKCAP_BODY_WAIT_S": ("body_wait_s",),
    "TOKCAP_ENGINE": ("engine",),
    "TOKCAP_UPSTREAM_API_KEY": ("upstream_api_key",),
    "TOKCAP_PROMPTS": ("prompts",),
    "TOKCAP_AUTH_SECRET": ("auth_secret",),
    "TOKCAP_DOCS": ("docs",),
    "TOKCAP_KEEPALIVE_S": ("keepalive_s",),
    "TOKCAP_UPSTREAM_CONNECTIONS": ("upstream_connections",),
    "TOKCAP_ROUTED_EXPERTS": ("routed_experts",),
    "TOKCAP_RESUME_CUT_CALLS": ("resume_cut_calls",),
    "TOKCAP_RENDERER": ("renderer", "name"),
    "TOKCAP_RENDERER_TOKENIZER": ("renderer", "tokenizer"),
}


class InvalidSettings(ConfigError):
    """A ``model_server`` block that does not validate: each problem as ``key: why`` (or the
    variable that set the key), never the value, which may be a secret."""

    def __init__(
        self, problems: list[tuple[tuple[Any, ...], str]], names: Mapping[Any, str] | None = None
    ) -> None:
        self.problems = problems
        named = names or {}
        found = [
            f"{named.get(loc) or '.'.join([SERVER_KEY, *map(str, loc)])}: {why}"
            for loc, why in problems
        ]
        super().__init__(f"invalid model server config: {'; '.join(found)}")

    @classmethod
    def of(cls, exc: ValidationError) -> InvalidSettings:
        return cls([(e["loc"], e["msg"].removeprefix("Value error, ")) for e in exc.errors()])


class RendererSettings(BaseModel):
    """``model_server.renderer``: what faithful prompts are rendered with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "qwen3"  # a renderer of the ``renderers`` package
    tokenizer: str | None = None  # qwen3, or a local tokenizer file or directory
    thinking_retention: Literal["all", "tool_cycle", "template"] = "all"


class MoeSettings(BaseModel):
    """``model_server.moe``: the policy's MoE shape, where the routes are checked against it.

    SGLang sends routes as one flat list, so ``layers`` and ``top_k`` are what shape them
    there; vLLM's carry their shape, which must then agree. ``experts`` bounds each index."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(gt=0)
    top_k: int = Field(gt=0)
    experts: int | None = Field(default=None, gt=0)


class EngineSettings(BaseModel):
    """One engine of a pool given as a mapping: its URL, and its own key where engines'
    keys differ (else ``upstream_api_key``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=1)
    api_key: str | None = Field(default=None, repr=False)


def engine_list(value: Any) -> list[EngineSettings]:
    """``upstream`` or an engines file's list as engines: a URL, a comma-separated list of
    them (how ``TOKCAP_UPSTREAM`` names a pool), or a list of URLs and mappings."""
    if isinstance(value, str):
        value = [url.strip() for url in value.split(",") if url.strip()]
    if not isinstance(value, list) or not value:
        raise ValueError("must name at least one engine: a URL or a list of them")
    engines = [EngineSettings(url=item) if isinstance(item, str) else item for item in value]
    engines = [EngineSettings.model_validate(item) for item in engines]
    urls = [engine.url.rstrip("/") for engine in engines]
    if len(set(urls)) != len(urls):
        raise ValueError("names one engine twice")
    return engines


class ServerSettings(BaseModel):
    """The ``model_server`` block, validated once: what ``create_app``, ``tokcap serve`` and
    the probe read. The capture settings come from the ``token_id_capture`` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The engine's URL (tokcap engine's default port), or a pool of engines: a list of URLs
    # (or ``{url, api_key}`` mappings), or URLs separated by commas (``api.engine.pool``).
    upstream: str | list[str | EngineSettings] = "http://127.0.0.1:8001"
    # A file naming the pool as ``upstream`` does (a YAML list, or one URL per line),
    # re-read when it changes, so engines join and leave while the front end runs; it wins
    # over ``upstream`` while it exists and names an engine.
    engines_file: str | None = None
    # Model name sent upstream; None asks the upstream's /v1/models once.
    model: str | None = None
    sampling_overrides: dict[str, Any] = Field(default_factory=dict)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    # Bodies being read and parsed at once, per worker; a body that does not fit waits its
    # turn (unread) for up to body_wait_s, then 503 (retry). At least max_body_bytes.
    max_inflight_bytes: int = Field(default=DEFAULT_MAX_INFLIGHT_BYTES, gt=0)
    body_wait_s: float = Field(default=DEFAULT_BODY_WAIT_S, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)  # a body not in by then is cut (408)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    # Connections to the engine per worker (0: no limit; see DEFAULT_UPSTREAM_CONNECTIONS).
    upstream_connections: int = Field(default=DEFAULT_UPSTREAM_CONNECTIONS, ge=0)
    # A streamed call not done by then opens its stream and is kept alive this often.
    keepalive_s: float = Field(default=DEFAULT_KEEPALIVE_S, gt=0)
    # The model's vocabulary size; when set, an upstream id at or beyond it is not captured.
    vocab_size: int | None = Field(default=None, gt=0)
    # How long a call waits for its entry, or its loss, to become durable before the
    # harness is answered 503 instead of the reply.
    capture_timeout_s: float = Field(default=DEFAULT_CAPTURE_TIMEOUT_S, gt=0)
    # The engine family whose wire format the upstream speaks; auto asks it at the first call.
    engine: str = "auto"
    # Sent as Authorization: Bearer to the upstream; never shown (not even in this repr).
    upstream_api_key: str | None = Field(default=None, repr=False)
    # text: the engine renders the harness's messages; faithful: the front end renders
    # them with ``renderer`` and calls the engine token-in.
    prompts: Literal["text", "faithful"] = "text"
    renderer: RendererSettings = Field(default_factory=RendererSettings)
    # When set, every path but the probes (/, /v1, /health, /ready, /metrics) needs a key:
    # this secret, or on a rollout's own paths that rollout's token (``capture.rollout_token``).
    # Never shown, like upstream_api_key.
    auth_secret: str | None = Field(default=None, repr=False)
    # Capture each call's MoE routed experts with its ids (the engine must be started with
    # --enable-return-routed-experts); a call answered without usable routes is lost.
    routed_experts: bool = False
    moe: MoeSettings | None = None
    # Continue a call its engine cut for a weight update (faithful prompts; ``api.call.
    # resume``); off, such a call fails with the dialect's retryable error instead.
    resume_cut_calls: bool = True
    # Serve /docs, /redoc and /openapi.json; off by default, the schema is no one's business.
    docs: bool = False
    capture: TokenIdCaptureConfig = Field(default_factory=TokenIdCaptureConfig)

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise InvalidSettings.of(exc) from None

    @field_validator("upstream")
    @classmethod
    def _engines_named(cls, upstream: Any) -> Any:
        engine_list(upstream)
        return upstream

    @property
    def engines(self) -> list[EngineSettings]:
        """The engines ``upstream`` names, each with its key."""
        return [
            engine
            if engine.api_key
            else engine.model_copy(update={"api_key": self.upstream_api_key})
            for engine in engine_list(self.upstream)
        ]

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        return engine_family(engine)

    @field_validator("auth_secret")
    @classmethod
    def _long_secret(cls, secret: str | None) -> str | None:
        if secret is not None and len(secret) < 16:
            raise ValueError(
                "must be at least 16 characters (a rollout token is only as hard to forge "
                "as the secret is to guess); leave it unset for no keys"
            )
        return secret

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.prompts == "faithful" and not self.renderer.tokenizer:
            raise ValueError(
                "prompts: faithful needs model_server.renderer.tokenizer "
                "(qwen3, or a local tokenizer file or directory)"
            )
        if self.moe is not None and not self.routed_experts:
            raise ValueError("moe describes the routes; set routed_experts: true to capture them")
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}), or no body of the largest size fits"
            )
        return self

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
        if "capture" in block:
            raise ConfigError(f"{SERVER_KEY}.capture: token capture is set in token_id_capture")
        where, capture_block = find_capture_block(document)
        capture = TokenIdCaptureConfig.from_block(capture_block, where or "token_id_capture")
        return cls._validated({str(k): v for k, v in block.items()}, capture, environ)

    def with_environment(self, environ: Mapping[str, str]) -> ServerSettings:
        """A copy with the TOKCAP_* environment overrides applied, validated again."""
        fields = self.model_dump(exclude={"capture"}, exclude_defaults=True)
        return ServerSettings._validated(fields, self.capture, environ)

    @classmethod
    def _validated(
        cls, block: dict[str, Any], capture: TokenIdCaptureConfig, environ: Mapping[str, str] | None
    ) -> ServerSettings:
        """The block with the environment's overrides, validated once; an error names the
        variable that set a bad value."""
        environ = os.environ if environ is None else environ
        names = {path: var for var, path in ENV_OVERRIDES.items() if environ.get(var)}
        try:
            return cls(**_with_environment(block, environ), capture=capture)
        except InvalidSettings as exc:
            raise InvalidSettings(exc.problems, names) from None


def _with_environment(block: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The block with each set TOKCAP_* variable's value in its key (validated with it)."""
    for variable, path in ENV_OVERRIDES.items():
        value = environ.get(variable)
        if not value:
            continue
        if len(path) == 1:
            block[path[0]] = value
        else:
            nested = block.get(path[0])
            block[path[0]] = {**(nested if isinstance(nested, Mapping) else {}), path[1]: value}
    return block


def settings_from_environment(environ: Mapping[str, str] | None = None) -> ServerSettings:
    """What a uvicorn worker builds: the file named by TOKCAP_CONFIG (if any) plus overrides."""
    environ = os.environ if environ is None else environ
    path = environ.get(ENV_CONFIG)
    if path:
        return ServerSettings.from_document(path, environ)
    return ServerSettings().with_environment(environ)
