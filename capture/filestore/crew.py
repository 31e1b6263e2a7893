"""The threads that run a group commit's syncs in parallel (``capture.filestore.commit``).

A batch of writes owes one ``fdatasync`` per log it touched, and syncs of different logs in
parallel cost the file system about one. A ``ThreadPoolExecutor`` ran them at first, but
its per-job future (a condition, a lock, a work item) cost more CPU than the sync itself
asks of Python (about 40 µs a call at 1,000 calls in flight, ``bench_serving``). Here a job
is a tuple on a queue and its answer a tuple on the batch's own queue: both C-level
``SimpleQueue`` operations. The committing thread runs the first sync itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

Job = Callable[[], None]
# A job, the queue its answer goes to, and its place in the batch.
_Task = tuple[Job, "queue.SimpleQueue[tuple[int, BaseException | None]]", int]


class SyncCrew:
    """Up to ``size`` daemon threads, started as batches need them, that run jobs."""

    def __init__(self, size: int, name: str) -> None:
        self.size = max(size, 1)
        self.name = name
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards starting threads, handing out jobs, shutdown
        self._closed = False

    def errors_of(self, jobs: Sequence[Job]) -> list[BaseException | None]:
        """Run ``jobs`` at once (the first on this thread) and return what each raised.
        ``RuntimeError`` when the crew is shut down and several jobs would need it."""
        errors: list[BaseException | None] = [None] * len(jobs)
        if len(jobs) > 1:
            answers: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()
            with self._lock:
                if self._closed:
                    raise RuntimeError("the sync crew is shut down")
                self._grow(len(jobs) - 1)
                for index in range(1, len(jobs)):
                    self._tasks.put((jobs[index], answers, index))
        if jobs:
            errors[0] = error_of(jobs[0])
        for _ in range(len(jobs) - 1):
            index, error = answers.get()
            errors[index] = error
        return errors

    def shutdown(self) -> None:
        """Take no more jobs; each thread ends once the jobs handed out before are done."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._tasks.put(None)

    def _grow(self, wanted: int) -> None:
        while len(self._threads) < min(wanted, self.size):
            thread = threading.Thread(
                target=self._serve, name=f"{self.name}_{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            job, answers, index = task
            answers.put((index, error_of(job)))


def error_of(job: Job) -> BaseException | None:
    """What ``job`` raised, or None."""
    try:
        job()
    except BaseException as exc:
        return exc
    return None
