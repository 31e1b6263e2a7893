"""Extraction of the token arrays from a served response (Responses and Chat shapes)."""

from __future__ import annotations

import copy

import pytest

from capture.errors import ExtractionError, MissingTokenIdsError
from capture.extract import entry_from_response, split_token_arrays

TOKENS = {
    "prompt_token_ids": [10, 11, 12],
    "generation_token_ids": [13, 14],
    "generation_log_probs": [-0.25, -0.125],
}


def responses_shaped(**carrier_extra):
    return {
        "id": "resp_1",
        "model": "served-policy",
        "output": [
            {"type": "reasoning", "summary": []},
            {
                "type": "function_call",
                "call_id": "fc_1",
                "name": "bash",
                "arguments": '{"cmd": "ls"}',
                **TOKENS,
                **carrier_extra,
            },
        ],
    }


def chat_shaped():
    return {
        "id": "chatcmpl-1",
        "model": "served-policy",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "done", **TOKENS},
            }
        ],
    }


def test_responses_shape():
    response = responses_shaped()
    original = copy.deepcopy(response)
    entry = entry_from_response(response, rollout_id="3-1", model_call_id="call-a")
    assert entry.rollout_id == "3-1" and entry.model_call_id == "call-a"
    assert entry.model == "served-policy"
    assert entry.prompt_token_ids == [10, 11, 12]
    assert entry.generation_token_ids == [13, 14]
    assert entry.generation_log_probs == [-0.25, -0.125]
    assert entry.token_item_index == 1
    assert entry.output_items[1]["name"] == "bash"
    assert response == original, "the served response must not be modified"


def test_arrays_stripped_from_kept_items():
    entry = entry_from_response(responses_shaped(), rollout_id="r", model_call_id="c")
    for item in entry.output_items:
        assert not set(TOKENS) & set(item)
    assert entry.output_items[0] == {"type": "reasoning", "summary": []}


def test_chat_shape():
    entry = entry_from_response(chat_shaped(), rollout_id="r", model_call_id="c", model="m")
    assert entry.model == "m"
    assert entry.token_item_index == 0
    assert entry.output_items == [{"role": "assistant", "content": "done"}]
    assert entry.generation_token_ids == [13, 14]


def test_split_returns_items_index_and_arrays():
    items, index, arrays = split_token_arrays(chat_shaped())
    assert index == 0
    assert arrays == TOKENS
    assert "prompt_token_ids" not in items[0]


def test_two_carriers_is_an_error():
    response = responses_shaped()
    response["output"][0].update(TOKENS)
    with pytest.raises(ExtractionError, match=r"on 2 items \(\[0, 1\]\)") as raised:
        entry_from_response(response, rollout_id="r", model_call_id="c")
    assert not isinstance(raised.value, MissingTokenIdsError)


def test_two_chat_choices_with_ids_is_an_error():
    response = chat_shaped()
    response["choices"].append(copy.deepcopy(response["choices"][0]))
    with pytest.raises(ExtractionError, match="expected one"):
        entry_from_response(response, rollout_id="r", model_call_id="c")


def test_partial_metadata_names_missing_arrays():
    response = responses_shaped()
    del response["output"][1]["generation_log_probs"]
    del response["output"][1]["prompt_token_ids"]
    with pytest.raises(ExtractionError) as raised:
        entry_from_response(response, rollout_id="r", model_call_id="c")
    message = str(raised.value)
    assert "output item 1" in message
    assert "but not generation_log_probs, prompt_token_ids" in message
    assert not isinstance(raised.value, MissingTokenIdsError)


def test_null_array_counts_as_missing():
    response = chat_shaped()
    response["choices"][0]["message"]["generation_log_probs"] = None
    with pytest.raises(ExtractionError, match="but not generation_log_probs"):
        entry_from_response(response, rollout_id="r", model_call_id="c")


@pytest.mark.parametrize(
    "response",
    [
        {"output": [{"type": "message", "content": []}]},
        {"output": []},
        {"choices": [{"message": {"role": "assistant", "content": "x"}}]},
        {"choices": [{"finish_reason": "stop"}]},
    ],
)
def test_no_ids_is_missing_token_ids(response):
    with pytest.raises(MissingTokenIdsError):
        entry_from_response(response, rollout_id="r", model_call_id="c")


def test_unrecognised_shape():
    with pytest.raises(ExtractionError, match="neither an 'output' list nor a 'choices' list"):
        entry_from_response({"content": []}, rollout_id="r", model_call_id="c")


def test_non_object_item():
    with pytest.raises(ExtractionError, match="output item 0 is not an object"):
        entry_from_response({"output": ["text"]}, rollout_id="r", model_call_id="c")


def test_inconsistent_lengths_are_an_extraction_error():
    response = responses_shaped()
    response["output"][1]["generation_log_probs"] = [-0.1]
    with pytest.raises(ExtractionError, match="inconsistent"):
        entry_from_response(response, rollout_id="r", model_call_id="c")


def test_routed_experts_moved_to_the_entry():
    experts = [[[1, 7], [2, 3]], [[0, 5], [4, 6]]]
    response = responses_shaped(routed_experts=experts)
    entry = entry_from_response(response, rollout_id="r", model_call_id="c")
    assert entry.routed_experts == experts
    assert "routed_experts" not in entry.output_items[1]
    assert response["output"][1]["routed_experts"] == experts


def test_extra_fields_kept():
    entry = entry_from_response(
        responses_shaped(), rollout_id="r", model_call_id="c", dialect="messages"
    )
    assert entry.model_extra == {"dialect": "messages"}
