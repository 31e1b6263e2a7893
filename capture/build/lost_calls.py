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

from bisect import bisect_left
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
        # Entries stamped equal were in flight together: only those stamped lower are the
        # evidence a stamp asks for.
        short = [(c, bisect_left(stamped, c)) for c in set(stamped) if bisect_left(stamped, c) < c]
        if short:
            count, lower = min(short)
            reasons.append(
                f"calls missing: front-end process {worker} had {count} of this rollout's "
                f"calls stored before one it stored later, and {lower} of them are in the "
                "capture (calls lost from the store while the harness ran: its rollout "
                "deleted or evicted, or a Redis back without its data)"
            )
    return reasons
