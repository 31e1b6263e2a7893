"""One training step's capture metrics, flat, for whatever logger the trainer uses.

Why: whether capture works shows step by step (a mask rate creeping up, delivery dropping,
the policy lagging), and each record already says it in its ``_ng_token_capture`` summary.
``step_metrics`` folds one step's records into a ``dict[str, float]`` that ``wandb.log``, a
``SummaryWriter.add_scalar`` loop or ``mlflow.log_metrics`` take as it is. capture/ imports
no logging library: the caller logs.

Each key is ``prefix`` + a name below. A name never comes from the data: roles and mask
reasons are the bounded sets listed here, and anything else counts under ``other``. Every
record given counts, once: pass the records the step trains on (``tokcap report`` is what
keeps only the latest of several results of a rollout on the results stream).

Counts are always present, 0 for no records, so every step plots the same series:

- ``records``; ``rebuilt`` (it carries a summary); ``never_rebuilt`` (it carries none: no
  capture ran for it, or it carried its own token ids); ``masked`` (``mask_sample`` true).
- ``one_call``: rebuilt with ``n_calls == 1`` (the harness's loop reached the capture once:
  on a first run, the agentic path never ran). ``several_chains``: rebuilt with ``chains > 1``
  (titles, sub-agents, compactions beside the main chain).
- ``segments/<role>``, role in ``main``, ``subagent``, ``compaction_summary``, ``title``,
  ``continuation``, ``other``: the training samples the unmasked rebuilt records yield, by
  role (``capture.training_samples``' roles): ``main`` is each one's main chain, the rest
  its summary's ``segments`` (``delivery: segments``); a role not listed counts as ``other``.
- ``tokens/captured``: generated tokens the rebuilt records captured; ``tokens/delivered``:
  those the unmasked ones deliver, what the loss trains on; ``tokens/lost``: the difference,
  sampled but not trained on (masked rollouts, chains not delivered).
- ``mask_reason/<slug>``, slug in ``capture.mask_reasons.MASK_REASON_SLUGS``: masked rebuilt
  rollouts giving a reason of that kind (once per slug, so they may add up to more than
  ``masked``); ``unstated``: masked with no reason in the summary; ``other``: a reason no
  slug names.
- ``calls_spanning_update``: delivered calls cut by a weight update and continued on the new
  weights; ``rollouts_spanning_update``: rebuilt rollouts with any.
- ``routes_differing_calls``: main-chain calls routed differently from an earlier call on
  their shared prefix; ``rollouts_routes_differing``: rebuilt rollouts with any.

Fractions and statistics are present only where what they are taken over is not empty: a
0.0 standing for "no data" would plot as a value (a healthy mask rate, a broken delivery).

- ``masked_fraction``: of records. ``one_call_fraction``, ``several_chains_fraction``: of
  rebuilt records.
- ``delivered_fraction/mean``, ``delivered_fraction/p10``: of unmasked rebuilt records (a
  masked one trains on nothing, whatever it delivered); p10 interpolates linearly between
  the sorted fractions (numpy's default percentile).
- ``policy_versions/mean``, ``policy_versions/max``: distinct policy versions per rebuilt
  rollout, of those whose calls name any.
- ``policy_version_lag/mean``, ``policy_version_lag/max``: the summary's lag, of rollouts that
  have one: the version the consumer named at finalize (``current_policy_version``, or the
  record's ``_ng_current_policy_version``) minus the oldest version the rollout ran under.
  It is not made up here from the step's newest version: the newest version sampled is not
  the one the trainer is at, and versions need not be integers. Name it at finalize.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from capture.build.segments import ROLES as SEGMENT_ROLES
from capture.delivery import MASK_KEY, METRICS_KEY
from capture.mask_reasons import MASK_REASON_SLUGS, OTHER, UNSTATED, reason_slug
from capture.samples import MAIN_ROLE
from capture.summary import metric_float, metric_int

DEFAULT_PREFIX = "token_capture/"
ROLES: tuple[str, ...] = (MAIN_ROLE, *SEGMENT_ROLES)
COUNT_KEYS: tuple[str, ...] = (
    "records",
    "rebuilt",
    "never_rebuilt",
    "masked",
    "one_call",
    "several_chains",
    *(f"segments/{role}" for role in ROLES),
    "tokens/captured",
    "tokens/delivered",
    "tokens/lost",
    *(f"mask_reason/{slug}" for slug in MASK_REASON_SLUGS),
    "calls_spanning_update",
    "rollouts_spanning_update",
    "routes_differing_calls",
    "rollouts_routes_differing",
)
P10 = 0.1


@dataclass
class _Step:
    """What the step's records add up to, before it becomes keys."""

    counts: Counter[str] = field(default_factory=Counter)
    delivered_fractions: list[float] = field(default_factory=list)  # unmasked rebuilt
    versions_spanned: list[int] = field(default_factory=list)  # rebuilt naming a version
    lags: list[int] = field(default_factory=list)  # rebuilt with a lag


def step_metrics(
    records: Iterable[Mapping[str, Any]], prefix: str = DEFAULT_PREFIX
) -> dict[str, float]:
    """The step's metrics (keys in the module docstring), each key ``prefix`` + its name."""
    step = _Step()
    for record in records:
        _add_record(step, record)
    counts = step.counts
    counts["tokens/lost"] = counts["tokens/captured"] - counts["tokens/delivered"]
    metrics = {name: float(counts[name]) for name in COUNT_KEYS}
    metrics.update(_fractions(step))
    metrics.update(_statistics(step))
    return {prefix + name: value for name, value in metrics.items()}


def _add_record(step: _Step, record: Mapping[str, Any]) -> None:
    counts = step.counts
    masked = bool(record.get(MASK_KEY))
    counts["records"] += 1
    counts["masked"] += masked
    summary = record.get(METRICS_KEY)
    if not isinstance(summary, Mapping):
        counts["never_rebuilt"] += 1
        return
    counts["rebuilt"] += 1
    counts["one_call"] += metric_int(summary.get("n_calls")) == 1
    counts["several_chains"] += metric_int(summary.get("chains")) > 1
    counts["tokens/captured"] += metric_int(summary.get("generated_tokens_captured"))
    _add_updates(step, summary)
    if masked:
        counts.update(f"mask_reason/{slug}" for slug in _slugs(summary))
        return
    counts["tokens/delivered"] += metric_int(summary.get("generated_tokens_delivered"))
    step.delivered_fractions.append(metric_float(summary.get("delivered_fraction")))
    _add_segments(counts, summary)


def _add_updates(step: _Step, summary: Mapping[str, Any]) -> None:
    """The policy versions a rollout ran under, its lag, and what updates did to its calls."""
    versions = summary.get("policy_versions")
    if isinstance(versions, list) and versions:
        step.versions_spanned.append(len({str(version) for version in versions}))
    lag = summary.get("policy_version_lag")
    if isinstance(lag, int) and not isinstance(lag, bool):
        step.lags.append(lag)
    # The summary's field is the calls' count under its own name; the rollouts with any beside.
    for calls_key, rollouts_key in (
        ("calls_spanning_update", "rollouts_spanning_update"),
        ("routes_differing_calls", "rollouts_routes_differing"),
    ):
        calls = max(metric_int(summary.get(calls_key)), 0)
        step.counts[calls_key] += calls
        step.counts[rollouts_key] += calls > 0


def _slugs(summary: Mapping[str, Any]) -> set[str]:
    """The slugs of a masked rollout's reasons, each once; ``unstated`` when it gives none."""
    reasons = summary.get("mask_reasons")
    if not isinstance(reasons, list) or not reasons:
        return {UNSTATED}
    return {reason_slug(str(reason)) for reason in reasons}


def _add_segments(counts: Counter[str], summary: Mapping[str, Any]) -> None:
    """An unmasked rollout's samples by role: its main chain, then its summary's segments."""
    counts[f"segments/{MAIN_ROLE}"] += metric_int(summary.get("main_chain_calls")) > 0
    segments = summary.get("segments")
    if not isinstance(segments, Mapping):
        return
    for role, n in segments.items():
        known = role if role in SEGMENT_ROLES else OTHER
        counts[f"segments/{known}"] += max(metric_int(n), 0)


def _fractions(step: _Step) -> dict[str, float]:
    """Each share whose whole is not empty."""
    counts = step.counts
    shares = {
        "masked_fraction": ("masked", "records"),
        "one_call_fraction": ("one_call", "rebuilt"),
        "several_chains_fraction": ("several_chains", "rebuilt"),
    }
    return {
        name: counts[part] / counts[whole]
        for name, (part, whole) in shares.items()
        if counts[whole]
    }


def _statistics(step: _Step) -> dict[str, float]:
    """The means, maxima and p10 of what some records have, where any has it."""
    found: dict[str, float] = {}
    if step.delivered_fractions:
        found["delivered_fraction/mean"] = _mean(step.delivered_fractions)
        found["delivered_fraction/p10"] = _quantile(step.delivered_fractions, P10)
    for name, values in (
        ("policy_versions", step.versions_spanned),
        ("policy_version_lag", step.lags),
    ):
        if values:
            found[f"{name}/mean"] = _mean(values)
            found[f"{name}/max"] = float(max(values))
    return found


def _mean(values: list[int] | list[float]) -> float:
    return sum(values) / len(values)


def _quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile, interpolated linearly between the sorted values (numpy's default;
    ``statistics.quantiles`` needs two values on Python 3.11)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the quantile of no values")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
