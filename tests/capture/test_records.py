"""TokenEntry: schema version, length and carrier checks, extras kept, coercion."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from capture.errors import SchemaVersionError
from capture.records import SCHEMA_VERSION, TokenCaptureSnapshot, TokenEntry


def entry_fields(**overrides):
    fields = {
        "rollout_id": "7-0",
        "model_call_id": "call-1",
        "model": "policy",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -1.25],
        "output_items": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
        "token_item_index": 0,
    }
    fields.update(overrides)
    return fields


def test_defaults():
    entry = TokenEntry(**entry_fields())
    assert entry.schema_version == SCHEMA_VERSION == 1
    assert entry.routed_experts is None
    assert entry.created_at > 0
    assert entry.generated == 2
    assert entry.full_sequence == [1, 2, 3, 4, 5]


def test_newer_schema_names_both_versions():
    with pytest.raises(SchemaVersionError) as raised:
        TokenEntry(**entry_fields(schema_version=SCHEMA_VERSION + 1))
    message = str(raised.value)
    assert f"schema_version {SCHEMA_VERSION + 1}" in message
    assert f"schema_version {SCHEMA_VERSION}" in message


def test_newer_schema_refused_on_read_too():
    stored = TokenEntry(**entry_fields()).model_dump()
    stored["schema_version"] = 9
    with pytest.raises(SchemaVersionError, match="9"):
        TokenEntry.model_validate(stored)


def test_schema_version_below_one_rejected():
    with pytest.raises(ValueError, match="schema_version must be >= 1"):
        TokenEntry(**entry_fields(schema_version=0))


def test_log_probs_length_must_match_generation():
    with pytest.raises(ValueError) as raised:
        TokenEntry(**entry_fields(generation_log_probs=[-0.5]))
    assert "generation_log_probs has 1 values" in str(raised.value)
    assert "generation_token_ids has 2" in str(raised.value)


def test_empty_generation_is_a_valid_entry():
    entry = TokenEntry(**entry_fields(generation_token_ids=[], generation_log_probs=[]))
    assert entry.generated == 0


@pytest.mark.parametrize("index", [1, -1, 5])
def test_carrier_index_outside_output_items(index):
    with pytest.raises(ValueError, match=f"token_item_index {index} is outside output_items"):
        TokenEntry(**entry_fields(token_item_index=index))


def test_carrier_index_needs_items():
    with pytest.raises(ValueError, match="outside output_items"):
        TokenEntry(**entry_fields(output_items=[], token_item_index=0))
    assert (
        TokenEntry(**entry_fields(output_items=[], token_item_index=None)).token_item_index is None
    )


def test_empty_call_id_rejected():
    with pytest.raises(ValueError, match="model_call_id must not be empty"):
        TokenEntry(**entry_fields(model_call_id=""))


def test_unknown_fields_kept_through_dump_and_validate():
    entry = TokenEntry(**entry_fields(harness="claude-code", usage={"input_tokens": 3}))
    dumped = entry.model_dump()
    assert dumped["harness"] == "claude-code"
    assert dumped["usage"] == {"input_tokens": 3}
    again = TokenEntry.model_validate(dumped)
    assert again == entry
    assert again.model_extra == {"harness": "claude-code", "usage": {"input_tokens": 3}}
    assert TokenEntry.model_validate_json(entry.model_dump_json()) == entry


def test_coerce_returns_an_entry_unchanged():
    entry = TokenEntry(**entry_fields())
    assert TokenEntry.coerce(entry) is entry


def test_coerce_from_mapping():
    entry = TokenEntry.coerce(entry_fields(extra_note="kept"))
    assert isinstance(entry, TokenEntry)
    assert entry.prompt_token_ids == [1, 2, 3]
    assert entry.model_extra == {"extra_note": "kept"}


class GymLikeEntry(BaseModel):
    """Another library's entry model with the same fields plus one of its own."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    model_call_id: str
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    gym_only: str = "from-gym"


def test_coerce_from_object_with_model_dump():
    other = GymLikeEntry(
        **{k: v for k, v in entry_fields().items() if k in GymLikeEntry.model_fields}
    )
    entry = TokenEntry.coerce(other)
    assert entry.model_call_id == "call-1"
    assert entry.generation_log_probs == [-0.5, -1.25]
    assert entry.model_extra == {"gym_only": "from-gym"}


class PlainEntry:
    """A plain object exposing the fields as attributes."""

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)


def test_coerce_from_plain_attribute_object():
    entry = TokenEntry.coerce(PlainEntry(**entry_fields(trace_id="t-9")))
    assert entry.rollout_id == "7-0"
    assert entry.output_items[0]["type"] == "message"
    assert entry.model_extra == {"trace_id": "t-9"}


def test_coerce_from_slotted_object_reads_attributes():
    class Slotted:
        __slots__ = (
            "rollout_id",
            "model_call_id",
            "prompt_token_ids",
            "generation_token_ids",
            "generation_log_probs",
        )

        def __init__(self):
            self.rollout_id = "r"
            self.model_call_id = "c"
            self.prompt_token_ids = [1]
            self.generation_token_ids = [2]
            self.generation_log_probs = [-0.1]

    entry = TokenEntry.coerce(Slotted())
    assert (entry.rollout_id, entry.generation_token_ids) == ("r", [2])


def test_coerce_still_validates():
    with pytest.raises(ValueError, match="must match"):
        TokenEntry.coerce(PlainEntry(**entry_fields(generation_log_probs=[])))
    with pytest.raises(SchemaVersionError):
        TokenEntry.coerce(entry_fields(schema_version=2))


def test_snapshot_defaults():
    snapshot = TokenCaptureSnapshot(rollout_id="r")
    assert snapshot.entries == () and snapshot.incomplete is False
    assert snapshot.snapshot_id == "" and snapshot.version == 0
