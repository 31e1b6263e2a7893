"""The file store's writer thread: a call's small writes, batched and group-committed.

Each write a model call makes (its intent, its entry, a void or a loss) is a few
microseconds of file work. Handed to a thread pool one by one, each paid far more in the
hand-off: a pool job, a wake-up, the lock every thread of the pool contends for, and a
wake-up of the event loop per reply (about 0.15 ms of CPU a write at 1,000 calls in
flight). One thread instead takes every write waiting, runs them in turn inside a
``SyncGroup`` (one round of parallel syncs for the batch, ``capture.filestore.commit``),
and answers each event loop once per batch.

A write whose rollout is locked elsewhere (a freeze, another process) is handed to the
store's thread pool, where it may wait without holding up the rest. The thread ends after
a second without work and starts again with the next write.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from capture.filestore.commit import LockBusy, SyncGroup
from capture.filestore.crew import SyncCrew

BATCH = 64  # writes committed together at most, so the first of a burst is not kept long
IDLE_S = 1.0  # the thread ends after this long without work


@dataclass
class _Write:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]


class GroupWriter:
    """Runs writes on one thread in group-committed batches; see the module docstring."""

    def __init__(
        self,
        sync_dir: Callable[[str], None],
        waiting: ThreadPoolExecutor,
        sync_threads: int,
        name: str = "tokcap-filestore",
    ) -> None:
        self._sync_dir = sync_dir
        self._waiting = waiting  # where a write whose lock is busy waits for it
        self._sync_threads = sync_threads
        self._name = name
        self._closed = False
        self._start_afresh()

    def _start_afresh(self) -> None:
        """No thread, nothing queued: at start, and in a child forked with a writer (the
        fork copies the thread's state, not the thread)."""
        self._pid = os.getpid()
        self._syncs = SyncCrew(self._sync_threads, f"{self._name}-sync")
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._starting = threading.Lock()  # taken only to start or end the thread
        self.thread: threading.Thread | None = None  # the thread while it runs

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the writer thread; its result once its batch is durable."""
        if self._closed:
            raise RuntimeError("the writer is closed")
        if self._pid != os.getpid():
            self._start_afresh()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Write(loop, future, fn, args))
        if self.thread is None:
            with self._starting:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                    self.thread.start()
        return await future

    def close(self) -> None:
        """Take no more writes; those queued still run, then the thread ends."""
        with self._starting:
            self._closed = True
            if self.thread is None:
                self._syncs.shutdown()
            else:
                self._queue.put(None)  # wakes the thread to end

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch:
                self._run_batch(batch)
                continue
            with self._starting:
                # A write queued after the wait timed out, before this, is still taken.
                if self._queue.empty():
                    self.thread = None
                    if self._closed:
                        self._syncs.shutdown()
                    return

    def _next_batch(self) -> list[_Write]:
        """Every write waiting, up to ``BATCH``, after waiting up to ``IDLE_S`` for one."""
        try:
            first = self._queue.get(timeout=IDLE_S)
        except queue.Empty:
            return []
        batch = [first] if first is not None else []
        while len(batch) < BATCH:
            try:
                write = self._queue.get_nowait()
            except queue.Empty:
                break
            if write is not None:
                batch.append(write)
        return batch

    def _run_batch(self, batch: list[_Write]) -> None:
        """Run the batch in one group; answer each loop once, after the commit. A write
        whose rollout is locked elsewhere goes to the pool, and is answered from there."""
        outcomes: dict[int, tuple[bool, Any]] = {}
        busy: list[_Write] = []
        try:
            with SyncGroup(self._sync_dir, self._syncs) as group:
                for index, write in enumerate(batch):
                    group.owner = index
                    try:
                        outcomes[index] = (True, write.fn(*write.args))
                    except LockBusy:
                        busy.append(write)
                    except BaseException as exc:
                        outcomes[index] = (False, exc)
            outcomes.update((index, (False, error)) for index, error in group.failed.items())
        except BaseException as exc:  # not known durable: every write of the batch failed
            outcomes = {index: (False, exc) for index in range(len(batch))}
            busy = []
        answers: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]]
        answers = {}
        for index, (ok, value) in outcomes.items():
            write = batch[index]
            answers.setdefault(write.loop, []).append((write.future, ok, value))
        for loop, answered in answers.items():
            _call_soon(loop, _settle, answered)
        for write in busy:
            try:
                waited = self._waiting.submit(write.fn, *write.args)
            except RuntimeError as exc:  # the store closed meanwhile
                _call_soon(write.loop, _settle, [(write.future, False, exc)])
                continue
            waited.add_done_callback(
                lambda done, write=write: _call_soon(write.loop, _copy, done, write.future)
            )


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop closed meanwhile: nobody waits for the answer


def _settle(answers: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in answers:
        if future.done():
            continue  # its caller stopped waiting (a timeout); the write happened all the same
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _copy(done: Future[Any], future: asyncio.Future[Any]) -> None:
    if future.done():
        return
    error = done.exception()
    if error is None:
        future.set_result(done.result())
    else:
        future.set_exception(error)
