"""The records of the capture contract: one entry per call, one snapshot per frozen rollout.

An entry holds the exact ids the policy saw and sampled for one call. Unknown extra fields are
kept, so a newer writer's additions survive a round trip through an older store. A reader
refuses a record from a newer schema instead of guessing at it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from capture.errors import SchemaVersionError
from capture.routes import Routes, as_routes

SCHEMA_VERSION = 1

# Fields an entry may carry beside the contract's: the request's traits (``capture.traits``).
TRAITS_FIELD = "request_traits"
# A call its engine cut and the front end continued: each part's generated ids [start,
# stop) and the policy version that sampled them, as ``[[start, stop, version], ...]``.
VERSION_SPANS_FIELD = "policy_version_spans"
# The puts of its rollout acknowledged to the storing process before this one (capture.acked).
ACKED_BEFORE_FIELD = "acked_before"
# The three arrays a token-bearing item carries in a served response.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class TokenEntry(BaseModel):
    """The stored record of one call's tokens."""

    model_config = ConfigDict(extra="allow", frozen=False, arbitrary_types_allowed=True)

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    # MoE routes, one row per position the model read (``capture.routes.Routes``; opt-in).
    # Anything else a sink is handed (the contract's "any": a Gym server's own form) is kept
    # as it came, stored and delivered whole.
    routed_experts: Any | None = None
    # The policy version the call ran under: the engine's report, else the version the
    # trainer had set at the front end when the call was dispatched (None: neither).
    policy_version: str | None = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    created_at: float = Field(default_factory=time.time)

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"entry has schema_version {value}, but this tokcap reads up to "
                f"schema_version {SCHEMA_VERSION}; upgrade tokcap to read it"
            )
        if value < 1:
            raise ValueError(f"schema_version must be >= 1, got {value}")
        return value

    @field_validator("model_call_id")
    @classmethod
    def _call_id_present(cls, value: str) -> str:
        if not value:
            raise ValueError("model_call_id must not be empty")
        return value

    @field_serializer("prompt_token_ids", "generation_token_ids")
    def _ids_as_list(self, value: Any) -> list[int]:
        # A decoded entry's ids may be read-only views of its chain's shared sequence
        # (capture.codec.views), a captured prompt packed ids (capture.codec.packed); a
        # dump always gives lists, as it did before.
        return value.tolist() if hasattr(value, "tolist") else list(value)

    @field_validator("routed_experts", mode="before")
    @classmethod
    def _routes(cls, value: Any) -> Any:
        """Routes from their wire object (a record read back); anything else as it came."""
        routes = as_routes(value)
        return routes if routes is not None else value

    @field_serializer("routed_experts")
    def _routes_as_wire(self, value: Any) -> Any:
        return value.wire() if isinstance(value, Routes) else value

    @model_validator(mode="after")
    def _consistent(self) -> TokenEntry:
        if len(self.generation_log_probs) != len(self.generation_token_ids):
            raise ValueError(
                f"generation_log_probs has {len(self.generation_log_probs)} values but "
                f"generation_token_ids has {len(self.generation_token_ids)}; they must match"
            )
        index = self.token_item_index
        if index is not None and not 0 <= index < len(self.output_items):
            raise ValueError(
                f"token_item_index {index} is outside output_items "
                f"(which has {len(self.output_items)} items)"
            )
        return self

    @classmethod
    def coerce(cls, record: Any) -> TokenEntry:
        """Accept a TokenEntry, any object with its fields, or a mapping.

        NeMo Gym's own entry objects are read through ``model_dump()`` or by attribute, so a
        sink written against Gym's interfaces can be handed ours and the other way round.
        """
        if isinstance(record, cls):
            return record
        if isinstance(record, Mapping):
            return cls.model_validate(dict(record))
        dump = getattr(record, "model_dump", None)
        if callable(dump):
            return cls.model_validate(dump())
        fields = {name: getattr(record, name) for name in cls.model_fields if hasattr(record, name)}
        extra = getattr(record, "__dict__", {})
        return cls.model_validate({**extra, **fields})

    @property
    def generated(self) -> int:
        """How many tokens this call sampled."""
        return len(self.generation_token_ids)

    @property
    def full_sequence(self) -> list[int]:
        """Prompt followed by generation: what a child call's prompt extends."""
        return [*self.prompt_token_ids, *self.generation_token_ids]


@dataclass(frozen=True)
class TokenCaptureSnapshot:
    """One atomic view of a frozen rollout; ``(snapshot_id, version)`` names it for drop."""

    rollout_id: str
    entries: tuple[TokenEntry, ...] = ()
    incomplete: bool = False
    snapshot_id: str = ""
    version: int = 0
    # Why the rollout is incomplete (lost calls, intents without entries); evidence only.
    incomplete_reasons: tuple[str, ...] = field(default=())
    # Calls whose reply the harness did not receive (it disconnected, or the front end
    # answered 503): the builder leaves such a call out unless a later call extends it.
    unreceived: tuple[str, ...] = field(default=())


def version_spans(entry: TokenEntry) -> list[tuple[int, int, str | None]]:
    """Each span of an entry's generated ids [start, stop) and the policy version that
    sampled it: the spans a continued call recorded, else one span of the whole call."""
    found = (entry.model_extra or {}).get(VERSION_SPANS_FIELD)
    if isinstance(found, list) and found:
        return [(int(start), int(stop), None if v is None else str(v)) for start, stop, v in found]
    return [(0, len(entry.generation_token_ids), entry.policy_version)]
