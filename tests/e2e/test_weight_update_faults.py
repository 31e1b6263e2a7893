"""Weight updates under load (issue 33): loops keep running while the weights change.

Twenty-four streamed tool loops through a faithful front end to a paced engine, a weight
update (pause in abort mode, new version, resume) every 1.5 s, judged against the engine's
ground truth (``tests.support.update_loops``). With cut calls continued, the harnesses see
no error, no rollout is masked, no decoded token is thrown away and every delivered span
names the version that sampled it; with continuation off, the same run shows what the
updates cost: retryable errors (in a stream already relayed, its error event), and the cut
tokens thrown away.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fault_loops import Rollout
from tests.support.update_loops import run_updates

pytestmark = pytest.mark.slow
LOOPS = 24


def _rollouts(name: str) -> list[Rollout]:
    return [Rollout(f"{name}-{n}", 5 + n % 4) for n in range(LOOPS)]


async def test_loops_through_weight_updates_lose_nothing(tmp_path: Path) -> None:
    on = await run_updates(tmp_path / "on", _rollouts("resume"), resume=True)
    print(on.row("resume on"))
    off = await run_updates(tmp_path / "off", _rollouts("no-resume"), resume=False)
    print(off.row("resume off"))
    for run in (on, off):
        assert run.outcome.critical == [], "\n".join(run.outcome.critical)
        assert run.cut_records > 0 and run.versions_wrong == 0  # the updates did cut calls
    # Off, a relayed stream that is cut ends with the dialect's error event, which the SDK
    # does not retry: every loop may give up at the first update, ending the run.
    assert on.updates >= 2 and off.updates >= 1
    assert on.outcome.statuses.keys() == {200} and on.outcome.failed_loops == 0
    assert on.outcome.masked == 0 and on.calls_continued > 0
    assert on.tokens_thrown_away == 0
    assert off.calls_continued == 0 and off.tokens_thrown_away > 0
