"""``tokcap serve`` (one worker) under cProfile, for a bench to say where the time goes.

Run as a script in place of ``python -m tokcap.commands.serve``: it profiles the worker's
event-loop thread, where every request is parsed, translated, forwarded and answered (the
store's fsyncs run on its own threads and are not in the profile), and writes the stats to
``OUT`` when the server exits. ``summary`` reads them back: own CPU grouped by package (this
repository's modules by file) and the functions that cost most. cProfile adds its own cost
per Python call, so the shares travel and the absolute seconds do not.

    python bench/profiled_serve.py OUT.prof --config ... --upstream ... --port ...
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent) + "/"


def _where(path: str, function: str) -> str:
    """A profile row's file: a package's, this repository's (its path), a builtin, stdlib."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if path.startswith(ROOT):
        return path[len(ROOT) :]
    if path == "~":
        return "builtin " + function.strip("<>").split(" of ")[0]
    return "stdlib " + Path(path).stem


def _group(where: str) -> str:
    """A package, one of this repository's rooms (``api/engine``), builtins, the stdlib."""
    if where.startswith("builtin "):
        return "builtins"
    if where.startswith("stdlib "):
        return "stdlib"
    return where.rsplit("/", 1)[0] if where.endswith(".py") else where


def summary(path: str | Path, calls: int, top: int = 12) -> list[str]:
    """Lines: own CPU per model call by group, then the costliest functions."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    groups: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    for (file, line, function), (_, _, own, _, _) in stats.items():
        where = _where(file, function)
        groups[_group(where)] += own
        functions[f"{where}:{line} {function}"] += own
    total = sum(groups.values())
    lines = [f"profiled event-loop CPU: {total * 1000 / max(calls, 1):.2f} ms a call"]
    for title, table in (("by package or room", groups), ("by function", functions)):
        lines.append(f"  {title} (share of the profiled CPU):")
        for name, seconds in table.most_common(top):
            lines.append(f"    {seconds / total:6.1%}  {name}")
    return lines


def _from_the_first_request(profile: cProfile.Profile) -> None:
    """Turn the profile on when uvicorn starts serving its first request, so start-up (the
    imports, the sink, the engine's questions) is left out."""
    import uvicorn.protocols.http.h11_impl as h11
    import uvicorn.protocols.http.httptools_impl as httptools

    started = False

    def start() -> None:
        nonlocal started
        if not started:
            started = True
            profile.enable()

    for module in (httptools, h11):
        cycle = module.RequestResponseCycle
        run_asgi = cycle.run_asgi

        async def profiled(self: Any, app: Any, _run: Any = run_asgi) -> None:
            start()
            await _run(self, app)

        cycle.run_asgi = profiled  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    out, serve_args = argv[0], argv[1:]
    # The event loop's thread CPU, not the wall clock: waiting in epoll costs nothing.
    profile = cProfile.Profile(time.thread_time)
    atexit.register(lambda: (profile.disable(), profile.dump_stats(out)))
    # uvicorn raises the SIGTERM it caught again once it has shut down: exit through atexit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _from_the_first_request(profile)
    from tokcap.commands.serve import main as serve

    return serve(serve_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
