"""``tokcap report`` across training steps: the step each record belongs to, and each step's
figures and flat metrics.

Why: capture health is watched as a curve per step (a mask rate creeping up, delivery
dropping, the policy lagging), not as one pile of records. A record's step is the
``step{N}.`` that opens its rollout id (``step{N}.{task}-{rollout}``, as the collector names
rollouts), or, with a step field, that top-level field of the record: an integer, or a name.
Only the latest result of each rollout counts, across every file read, wherever it lands.
Records naming no step are a group of their own, ``no step``, reported last and left off the
trend, never guessed into a neighbour. A step's flat metrics are ``capture.step_metrics`` of
its records, the numbers a trainer logs for that step, so the report and the logger agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from capture.metrics import step_metrics
from capture.rollout_ids import step_of_rollout_id
from tokcap.report.figures import Figures, figures_of, latest_results, slim
from tokcap.report.reading import BadInput

StepKey = int | str | None  # None: the record names no step
STEP = "step"  # where a slimmed record keeps its step
NO_STEP = "no step"  # how the group of records naming none is shown
_DIGITS = re.compile(r"[0-9]+")


@dataclass
class Step:
    """One step's records, counted as the report counts them and as a trainer logs them."""

    key: StepKey
    figures: Figures
    metrics: dict[str, float]  # capture.step_metrics with no prefix

    @property
    def label(self) -> str:
        return NO_STEP if self.key is None else str(self.key)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.key, "metrics": self.metrics, "figures": self.figures.as_dict()}


@dataclass
class StepReport:
    """Every step in order (numbered, then named, then ``no step``) and all records at once."""

    steps: list[Step]
    figures: Figures  # of every record, whatever its step

    @property
    def stepped(self) -> list[Step]:
        """The steps the trend can place: those with a key."""
        return [step for step in self.steps if step.key is not None]

    def as_dict(self) -> dict[str, Any]:
        """``--json``: the figures of all records, as a single step prints them, and each
        step's under ``steps``."""
        return {**self.figures.as_dict(), "steps": [step.as_dict() for step in self.steps]}


def report_steps(records: Iterable[Mapping[str, Any]], step_field: str | None = None) -> StepReport:
    """The records (in publish order: later ones win) grouped by step and counted."""
    latest = latest_results(_with_step(record, step_field) for record in records)
    if step_field is not None and latest and all(r[STEP] is None for r in latest):
        raise BadInput(f"no record has a field {step_field!r} (--step-field) to group by")
    groups: dict[StepKey, list[dict[str, Any]]] = {}
    for record in latest:
        groups.setdefault(record[STEP], []).append(record)
    steps = [
        Step(key, figures_of(group), step_metrics(group, prefix=""))
        for key, group in sorted(groups.items(), key=lambda item: _order(item[0]))
    ]
    return StepReport(steps, figures_of(latest))


def _with_step(record: Mapping[str, Any], step_field: str | None) -> dict[str, Any]:
    kept = slim(record)
    if step_field is None:
        kept[STEP] = step_of_rollout_id(kept["rollout"])
    else:
        kept[STEP] = field_step(record, step_field, kept["rollout"])
    return kept


def field_step(record: Mapping[str, Any], name: str, rollout: str | None) -> StepKey:
    """The step a record's own field names: an integer (or its digits), or a name."""
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        return int(text) if _DIGITS.fullmatch(text) else text
    raise BadInput(
        f"rollout {rollout or '(unnamed)'}: {name} is {value!r}; a step is an integer or a name"
    )


def _order(key: StepKey) -> tuple[int, int, str]:
    """Numbered steps by number, then named ones by name, then the records naming none."""
    if isinstance(key, int):
        return (0, key, "")
    return (1, 0, key) if key is not None else (2, 0, "")
