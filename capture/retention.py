"""How long a store keeps what a rollout leaves behind when nobody deletes it.

A tombstone (what remains after drop) must outlive late writers and re-runs of the rollout's
rebuild job, so a late put still fails and a re-run still finds its publish guard: a week.
A frozen rollout that is never retired (a masked one, kept as evidence) is kept a month.
"""

from __future__ import annotations

TOMBSTONE_TTL_S = 7 * 24 * 3600
EVIDENCE_TTL_S = 30 * 24 * 3600
