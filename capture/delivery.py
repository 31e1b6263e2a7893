"""Hand a finished rollout its training tokens: finalize, then (after a durable handoff) retire.

``finalize_rollout_token_capture`` freezes the rollout's capture, rebuilds it, replaces only
``result["response"]["output"]`` with the contiguous token-bearing items, attaches the
per-rollout metrics under ``_ng_token_capture`` and sets the top-level ``mask_sample``. It
never raises: every failure becomes a masked record with the error in its metrics, because
a trainer loop must not die on one bad rollout. It never retires either: the snapshot is
dropped only by ``retire_rollout_token_capture``, after the caller made the result durable,
and only for a successful build, so a crash in between loses nothing.

The record's shape is checked before anything is frozen: a record that cannot be rebuilt
(not a mapping, no rollout id, no response object, an output that is not a list) leaves the
rollout open, so a later valid record of the same rollout still gets the real build. Every
failure says its kind (``RolloutBuild.error_kind``), so a caller can tell a bad record from
a source that could not be reached (worth retrying) from a failed build.

A masked record keeps its original output: its tokens are excluded from the loss, and a
partial chain presented as the transcript would only mislead.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

from capture.build.builder import BuildResult, run_builder
from capture.build.segments import SEGMENTS_KEY, Delivery
from capture.errors import InvalidRolloutIdError, TokenCaptureError, UnconfirmedWriteError
from capture.records import TOKEN_FIELDS, TokenCaptureSnapshot
from capture.rollout_ids import rollout_id_from_run_body, validate_rollout_id
from capture.summary import RolloutSummary

log = logging.getLogger("tokcap.delivery")

METRICS_KEY = "_ng_token_capture"
MASK_KEY = "mask_sample"


ErrorKind = Literal["record", "source", "build"]


class MalformedRecordError(TokenCaptureError, ValueError):
    """The rollout record cannot be rebuilt, whatever the capture holds."""


class SourceUnavailableError(TokenCaptureError):
    """The source could not be reached to freeze the rollout; a later attempt may work."""


BuildStatus = Literal["ok", "masked", "skipped", "failed"]


@dataclass(frozen=True)
class RolloutBuild:
    """What finalize did; ``(snapshot_id, version)`` names the snapshot retire may drop.

    ``status``: ``"ok"`` (delivered unmasked: the only kind that may be retired),
    ``"masked"`` (built, excluded from the loss), ``"skipped"`` (the record already carried
    token ids and was left alone) or ``"failed"``. A failure says its kind, so a caller acts
    on it without guessing: ``"record"`` (the record itself cannot be rebuilt; nothing was
    frozen), ``"source"`` (the source could not be reached: transient, try again) or
    ``"build"`` (anything else; the snapshot, if any, is kept as evidence).
    """

    rollout_id: str | None
    status: BuildStatus
    snapshot_id: str = ""
    version: int = 0
    summary: RolloutSummary = field(default_factory=RolloutSummary)
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def masked(self) -> bool:
        """Excluded from the loss: a masked build, or a failed one."""
        return self.status in ("masked", "failed")

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"

    @property
    def transient(self) -> bool:
        """A failure a later attempt may not have: the source could not be reached."""
        return self.error_kind == "source"

    @property
    def metrics(self) -> dict[str, Any]:
        """The summary as the record carries it under ``_ng_token_capture``."""
        return self.summary.as_dict()


def carries_token_ids(output: Any) -> bool:
    """Whether an output list already has token arrays on some item."""
    if not isinstance(output, list):
        return False
    return any(
        isinstance(item, Mapping) and any(item.get(name) is not None for name in TOKEN_FIELDS)
        for item in output
    )


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


# A record's own word on the policy version its consumer trains now (the lag counts from it).
CURRENT_VERSION_KEY = "_ng_current_policy_version"


def _mark(result: Any, masked: bool, summary: RolloutSummary) -> None:
    # A record someone else already masked stays masked: finalize only ever adds a mask.
    if isinstance(result, MutableMapping):
        result[METRICS_KEY] = summary.as_dict()
        result[MASK_KEY] = masked or result.get(MASK_KEY) is True


def check_record(result: Any) -> list[Any]:
    """The record's ``response.output``, or MalformedRecordError saying what is wrong.

    Checked before freeze: a record that cannot take a rebuilt output must not stop the
    rollout's writes or name its snapshot, because a valid record may still come for it.
    """
    if not isinstance(result, MutableMapping):
        raise MalformedRecordError(
            f"the rollout record must be a mutable mapping, got {type(result).__name__}"
        )
    response = result.get("response")
    if not isinstance(response, MutableMapping):
        kind = type(response).__name__
        raise MalformedRecordError(f"the record has no response object to rebuild ({kind})")
    output = response.get("output")
    if not isinstance(output, list):
        raise MalformedRecordError(
            f"the record's response.output must be a list, got {type(output).__name__}"
        )
    return output


def record_rollout_id(result: Mapping[str, Any], rollout_id: str | None = None) -> str:
    """The rollout a record belongs to (the explicit argument wins).

    An invalid id raises InvalidRolloutIdError, a missing one MalformedRecordError; both
    are record errors.
    """
    if rollout_id is not None:
        return validate_rollout_id(rollout_id)
    found = rollout_id_from_run_body(result)
    if found is None:
        raise MalformedRecordError(
            "the record names no rollout id (_ng_rollout_id, or _ng_task_index and "
            "_ng_rollout_index)"
        )
    return found


async def _freeze(source: Any, rollout_id: str) -> TokenCaptureSnapshot:
    """Freeze through the source; an unreachable source becomes SourceUnavailableError.

    Only errors that say the source could not answer (connection, timeout, OS errors, a
    write it could not confirm durable) are transient; anything else the source raises is a
    failed build, kept as evidence.
    """
    try:
        return await _maybe_await(source.freeze(rollout_id))
    except (ConnectionError, TimeoutError, OSError, UnconfirmedWriteError) as exc:
        raise SourceUnavailableError(f"{type(exc).__name__}: {exc}") from exc


def _error_kind(exc: Exception) -> ErrorKind:
    if isinstance(exc, (MalformedRecordError, InvalidRolloutIdError)):
        return "record"
    if isinstance(exc, SourceUnavailableError):
        return "source"
    return "build"


async def finalize_rollout_token_capture(
    result: Any,
    source: Any,
    *,
    rollout_id: str | None = None,
    delivery: Delivery = "chain",
    min_delivered_fraction: float | None = None,
    current_policy_version: str | int | None = None,
) -> RolloutBuild:
    """Freeze, rebuild and attach the rollout's tokens to ``result``; never raises.

    ``delivery="segments"`` also attaches every other chain under ``_ng_token_segments``;
    ``min_delivered_fraction`` masks a rollout that delivers a smaller share of what it
    sampled (``token_id_capture`` has both keys). ``current_policy_version`` (else the
    record's ``_ng_current_policy_version``) is what ``policy_version_lag`` counts from.
    """
    snapshot: TokenCaptureSnapshot | None = None
    try:
        output = check_record(result)
        if carries_token_ids(output):
            return RolloutBuild(rollout_id=rollout_id, status="skipped")
        rollout_id = record_rollout_id(result, rollout_id)
        snapshot = await _freeze(source, rollout_id)
        build = _rebuild(snapshot, rollout_id, output, delivery)
        return _attach(
            result, snapshot, build, delivery, min_delivered_fraction, current_policy_version
        )
    except Exception as exc:  # finalize never raises: the error is a masked record
        return _failed(result, rollout_id, snapshot, exc)


def _rebuild(
    snapshot: TokenCaptureSnapshot, rollout_id: str, output: list[Any], delivery: Delivery
) -> BuildResult:
    """The build of the snapshot, its main chain chosen by the record's final ``output``."""
    build = run_builder(snapshot, final_answer=output, delivery=delivery)
    if build.rollout_id != rollout_id:
        raise TokenCaptureError(
            f"source returned a snapshot of rollout {build.rollout_id!r} for {rollout_id!r}"
        )
    return build


def _attach(
    result: MutableMapping[str, Any],
    snapshot: TokenCaptureSnapshot,
    build: BuildResult,
    delivery: Delivery,
    min_delivered_fraction: float | None,
    current_policy_version: str | int | None,
) -> RolloutBuild:
    """Put the build on the record: its output (and segments) unless masked, then always
    its metrics and mask. The policy version lag counts from the record's own word on the
    current version unless ``current_policy_version`` gives one."""
    reasons = _mask_reasons(snapshot, build, min_delivered_fraction)
    if current_policy_version is None:
        current_policy_version = result.get(CURRENT_VERSION_KEY)
    summary = RolloutSummary.of_build(
        build,
        capture_incomplete=bool(snapshot.incomplete),
        mask_reasons=reasons,
        current_policy_version=current_policy_version,
    )
    if not reasons:
        result["response"]["output"] = list(build.output)
        if delivery == "segments":
            result[SEGMENTS_KEY] = [segment.as_dict() for segment in build.segments]
    _mark(result, bool(reasons), summary)
    return RolloutBuild(
        rollout_id=build.rollout_id,
        status="masked" if reasons else "ok",
        snapshot_id=snapshot.snapshot_id,
        version=snapshot.version,
        summary=summary,
    )


def _failed(
    result: Any, rollout_id: Any, snapshot: TokenCaptureSnapshot | None, exc: Exception
) -> RolloutBuild:
    """The masked build of a failure, with its kind; the snapshot (if any) stays as it is."""
    error = f"{type(exc).__name__}: {exc}"
    kind = _error_kind(exc)
    log.warning("token capture of rollout %s not delivered (%s): %s", rollout_id, kind, error)
    incomplete = bool(snapshot.incomplete) if snapshot is not None else None
    summary = RolloutSummary.of_failure(error, f"{kind} error: {error}", incomplete)
    _mark(result, True, summary)
    return RolloutBuild(
        rollout_id=rollout_id if isinstance(rollout_id, str) else None,
        status="failed",
        snapshot_id=snapshot.snapshot_id if snapshot is not None else "",
        version=snapshot.version if snapshot is not None else 0,
        summary=summary,
        error=error,
        error_kind=kind,
    )


def _mask_reasons(
    snapshot: TokenCaptureSnapshot, build: BuildResult, min_fraction: float | None
) -> list[str]:
    reasons = []
    if snapshot.incomplete:
        detail = "; ".join(getattr(snapshot, "incomplete_reasons", ()) or ())
        reasons.append("incomplete capture" + (f": {detail}" if detail else ""))
    reasons.extend(build.mask_reasons)
    routed = {entry.routed_experts is not None for entry in snapshot.entries}
    if len(routed) > 1:
        # Routes were turned on or off while the rollout ran: a replay would miss some.
        reasons.append("routed experts captured for some calls only")
    if min_fraction is not None and build.delivered_fraction < min_fraction and not reasons:
        reasons.append(
            f"delivered fraction {build.delivered_fraction:.3f} is below "
            f"min_delivered_fraction {min_fraction}"
        )
    return reasons


async def retire_rollout_token_capture(
    rollout_id: str, source: Any, built: RolloutBuild | None
) -> bool:
    """Drop exactly the snapshot a successful build used; False if anything changed.

    Masked, failed or skipped builds are never retired: their capture stays for inspection.
    Errors of the source propagate, so the caller can retry the retire.
    """
    if built is None or not built.ok or built.rollout_id != rollout_id:
        return False
    dropped = await _maybe_await(
        source.drop(rollout_id, snapshot_id=built.snapshot_id, version=built.version)
    )
    return bool(dropped)


class MaskFractionExceeded(TokenCaptureError):
    """Too many rollouts were masked: capture is losing calls, so training would be biased."""


class MaskFractionGuard:
    """Counts masked rollouts and raises once their fraction exceeds ``max_fraction``.

    Nothing is judged before ``min_samples`` rollouts were seen, so one early loss does not
    stop a run. ``max_fraction=None`` disables the check (``max_mask_fraction: null``).
    """

    def __init__(self, max_fraction: float | None, min_samples: int = 1) -> None:
        if max_fraction is not None and not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be within [0, 1], got {max_fraction}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.max_fraction = max_fraction
        self.min_samples = min_samples
        self.seen = 0
        self.masked = 0

    @property
    def fraction(self) -> float:
        return self.masked / self.seen if self.seen else 0.0

    def observe(self, masked: bool) -> None:
        self.seen += 1
        self.masked += bool(masked)
        if self.max_fraction is None or self.seen < self.min_samples:
            return
        if self.fraction > self.max_fraction:
            raise MaskFractionExceeded(
                f"{self.masked} of {self.seen} rollouts were masked ({self.fraction:.1%}), "
                f"above max_mask_fraction {self.max_fraction:.1%}; token capture is losing "
                "calls: check the capture sink and that the harness uses the capture base URL"
            )

    def observe_record(self, record: Mapping[str, Any]) -> None:
        """Observe a finalized record by its top-level ``mask_sample``."""
        self.observe(bool(record.get(MASK_KEY, False)))
