"""What ``tokcap demo`` shows of its rollouts: each one checked against what the engine
sampled, a table of them, what its columns mean, and one summary line.

Why a module of its own: the demo's driving and serving code reads top to bottom without
the presentation, and the table is where a first run learns the vocabulary (turns and
calls, chains, delivered, masked), so its notes say what each column means.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.table import Table
from rich.text import Text

from capture import step_metrics

# Below this delivered fraction most sampled tokens did not reach the trainer: flagged.
LOW_DELIVERY = 0.5
LOW_MARK = "!"


@dataclass
class Row:
    """One rollout as the demo drove it, its rebuilt record, and what the checks found."""

    rollout_id: str
    step: int
    serving: str  # the front end's prompts mode: faithful or text
    turns: int  # model requests the harness sent in its loop
    edits_answer: bool = False  # the harness changed its final answer before returning it
    record: dict[str, Any] = field(default_factory=dict)
    ids_exact: bool | None = False  # None: nothing was delivered (masked)
    retokenized_wrong: int = 0
    sampled_tokens: int = 0
    truth: list[dict[str, Any]] = field(default_factory=list)  # what the engine sampled


def _carriers(record: dict[str, Any]) -> list[dict[str, Any]]:
    output = (record.get("response") or {}).get("output") or []
    return [i for i in output if isinstance(i, dict) and "generation_token_ids" in i]


def check(row: Row, engine: httpx.Client) -> None:
    """Delivered ids vs the engine's sampled ids; and what re-tokenizing the text gets wrong."""
    sampled = {(tuple(g["prompt_token_ids"]), tuple(g["token_ids"])): g for g in row.truth}
    carriers = _carriers(row.record)
    if row.record.get("mask_sample") and not carriers:
        row.ids_exact = None  # masked: nothing was delivered, so nothing can be wrong
    else:
        row.ids_exact = bool(carriers) and all(
            (key := (tuple(c["prompt_token_ids"]), tuple(c["generation_token_ids"]))) in sampled
            and sampled[key]["logprobs"] == c["generation_log_probs"]
            for c in carriers
        )
    for call in row.truth:
        text = engine.post("/detokenize", json={"tokens": call["token_ids"]}).json()["prompt"]
        again = engine.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
            "tokens"
        ]
        matcher = difflib.SequenceMatcher(a=call["token_ids"], b=again, autojunk=False)
        matched = sum(block.size for block in matcher.get_matching_blocks())
        row.retokenized_wrong += len(call["token_ids"]) - matched
        row.sampled_tokens += len(call["token_ids"])


def short_reasons(reasons: list[str]) -> str:
    """Mask reasons without their details: each reason's head, before the first colon.

    ``incomplete capture: call c-7: marked incomplete`` becomes ``incomplete capture``; the
    call ids and errors stay in the record (and in ``--json``).
    """
    heads = dict.fromkeys(reason.split(": ", 1)[0].strip() for reason in reasons)
    return "; ".join(head for head in heads if head) or "-"


def _delivered_cell(fraction: float) -> Text:
    if fraction < LOW_DELIVERY:
        return Text(f"{fraction:.2f} {LOW_MARK}", style="bold yellow")
    return Text(f"{fraction:.2f}  ")


def _ids_cell(row: Row) -> str:
    if row.ids_exact is None:
        return "-"
    return "yes" if row.ids_exact else "NO"


COLUMNS = (
    "rollout",
    "serving",
    "turns",
    "calls",
    "chains",
    "delivered",
    "mask",
    "why masked",
    "ids = sampled",
    "re-tokenized wrong",
)
_LEFT = ("rollout", "serving", "why masked")
_WRAPS = {"why masked": 22, "ids = sampled": 7, "re-tokenized wrong": 12}  # max widths
EDITED = "+edit"  # serving label suffix of a rollout whose harness edits its final answer


def table(rows: list[Row], backend: str) -> Table:
    shown = Table(title=f"tokcap demo: {len(rows)} rollouts, rebuilt via {backend}")
    for name in COLUMNS:
        shown.add_column(
            name,
            justify="left" if name in _LEFT else "right",
            # Free text and long headers wrap; ids and numbers stay on one line.
            no_wrap=name not in _WRAPS,
            max_width=_WRAPS.get(name),
        )
    for row in rows:
        metrics = metrics_of(row)
        shown.add_row(
            row.rollout_id,
            row.serving + (EDITED if row.edits_answer else ""),
            str(row.turns),
            str(metrics.get("n_calls", "-")),
            str(metrics.get("chains", "-")),
            _delivered_cell(metrics.get("delivered_fraction", 0.0)),
            "yes" if row.record.get("mask_sample") else "no",
            short_reasons(metrics.get("mask_reasons") or []),
            _ids_cell(row),
            f"{row.retokenized_wrong} of {row.sampled_tokens}",
        )
    return shown


def notes(rows: list[Row]) -> str:
    """What the table's columns and marks mean; the edit and low-delivery marks only when
    they show."""
    said = [
        "serving: the front end's prompts mode (README: Prompts: text or faithful). Both front "
        "ends call one engine, which now and then samples a segmentation that is not the "
        "tokenizer's canonical one, as real engines do. faithful: the front end builds each "
        "prompt from the ids sampled before, so the rollout stays one chain. text: the engine "
        "re-renders the history as text; where that is not the sampled ids the chain splits, "
        "and the split is reported (chains, delivered), never delivered wrong.",
        "turns: model requests the harness sent in its loop. calls: the calls the capture "
        "recorded for the rollout (n_calls); equal when each request reached the capture once "
        "(a resend would add a call). chains: runs of calls whose prompts extend each other's "
        "ids; the main one is delivered.",
        "delivered: share of the rollout's sampled tokens delivered for training "
        "(delivered_fraction).",
    ]
    if any(r.edits_answer for r in rows):
        said.append(
            f"faithful{EDITED}: faithful serving, but the harness edits its final answer before "
            "returning it, so no call produced that answer and the rollout is masked."
        )
    said += [
        "ids = sampled: every token-bearing item equals a sequence the engine sampled (ids "
        "and log-probs); - when the rollout is masked and nothing was delivered.",
        "re-tokenized wrong: sampled ids that detokenize + tokenize of the same text does not "
        "reproduce.",
        "why masked: the record's _ng_token_capture.mask_reasons, without call ids and "
        "details (--json has them whole). A masked rollout is left out of the loss.",
    ]
    if any(metrics_of(r).get("delivered_fraction", 0.0) < LOW_DELIVERY for r in rows):
        said.append(
            f"{LOW_MARK} delivered below {LOW_DELIVERY}: most sampled tokens did not reach the "
            "trainer (they are in chains that were not delivered, or the rollout was masked)."
        )
    return "\n".join(said)


def summary(rows: list[Row]) -> str:
    """The line a first run is judged by: the masked share and the delivered fraction, of
    all rollouts and by serving, from ``capture.step_metrics`` as a trainer would log them."""
    every = step_metrics([row.record for row in rows], prefix="")
    steps = len({row.step for row in rows})
    by_serving = ", ".join(
        f"{serving} {_mean_delivered([r for r in rows if r.serving == serving])}"
        for serving in dict.fromkeys(row.serving for row in rows)
    )
    captured, delivered = every["tokens/captured"], every["tokens/delivered"]
    return (
        f"summary: {len(rows)} rollouts over {steps} steps; masked {every['masked']:.0f} "
        f"({every.get('masked_fraction', 0.0):.0%}); delivered fraction of unmasked rollouts "
        f"{_mean_delivered(rows)} mean, {_stat(every, 'delivered_fraction/p10')} p10 "
        f"({by_serving}); {delivered:.0f} of {captured:.0f} sampled tokens delivered "
        f"({delivered / captured if captured else 0.0:.0%})"
    )


def _mean_delivered(rows: list[Row]) -> str:
    return _stat(step_metrics([row.record for row in rows], prefix=""), "delivered_fraction/mean")


def _stat(metrics: dict[str, float], key: str) -> str:
    """A statistic, or - where it has nothing to be taken over (every rollout masked)."""
    return f"{metrics[key]:.2f}" if key in metrics else "-"


def metrics_of(row: Row) -> dict[str, Any]:
    return row.record.get("_ng_token_capture") or {}


def json_rows(rows: list[Row]) -> str:
    return json.dumps(
        [
            {
                "rollout_id": r.rollout_id,
                "step": r.step,
                "serving": r.serving,
                "edits_answer": r.edits_answer,
                "turns": r.turns,
                "metrics": r.record.get("_ng_token_capture"),
                "mask_sample": r.record.get("mask_sample"),
                "ids_exact": r.ids_exact,
                "retokenized_wrong": r.retokenized_wrong,
                "sampled_tokens": r.sampled_tokens,
            }
            for r in rows
        ]
    )
