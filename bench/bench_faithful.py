"""How much of what the policy sampled reaches the trainer: text prompts vs faithful prompts.

Runs official-SDK tool loops (all three dialects, streamed and not, 6-10 tool-using turns,
thinking on most) against ``tokcap engine --tokenizer qwen3`` (the real Qwen3 vocabulary
and chat template) under each kind of drift real serving has, once with the engine
rendering the prompts (text) and once with the front end building them (faithful), in
one run. Each rollout is rebuilt from its final answer and judged against the engine's
ground truth (``tests.support.dialect_loops``):

- one chain: unmasked, one chain through every answered call, everything sampled delivered;
- delivered: sampled tokens in the delivered records / sampled tokens captured;
- wrong: an unmasked record whose delivered calls are not the answered calls as sampled.

    .venv/bin/python -m bench.bench_faithful --rollouts 50      # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capture.filestore.store import FileTokenStore
from tests.support.dialect_loops import Figures, Harness, judge, loops_for, run_loops, write_script
from tests.support.fault_loops import GroundTruth
from tests.support.frontend import engine_server, file_store_settings, front_end

# Serving configurations: engine knobs, and whether the harness adds a user note to each
# round of tool results (a new user query, before which Qwen3's template drops thinking).
SERVING: dict[str, tuple[dict[str, Any], bool]] = {
    "no knobs (the Qwen3 template alone)": ({}, False),
    "non-canonical sampling 5%": ({"noncanonical_rate": 0.05}, False),
    "past thinking dropped by the template": ({}, True),
    "tool-call JSON re-serialized": ({"json_reserialize": True}, False),
    "all three": ({"noncanonical_rate": 0.05, "json_reserialize": True}, True),
}
MODES = {"text": {}, "faithful": {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}}}


async def _figures(store_dir: Path, loops: list, truth: Path) -> Figures:
    store = FileTokenStore(store_dir)
    try:
        return await judge(store, loops, GroundTruth(truth))
    finally:
        await store.close()


def run_one(tmp: Path, serving: str, mode: str, rollouts: int, seed: int) -> tuple[Figures, Any]:
    """One row: a fresh engine and front end, ``rollouts`` loops, judged."""
    knobs, remind = SERVING[serving]
    work = Path(tempfile.mkdtemp(dir=tmp))
    truth = work / "truth.jsonl"
    engine = {
        "tokenizer_path": "qwen3",
        "script_path": write_script(work / "script.yaml"),
        "ground_truth_path": str(truth),
        "seed": seed,
        **knobs,
    }
    with engine_server(**engine) as engine_url:
        with front_end(file_store_settings(engine_url, work / "store", **MODES[mode])) as front:
            harness = Harness([front])
            loops = asyncio.run(run_loops(harness, loops_for(mode, rollouts, remind=remind)))
    return asyncio.run(_figures(work / "store", loops, truth)), harness.prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=50)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    print(f"{args.rollouts} rollouts per row, 6-10 turns, anthropic/chat/responses SDKs")
    print(
        "| serving | prompts | one chain, every call | sampled tokens delivered | wrong | masked | prompts built |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for serving in SERVING:
            for mode in MODES:
                started = time.perf_counter()
                figures, prompts = run_one(Path(tmp), serving, mode, args.rollouts, args.seed)
                built = ", ".join(f"{k} {v}" for k, v in sorted(prompts.items())) or "-"
                print(
                    f"| {serving} | {mode} | {figures.one_chain / figures.rollouts:.0%} | "
                    f"{figures.delivered_share:.1%} | {len(figures.wrong)} | {figures.masked} | "
                    f"{built} |  ({time.perf_counter() - started:.0f} s"
                    + (f", {len(figures.errors)} loop errors" if figures.errors else "")
                    + ")"
                )
                for problem in figures.wrong[:3] + figures.errors[:3]:
                    print(f"    {problem}")
    print("targets (faithful): >= 99% one chain with every call, >= 99% of tokens, 0 wrong")
    return 0


if __name__ == "__main__":
    sys.exit(main())
