"""The per-rollout summary a rebuilt record carries under ``_ng_token_capture``.

One typed shape for every outcome (a delivered rollout, a masked one, a failed build), so a
dashboard always sees the same keys: a failed build reports zeros and its error, never a
shorter dict. The README's metrics table documents each field. ``metric_int`` and
``metric_float`` read a field back from a record whatever wrote it (``tokcap report`` and
``capture.step_metrics`` both do).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from capture.records import TokenEntry, version_spans
from capture.routes import routes_differ

if TYPE_CHECKING:
    from capture.build.builder import BuildResult


@dataclass(frozen=True)
class RolloutSummary:
    n_calls: int = 0  # calls captured (with or without generated tokens)
    chains: int = 0  # root-to-leaf chains found by prefix merging
    roots: int = 0
    quarantined_calls: int = 0  # calls with an ambiguous parent
    quarantined_fraction: float = 0.0
    delivered_fraction: float = 0.0  # generated tokens delivered / generated tokens captured
    generated_tokens_captured: int = 0
    generated_tokens_delivered: int = 0
    empty_generation_calls: int = 0  # calls with no generated tokens, set aside
    unreceived_calls: int = 0  # replies the harness never got that nothing extends, left out
    main_chain_calls: int = 0
    main_chain_by: str = ""  # "final_answer", "only_root", or "" when nothing is delivered
    discarded_retries: int = 0  # retries a later call did not extend, dropped
    identical_retries: int = 0  # retries that sampled exactly the same, folded into one call
    unresolved_retries: int = 0  # groups of retries none of which was extended
    # Faithful prompts rendered whole although the history held an assistant turn, by reason.
    faithful_fallbacks: dict[str, int] = field(default_factory=dict)
    # delivery: segments: the segments delivered beside the main chain, by role.
    segments: dict[str, int] = field(default_factory=dict)
    # Roots nothing in the capture relates to the main chain's (never delivered as segments),
    # and roots seeded with assistant turns no captured call sampled (few-shot, resumed).
    unexplained_roots: int = 0
    seeded_roots: int = 0
    # The policy versions the delivered calls ran under, each once, in call order; and how
    # many versions the oldest lags the one the consumer named (integer versions only).
    policy_versions: list[str] = field(default_factory=list)
    policy_version_lag: int | None = None
    # Delivered calls their engine cut for a weight update and the front end continued on
    # the new weights: their generated ids span two or more versions.
    calls_spanning_update: int = 0
    # Main-chain calls routed differently from the last call on the prefix they share.
    routes_differing_calls: int = 0
    capture_incomplete: bool | None = None  # None: no snapshot was read
    mask_reasons: list[str] = field(default_factory=list)  # empty: delivered unmasked
    error: str | None = None  # a failed build's error

    @classmethod
    def of_build(
        cls,
        build: BuildResult,
        *,
        capture_incomplete: bool,
        mask_reasons: list[str],
        current_policy_version: str | int | None = None,
    ) -> RolloutSummary:
        """The summary of a build the builder finished (masked or not)."""
        versions = policy_versions(build)
        return cls(
            n_calls=build.n_calls,
            chains=len(build.chains),
            roots=len(build.roots),
            quarantined_calls=len(build.quarantined),
            quarantined_fraction=build.quarantined_fraction,
            delivered_fraction=build.delivered_fraction,
            generated_tokens_captured=build.generated_tokens_captured,
            generated_tokens_delivered=build.generated_tokens_delivered,
            empty_generation_calls=len(build.empty_generation),
            unreceived_calls=len(build.unreceived),
            main_chain_calls=len(build.main_chain),
            main_chain_by=build.main_chain_by,
            discarded_retries=len(build.discarded_retries),
            identical_retries=len(build.identical_retries),
            unresolved_retries=len(build.unresolved_retries),
            faithful_fallbacks=dict(build.faithful_fallbacks),
            segments=dict(sorted(Counter(segment.role for segment in build.segments).items())),
            unexplained_roots=len(build.unexplained_roots),
            seeded_roots=len(build.seeded_roots),
            policy_versions=versions,
            policy_version_lag=version_lag(versions, current_policy_version),
            calls_spanning_update=sum(len(version_spans(e)) > 1 for e in delivered_entries(build)),
            routes_differing_calls=routes_differ(e.routed_experts for e in build.main_entries),
            capture_incomplete=capture_incomplete,
            mask_reasons=list(mask_reasons),
        )

    @classmethod
    def of_failure(cls, error: str, mask_reason: str, capture_incomplete: bool | None = None):
        """The summary of a build that failed: nothing delivered, the error named."""
        return cls(capture_incomplete=capture_incomplete, mask_reasons=[mask_reason], error=error)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SUMMARY_KEYS = tuple(RolloutSummary.__dataclass_fields__)


# Reading a summary back from a record: a record is JSON that may come from another version,
# another tool or a hand, so a missing or odd number counts as 0 rather than failing a report.


def metric_int(value: Any) -> int:
    """A summary field as an int; a missing or non-numeric one counts as 0 rather than failing."""
    return int(metric_float(value))


def metric_float(value: Any) -> float:
    """A summary field as a float; missing, non-numeric, NaN or infinite: 0.0 (JSON allows NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


def delivered_entries(build: BuildResult) -> list[TokenEntry]:
    """The delivered calls: the main chain, then the segments'."""
    return [*build.main_entries, *(e for s in build.segments for e in s.calls)]


def policy_versions(build: BuildResult) -> list[str]:
    """The versions that sampled the delivered calls' ids, each once, in order (a continued
    call's every part)."""
    spans = (span for entry in delivered_entries(build) for span in version_spans(entry))
    return list(dict.fromkeys(version for _, _, version in spans if version is not None))


def version_lag(versions: list[str], current: str | int | None) -> int | None:
    """``current`` minus the oldest version, where every version is an integer."""
    if current is None or not versions:
        return None
    try:
        return int(current) - min(int(version) for version in versions)
    except (TypeError, ValueError):
        return None
