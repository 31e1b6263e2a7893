"""Training samples of a rebuilt record: one per delivered segment, ready for a loss.

For a trainer that does not walk output items itself: each sample is one contiguous
sequence (``input_ids``), its loss mask (1 where the policy sampled, 0 for context), the
sampled log-probs aligned with it (0.0 at context positions) and the role of the segment
it came from (``main`` for the chain in ``response.output``). A masked record has no
samples, nor has one never rebuilt, unless it carried its own token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from capture.build.projection import flat_sequence
from capture.build.segments import SEGMENTS_KEY
from capture.delivery import MASK_KEY, METRICS_KEY, carries_token_ids

MAIN_ROLE = "main"


@dataclass(frozen=True)
class TrainingSample:
    role: str
    input_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    n_calls: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_of(items: Iterable[Any], role: str) -> TrainingSample:
    """One contiguous sample from token-bearing items; ValueError when they are not one
    sequence (a carrier's prompt does not extend everything before it)."""
    try:
        ids, mask, log_probs, calls = flat_sequence(items)
    except ValueError as exc:
        raise ValueError(f"{role}: {exc}") from None
    return TrainingSample(role, ids, mask, log_probs, calls)


def training_samples(record: Mapping[str, Any]) -> list[TrainingSample]:
    """The record's samples: the main chain's, then each segment's (``delivery: segments``)."""
    output = record.get("response", {}).get("output")
    if record.get(MASK_KEY) or (METRICS_KEY not in record and not carries_token_ids(output)):
        return []
    samples = [sample_of(output, MAIN_ROLE)]
    for segment in record.get(SEGMENTS_KEY) or []:
        samples.append(sample_of(segment["output"], str(segment.get("role") or "other")))
    return [sample for sample in samples if sample.n_calls]
