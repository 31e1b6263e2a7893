"""What ``inspect()`` tells an operator about one rollout: the same fields from every store.

Counts and state only, never entries, and nothing changes by reading them. ``tokcap
inspect`` shows the fields in this order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Inspection:
    rollout_id: str
    state: str = "absent"  # absent | open | frozen | retired
    calls: int = 0  # entries stored
    pending_intents: int = 0  # begun, and neither put, voided nor unreceived
    unreceived: int = 0  # calls whose reply the harness never got
    prompt_tokens_max: int = 0
    generated_tokens: int = 0
    version: int = 0
    snapshot_id: str = ""  # "" until frozen
    incomplete: bool = False  # a loss was marked; pending intents aside
    tombstone: bool = False  # retired: only the frozen state is left

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_name(*, exists: bool, frozen: bool, retired: bool) -> str:
    """The ``state`` field: absent, retired (a tombstone), frozen or open."""
    if not exists:
        return "absent"
    if retired:
        return "retired"
    return "frozen" if frozen else "open"
