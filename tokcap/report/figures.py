"""What ``tokcap report`` counts: one step's finished rollout records turned into ``Figures``.

``compute_figures`` does nothing else (``tokcap.report.steps`` takes ``figures_of`` each
step); the table, the JSON and the PNG are views of those figures (``tokcap.report.drawing``),
and the records come from files or the results stream (``tokcap.report.reading``). Only the
latest result of a rollout counts: a later one is authoritative (it supersedes the earlier
one, or rebuilt a resubmitted record). Metric keys this report does not know are listed,
never an error, since the record grows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from capture.delivery import METRICS_KEY
from capture.mask_reasons import NO_REASON, reason_group
from capture.rollout_ids import rollout_id_from_run_body
from capture.summary import SUMMARY_KEYS, metric_float, metric_int

SEGMENTS_KEY = "_ng_token_segments"
CHAIN_BINS = ("0", "1", "2", "3", "4+")
FRACTION_BINS = (*(f"{i / 10:.1f}-{(i + 1) / 10:.1f}" for i in range(10)), "1.0")

# What a first run should flag. One call per rollout means the harness's loop never went
# through the capture prefix more than once: the agentic path never ran.
SINGLE_CALL_WARN = 0.5  # share of rebuilt rollouts with n_calls == 1
LOW_DELIVERY = 0.5  # an unmasked rollout delivering less than this share of its tokens ...
LOW_DELIVERY_WARN = 0.1  # ... is flagged when this share of unmasked rollouts does
MASK_RATE_WARN = 0.2


@dataclass
class Figures:
    """What ``tokcap report`` shows; every count is of rollouts unless it says tokens."""

    rollouts: int = 0
    replaced_results: int = 0  # earlier results a later one of the same rollout replaced
    never_rebuilt: int = 0  # no _ng_token_capture
    rebuilt: int = 0
    single_call: int = 0  # rebuilt with n_calls == 1: the agentic path never ran
    masked: int = 0
    unmasked_rebuilt: int = 0
    build_errors: int = 0
    mask_reasons: dict[str, int] = field(default_factory=dict)  # by reason group
    chains: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHAIN_BINS, 0))
    # Of unmasked rebuilt rollouts: a masked one trains on nothing, whatever it delivered.
    delivered_fraction: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FRACTION_BINS, 0)
    )
    low_delivery: int = 0  # unmasked rollouts delivering < LOW_DELIVERY
    tokens_captured: int = 0
    tokens_delivered: int = 0
    tokens_delivered_unmasked: int = 0  # what training sees
    faithful_fallbacks: dict[str, int] = field(default_factory=dict)
    rollouts_with_segments: int = 0
    segments_by_role: dict[str, int] = field(default_factory=dict)
    # Rebuilt rollouts by each policy version their delivered calls ran under, and by how
    # many versions they span; by the lag their consumer saw, where it named a version.
    policy_versions: dict[str, int] = field(default_factory=dict)
    versions_spanned: dict[str, int] = field(default_factory=dict)
    policy_version_lag: dict[str, int] = field(default_factory=dict)
    # Calls their engine cut for a weight update and the front end continued on the new
    # weights, and the rebuilt rollouts that deliver any.
    calls_spanning_update: int = 0
    rollouts_spanning_update: int = 0
    other_metrics: dict[str, int] = field(default_factory=dict)  # unknown keys, by rollouts
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The figures and their rates, as ``--json`` prints them."""
        return {
            **asdict(self),
            "single_call_share": share(self.single_call, self.rebuilt),
            "mask_rate": share(self.masked, self.rollouts),
            "mask_rate_by_reason": {
                reason: share(n, self.rollouts) for reason, n in self.mask_reasons.items()
            },
            "delivered_token_share": share(self.tokens_delivered, self.tokens_captured),
        }


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


# -- figures -----------------------------------------------------------------------------


def compute_figures(records: Iterable[Mapping[str, Any]]) -> Figures:
    """The figures of one step's finished records (in publish order: later ones win)."""
    return figures_of(latest_results(slim(record) for record in records))


def figures_of(latest: list[dict[str, Any]]) -> Figures:
    """The figures of slimmed records, each the latest of its rollout (``latest_results``)."""
    replaced = sum(record["replaced"] for record in latest)
    figures = Figures(rollouts=len(latest), replaced_results=replaced)
    reasons: Counter[str] = Counter()
    for record in latest:
        _tally_record(figures, record, reasons)
    figures.mask_reasons = dict(reasons.most_common())
    figures.warnings = warnings_of(figures)
    return figures


def slim(record: Mapping[str, Any]) -> dict[str, Any]:
    """Only what the report reads: a record's token arrays can be a whole final context."""
    kept = {"rollout": _rollout_of(record), "mask_sample": bool(record.get("mask_sample"))}
    if METRICS_KEY in record:
        kept[METRICS_KEY] = record[METRICS_KEY]
    segments = record.get(SEGMENTS_KEY)
    if isinstance(segments, list):
        kept[SEGMENTS_KEY] = [_role_of(segment) for segment in segments]
    return kept


def _rollout_of(record: Mapping[str, Any]) -> str | None:
    try:
        return rollout_id_from_run_body(record)
    except Exception:  # a malformed id is still one rollout: its record is its own
        raw = record.get("_ng_rollout_id")
        return None if raw is None else str(raw)


def _role_of(segment: Any) -> str:
    role = segment.get("role") if isinstance(segment, Mapping) else None
    return str(role) if role is not None else "?"


def latest_results(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest result of each rollout, its ``replaced`` set to how many earlier ones of
    that rollout it replaced.

    A later result of the same rollout is authoritative: it supersedes the earlier one
    (``_ng_supersedes``) or rebuilt a resubmitted record. A record naming no rollout stands
    alone.
    """
    by_rollout: dict[Any, dict[str, Any]] = {}
    for seen, record in enumerate(records, 1):
        key = record["rollout"] if record["rollout"] is not None else -seen
        earlier = by_rollout.get(key)
        record["replaced"] = 0 if earlier is None else earlier["replaced"] + 1
        by_rollout[key] = record
    return list(by_rollout.values())


def _tally_record(figures: Figures, record: dict[str, Any], reasons: Counter[str]) -> None:
    masked = record["mask_sample"]
    figures.masked += masked
    roles = record.get(SEGMENTS_KEY)
    if roles is not None:
        figures.rollouts_with_segments += 1
        _add(figures.segments_by_role, Counter(roles))
    metrics = record.get(METRICS_KEY)
    if not isinstance(metrics, Mapping):
        figures.never_rebuilt += 1
        return
    figures.rebuilt += 1
    figures.single_call += metric_int(metrics.get("n_calls")) == 1
    figures.build_errors += bool(metrics.get("error"))
    figures.chains[_chain_bin(metric_int(metrics.get("chains")))] += 1
    figures.tokens_captured += metric_int(metrics.get("generated_tokens_captured"))
    delivered = metric_int(metrics.get("generated_tokens_delivered"))
    figures.tokens_delivered += delivered
    _tally_versions(figures, metrics)
    fallbacks = metrics.get("faithful_fallbacks")
    if isinstance(fallbacks, Mapping):
        _add(figures.faithful_fallbacks, {str(k): metric_int(v) for k, v in fallbacks.items()})
    _add(figures.other_metrics, dict.fromkeys(set(metrics) - set(SUMMARY_KEYS), 1))
    if masked:
        listed = metrics.get("mask_reasons")
        groups = {reason_group(str(r)) for r in listed} if isinstance(listed, list) else set()
        reasons.update(groups or {NO_REASON})
        return
    figures.unmasked_rebuilt += 1
    figures.tokens_delivered_unmasked += delivered
    fraction = metric_float(metrics.get("delivered_fraction"))
    figures.delivered_fraction[fraction_bin(fraction)] += 1
    figures.low_delivery += fraction < LOW_DELIVERY


def _tally_versions(figures: Figures, metrics: Mapping[str, Any]) -> None:
    versions = metrics.get("policy_versions")
    if not isinstance(versions, list) or not versions:
        return
    _add(figures.policy_versions, Counter(str(version) for version in set(versions)))
    _add(figures.versions_spanned, {str(len(set(versions))): 1})
    lag = metrics.get("policy_version_lag")
    if isinstance(lag, int) and not isinstance(lag, bool):
        _add(figures.policy_version_lag, {str(lag): 1})
    spanning = metric_int(metrics.get("calls_spanning_update"))
    figures.calls_spanning_update += spanning
    figures.rollouts_spanning_update += spanning > 0


def fraction_bin(fraction: float) -> str:
    """``0.0-0.1`` ... ``0.9-1.0`` (upper bound excluded), and ``1.0`` for all delivered."""
    if fraction >= 1.0:
        return FRACTION_BINS[-1]
    return FRACTION_BINS[min(max(int(fraction * 10), 0), 9)]


def _chain_bin(chains: int) -> str:
    return CHAIN_BINS[min(max(chains, 0), len(CHAIN_BINS) - 1)]


def _add(total: dict[str, int], counts: Mapping[str, int]) -> None:
    for key, count in counts.items():
        total[key] = total.get(key, 0) + count


def warnings_of(figures: Figures) -> list[str]:
    """The checks of a first run, each as a sentence saying what to look at."""
    f, warnings = figures, []
    if not f.rollouts:
        warnings.append("no records: nothing to report")
    if f.never_rebuilt:
        warnings.append(
            f"{f.never_rebuilt} of {f.rollouts} rollouts were never rebuilt (no {METRICS_KEY}): "
            "are the workers running, or did the records carry their own token ids?"
        )
    if f.rebuilt and f.single_call / f.rebuilt > SINGLE_CALL_WARN:
        warnings.append(
            f"{f.single_call} of {f.rebuilt} rebuilt rollouts captured one call: the agentic "
            "path never ran (does the harness send every model call through the capture URL?)"
        )
    if f.rollouts and f.masked / f.rollouts > MASK_RATE_WARN:
        top = next(iter(f.mask_reasons), NO_REASON)
        warnings.append(f"mask rate {f.masked / f.rollouts:.0%}; the commonest reason: {top}")
    if f.build_errors:
        warnings.append(
            f"{f.build_errors} of {f.rebuilt} builds failed: see the error in {METRICS_KEY}"
        )
    if f.unmasked_rebuilt and f.low_delivery / f.unmasked_rebuilt >= LOW_DELIVERY_WARN:
        warnings.append(
            f"{f.low_delivery} of {f.unmasked_rebuilt} unmasked rollouts deliver less than "
            f"{LOW_DELIVERY:.0%} of their generated tokens: see chains per rollout (with "
            "delivery: chain, chains other than the main one are not trained on)"
        )
    return warnings
