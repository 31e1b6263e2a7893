"""Calls the store acknowledged and no longer holds, read off the entries' stamps.

Each entry carries the count of its rollout's puts the storing process had acknowledged
before it (``capture.acked``). Every acknowledged put was stamped lower than any entry stamped
after it, so an entry stamped ``n`` by a process needs ``n`` entries of that process stamped
lower beside it; fewer means some were lost from the store while the harness ran (its
rollout deleted or evicted, and the next put made it anew). This is the capture's own
evidence, independent of the harness's history: a conversation seeded with turns the
policy never sampled is no loss. Entries without a stamp (older captures, another front
end) are not held against the rollout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from capture.acked import acked_stamp
from capture.records import TokenEntry


def lost_calls(entries: Iterable[TokenEntry]) -> list[str]:
    """A mask reason per storing process that lost acknowledged calls (none: nothing lost)."""
    counts: dict[str, list[int]] = defaultdict(list)
    for entry in entries:
        stamp = acked_stamp(entry)
        if stamp is not None:
            counts[stamp[0]].append(stamp[1])
    reasons = []
    for worker, stamped in counts.items():
        stamped.sort()
        # Sorted, the first entry stamped ``count`` has ``lower`` entries stamped below it
        # (equal stamps were in flight together and are no evidence for each other).
        short = next(((count, lower) for lower, count in enumerate(stamped) if count > lower), None)
        if short is not None:
            count, lower = short
            reasons.append(
                f"calls missing: front-end process {worker} had {count} of this rollout's "
                f"calls stored before one it stored later, and {lower} of them are in the "
                "capture (calls lost from the store while the harness ran: its rollout "
                "deleted or evicted, or a Redis back without its data)"
            )
    return reasons
