"""Training samples of a rebuilt record: one per delivered segment, ready for a loss.

For a trainer that does not walk output items itself: each sample is one contiguous
sequence (``input_ids``), its loss mask (1 where the policy sampled, 0 for context), the
sampled log-probs aligned with it (0.0 at context positions) and the role of the segment
it came from (``main`` for the chain in ``response.output``). A masked record has no
samples, nor has one never rebuilt, unless it carried its own token ids.

Where routes were captured, ``routed_experts`` has one row per position of ``input_ids``:
the routes the last call of the sample was served with (they cover every position it read;
the last position, which no call read, is zeros). Where an earlier call was routed
differently on the prefix they share (``routes_differing_calls`` in the metrics), no one row
per position is every call's: ``routed_experts`` is None, and each carrier item still holds
its own call's routes. ``.to_numpy()`` makes it a
``[len(input_ids), layers, top_k]`` array. Where calls carry policy versions,
``policy_versions`` names each sampled span and its version (a call continued after a weight
update has one span per part).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from capture.build.projection import carriers, flat_sequence
from capture.build.segments import SEGMENTS_KEY
from capture.delivery import MASK_KEY, METRICS_KEY, carries_token_ids
from capture.records import VERSION_SPANS_FIELD
from capture.routes import Routes, as_routes, routes_differ

MAIN_ROLE = "main"


@dataclass(frozen=True)
class TrainingSample:
    role: str
    input_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    n_calls: int
    routed_experts: Routes | None = None
    # Generated positions [start, stop) and the policy version that sampled them: a span per
    # call, or per part of a call continued across a weight update.
    policy_versions: list[tuple[int, int, str | None]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(replace(self, routed_experts=None)), "routed_experts": self.routed_experts}


def sample_of(items: Iterable[Any], role: str) -> TrainingSample:
    """One contiguous sample from token-bearing items; ValueError when they are not one
    sequence (a carrier's prompt does not extend everything before it)."""
    items = list(items)
    try:
        ids, mask, log_probs, calls = flat_sequence(items)
    except ValueError as exc:
        raise ValueError(f"{role}: {exc}") from None
    found = carriers(items)
    routes = sample_routes(found, len(ids))
    return TrainingSample(role, ids, mask, log_probs, calls, routes, version_spans(found))


def version_spans(found: list[Mapping[str, Any]]) -> list[tuple[int, int, str | None]] | None:
    """Where each carrier's sampled tokens sit and the version that sampled them; None when
    no call names a version."""
    if all(item.get("policy_version") is None for item in found):
        return None
    spans = []
    for item in found:
        start = len(item["prompt_token_ids"])
        parts = item.get(VERSION_SPANS_FIELD)  # a call continued after its engine cut it
        if not parts:
            parts = [(0, len(item["generation_token_ids"]), item.get("policy_version"))]
        spans += [(start + begin, start + end, version) for begin, end, version in parts]
    return spans


def sample_routes(found: list[Mapping[str, Any]], length: int) -> Routes | None:
    """The sample's routes from its carriers, a row per position (module docstring); None
    unless every call of it carries routes."""
    if not found or any(item.get("routed_experts") is None for item in found):
        return None
    last = as_routes(found[-1]["routed_experts"])
    if last is None or last.rows != length - 1:
        return None  # another engine's form, or not a row per position read: not aligned
    if routes_differ(item["routed_experts"] for item in found):
        return None  # one row per position would replay some call's prefix as it was not
    return Routes((last.to_bytes(), bytes(last.row_bytes)), length, last.layers, last.top_k)


def training_samples(record: Mapping[str, Any]) -> list[TrainingSample]:
    """The record's samples: the main chain's, then each segment's (``delivery: segments``)."""
    output = record.get("response", {}).get("output")
    if record.get(MASK_KEY) or (METRICS_KEY not in record and not carries_token_ids(output)):
        return []
    samples = [sample_of(output, MAIN_ROLE)]
    for segment in record.get(SEGMENTS_KEY) or []:
        samples.append(sample_of(segment["output"], str(segment.get("role") or "other")))
    return [sample for sample in samples if sample.n_calls]
