"""A burst of large bodies at once: how many are served, how long it takes, what it costs.

Starts the tokcap engine and a front end (default settings, file store, one worker) as
child processes on 127.0.0.1 and sends ``--calls`` captured Anthropic Messages calls at
once, each with a body of about ``--body-kb`` KiB (300 KiB is a 102k-token request on the
engine's tokenizer; 400 KiB, 137k, is beyond its 131,072-token context, so every call gets
the engine's 400), every call its own rollout. Prints the answers by status, the wall
time, and the front end's resident memory before the burst and at its peak (sampled every
50 ms, and the kernel's high-water mark). ``--baseline-src DIR`` runs the same burst
against another checkout of the sources first (say ``git worktree add /tmp/base <commit>``),
so a change is measured against its baseline in one run. A figure, never a test assertion.

    .venv/bin/python -m bench.bench_bodies --calls 300 --body-kb 300 --baseline-src /tmp/base

Issue 35, item 1, at 7f0110b: 300 calls of 300 KiB, all 200 in 32 s, peak 412 MiB; 1,000
calls of 300 KiB (each about 100k tokens), all 200 in 110 s, peak 849 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_frontend import CONFIG
from tests.support.servers import free_port, run_process

WORDS = "hello world "  # about two tokens per 12 bytes on the engine's tokenizer


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB (Linux /proc)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0])
    return found


async def burst(front: str, calls: int, body_kb: int, pid: int) -> dict[str, object]:
    """Send every call at once; statuses, seconds and the peak RSS while they ran."""
    text = WORDS * (body_kb * 1024 // len(WORDS))
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    before = memory_kib(pid)["VmRSS"]
    peak = [before]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient, n: int) -> str:
        url = f"{front}/ng-rollout/bench-bodies-{n}/training-token-capture/v1/messages"
        try:
            return str((await client.post(url, json=body)).status_code)
        except httpx.HTTPError as exc:
            return type(exc).__name__

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], memory_kib(pid)["VmRSS"])
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        statuses = await asyncio.gather(*(one(client, n) for n in range(calls)))
    seconds = time.perf_counter() - started
    sampler.cancel()
    return {
        "statuses": dict(collections.Counter(statuses)),
        "seconds": seconds,
        "rss_before_mib": before / 1024,
        "rss_peak_mib": peak[0] / 1024,
        "hwm_mib": memory_kib(pid)["VmHWM"] / 1024,
    }


def run_setup(name: str, src: str | None, args: argparse.Namespace, tmp: Path) -> dict:
    config = tmp / f"{name}.yaml"
    config.write_text(CONFIG.format(dir=tmp / f"captures-{name}"))
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": src} if src else None
    engine = f"http://127.0.0.1:{free_port()}"
    front_port = free_port()
    front = f"http://127.0.0.1:{front_port}"
    engine_cmd = [sys.executable, "-m", "tokcap_devtools.engine.cli"]
    engine_cmd += ["--port", engine.rsplit(":", 1)[1]]
    front_cmd = [sys.executable, "-m", "tokcap.commands.serve", "--config", str(config)]
    front_cmd += ["--upstream", engine, "--port", str(front_port), "--log-level", "warning"]
    with (
        run_process(engine_cmd, ready_url=engine + "/health", env=env),
        run_process(front_cmd, ready_url=front + "/health", env=env) as front_proc,
    ):
        return asyncio.run(burst(front, args.calls, args.body_kb, front_proc.pid))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--body-kb", type=int, default=300)
    parser.add_argument("--baseline-src", help="another checkout's sources, run first")
    args = parser.parse_args()
    setups = [("before", args.baseline_src)] if args.baseline_src else []
    setups.append(("this", None))
    print(f"{args.calls} calls at once, {args.body_kb} KiB bodies, default front-end settings")
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in setups:
            found = run_setup(name, src, args, Path(tmp))
            print(
                f"{name:>7}: {found['statuses']}  {found['seconds']:.1f} s  front-end RSS "
                f"{found['rss_before_mib']:.0f} MiB before, peak {found['rss_peak_mib']:.0f} MiB "
                f"(high-water {found['hwm_mib']:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
