"""Where a model call's CPU goes inside the front end: thread CPU per step, in the server.

Run as a script in place of ``python -m tokcap.commands.serve`` (``bench_frontend --steps``
does, for this tree and for a baseline checkout alike): it wraps the functions each step of
a call runs in with ``time.thread_time``, and each whole call (uvicorn's ``run_asgi``) with
the event loop thread's and the process's CPU. When the server exits it writes the seconds
per step, the totals and the calls seen to ``OUT`` as JSON, captured and untagged model
calls apart (captured: the path has the capture prefix). A bench sends one call at a time,
so the work of the store's threads belongs to the call being served. A step's time excludes
the probed steps it calls, so the steps add up; what no probe covers (the HTTP server and
client protocols, the middleware, the event loop, thread hops) is the rest. Probes whose
function a checkout lacks are skipped: the same script measures a baseline whose modules
differ.

    python bench/frontend_steps.py OUT.json --config ... --upstream ... --port ...
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# (module, attribute, step, kind). ``sync``: a function timed on its own thread, nested
# probes subtracted. ``async``: a coroutine timed on the event loop's thread across its
# awaits (a bench sends one call at a time, so little else runs meanwhile); it must not
# contain sync probes. ``inner``: JSON coding, counted to the step that called it, or to
# its own step when called outside any.
PROBES: list[tuple[str, str, str, str]] = [
    ("api.call.serve", "parse_json_object", "parse request JSON", "sync"),
    ("api.dialects.anthropic", "to_chat", "translate (dialect)", "sync"),
    ("api.dialects.chat", "to_chat", "translate (dialect)", "sync"),
    ("api.dialects.responses", "to_chat", "translate (dialect)", "sync"),
    ("api.call.serve", "request_traits", "request traits", "sync"),
    ("api.engine.client", "UpstreamClient._chat_body", "engine body", "async"),
    ("api.jsonbytes", "dumps", "encode engine body", "inner"),
    ("api.engine.http", "EngineHTTP._post_once", "engine send/receive", "async"),
    ("api.engine.client", "loads_with_ids", "decode engine reply", "sync"),
    ("api.jsonbytes", "loads", "decode engine reply", "inner"),
    ("api.engine.vllm", "VLLM.read_chat", "read ids + checks", "sync"),
    ("api.call.capture", "output_items", "entry (items, fields)", "sync"),
    ("api.call.capture", "call_entry", "entry (items, fields)", "sync"),
    ("capture.filestore.store", "encode_entry", "pack + hash (codec)", "sync"),
    ("capture.filestore.store", "FileTokenStore._put", "store put (file, fsync)", "sync"),
    ("capture.filestore.store", "FileTokenStore._intent", "intent (file, fsync)", "sync"),
    ("api.dialects.anthropic", "reply", "reply", "sync"),
    ("api.dialects.chat", "reply", "reply", "sync"),
    ("api.dialects.responses", "reply", "reply", "sync"),
    ("api.call.serve", "JSONBytesResponse", "reply", "sync"),
]
# The whole call as uvicorn runs it, from its request head to its reply: each call's count,
# its event-loop thread CPU and the process's CPU (every thread), captured when its path
# carries the capture prefix.
CALLS = [
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.run_asgi"),
    ("uvicorn.protocols.http.h11_impl", "RequestResponseCycle.run_asgi"),
]
CAPTURE_PREFIX = "/ng-rollout/"

_seconds: dict[str, Counter[str]] = {"captured": Counter(), "untagged": Counter()}
_calls: Counter[str] = Counter()
_totals: dict[str, Counter[str]] = {"captured": Counter(), "untagged": Counter()}
_off_loop: Counter[str] = Counter()  # per bucket: the steps' seconds on other threads
_serving = ["untagged"]  # the bucket of the call uvicorn is running now
_local = threading.local()  # per thread: the stack of [step, seconds spent in probes below]


def _bucket() -> str:
    """The bucket of the call being served: a store's worker thread may not carry the
    call's context, but a bench sends one call at a time."""
    return _serving[0]


def _stack() -> list[list[Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _sync(fn: Callable[..., Any], step: str, inner: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def probed(*args: Any, **kwargs: Any) -> Any:
        stack = _stack()
        if inner and stack:
            return fn(*args, **kwargs)  # the caller's step counts it
        frame = [step, 0.0]
        stack.append(frame)
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            stack.pop()
            bucket = _bucket()
            _seconds[bucket][step] += spent - frame[1]
            if threading.current_thread() is not threading.main_thread():
                _off_loop[bucket] += spent - frame[1]
            if stack:
                stack[-1][1] += spent

    return probed


def _async(fn: Callable[..., Any], step: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def probed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return await fn(*args, **kwargs)
        finally:
            _seconds[_bucket()][step] += time.thread_time() - started

    return probed


def _whole_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def probed(cycle: Any, *args: Any, **kwargs: Any) -> Any:
        if cycle.scope.get("method") != "POST":  # a readiness check, not a model call
            return await fn(cycle, *args, **kwargs)
        path = str(cycle.scope.get("path", ""))
        bucket = "captured" if path.startswith(CAPTURE_PREFIX) else "untagged"
        _serving[0] = bucket
        thread, process = time.thread_time(), time.process_time()
        try:
            return await fn(cycle, *args, **kwargs)
        finally:
            _totals[bucket]["loop thread"] += time.thread_time() - thread
            _totals[bucket]["process"] += time.process_time() - process
            _calls[bucket] += 1

    return probed


def _resolve(module: str, attribute: str) -> tuple[Any, str, Any] | None:
    """(owner, name, function) of ``module.attribute``, or None where this checkout lacks it."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError:
        return None
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    target = getattr(owner, name, None) if owner is not None else None
    return None if target is None else (owner, name, target)


def install() -> list[str]:
    """Wrap every probe this checkout has; the probes installed, as module:attribute."""
    installed = []
    for module, attribute, step, kind in PROBES:
        found = _resolve(module, attribute)
        if found is None:
            continue
        owner, name, target = found
        if kind == "async" or (kind == "sync" and inspect.iscoroutinefunction(target)):
            wrapped = _async(target, step)
        else:
            wrapped = _sync(target, step, inner=kind == "inner")
        if inspect.isclass(owner):
            wrapped = staticmethod(wrapped) if _is_static(owner, name) else wrapped
        setattr(owner, name, wrapped)
        installed.append(f"{module}:{attribute}")
    for module, attribute in CALLS:
        found = _resolve(module, attribute)
        if found is not None:
            setattr(found[0], found[1], _whole_call(found[2]))
    return installed


def _is_static(owner: type, name: str) -> bool:
    return isinstance(inspect.getattr_static(owner, name), staticmethod)


def _write(out: str, installed: list[str]) -> None:
    report = {
        bucket: {
            "calls": _calls[bucket],
            "seconds": dict(_seconds[bucket]),
            "totals": dict(_totals[bucket]),
            "off_loop": _off_loop[bucket],
        }
        for bucket in _seconds
    }
    report["probes"] = installed  # type: ignore[assignment]
    with open(out, "w", encoding="utf-8") as file:
        json.dump(report, file)


def main(argv: list[str]) -> int:
    out, serve_args = argv[0], argv[1:]
    installed = install()
    atexit.register(_write, out, installed)
    # uvicorn raises the SIGTERM it caught again once it has shut down: exit through atexit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from tokcap.commands.serve import main as serve

    return serve(serve_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
