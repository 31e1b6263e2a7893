"""Tool loops through weight updates: what the updates cost with and without continuation.

Runs the same loops twice through a faithful front end to a paced Qwen3 tokcap engine,
a weight update (pause in abort mode, new version, resume) every ``--every`` seconds:
once with cut calls continued on the new weights (``resume_cut_calls``, the default), once
without (each cut call fails retryably and the SDK resends it). Each row counts, from the
engine's ground truth, the harness-visible errors, the replies cut, the calls continued,
the decoded tokens no delivered call holds and the delivered spans whose version is not
the one that sampled them. Figures, never a test assertion.

    .venv/bin/python -m bench.bench_updates --loops 200       # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from tests.support.fault_loops import Rollout
from tests.support.update_loops import run_updates


async def main(loops: int, every_s: float, token_s: float) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for name, resume in (("resume on", True), ("resume off", False)):
            rollouts = [Rollout(f"{name[-3:].strip()}-{n}", 5 + n % 4) for n in range(loops)]
            run = await run_updates(
                Path(scratch) / name.replace(" ", "-"),
                rollouts,
                resume=resume,
                every_s=every_s,
                token_s=token_s,
            )
            print(run.row(name), flush=True)
            for problem in run.outcome.critical[:5]:
                print(f"  critical: {problem}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between updates")
    parser.add_argument("--token-s", type=float, default=0.04, help="the engine's pace")
    args = parser.parse_args()
    asyncio.run(main(args.loops, args.every, args.token_s))
