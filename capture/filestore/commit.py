"""Group commit: the writes of many calls made durable by one round of syncs.

A writer thread (``capture.filestore.writer``) runs a batch of small writes inside a
``SyncGroup``. A durable append inside the group writes its record at once but leaves its
``fdatasync`` to the group, and keeps the log's lock (a duplicate of its descriptor holds
the ``flock``), so no other writer or reader sees the log before it is durable, exactly as
when the append syncs itself. ``commit`` then syncs every log of the batch in parallel
(plus the directory once, for the logs it created) and only then releases the locks;
nothing of the batch is acknowledged before that. A sync that fails cuts its record off
again, as a failed append does, and the call that wrote it gets the error.

Inside a group a lock is taken without waiting (``LockBusy`` when another holds it), so a
rollout locked elsewhere cannot hold up the writes of every other rollout.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from capture.filestore.crew import Job, SyncCrew, error_of

_active = threading.local()


class LockBusy(Exception):
    """The log's lock is held elsewhere; the write goes to a thread that may wait for it."""


@dataclass
class _Pending:
    """A log appended to without its sync: the descriptor that holds its lock, where the
    unsynced bytes start, and the call (its index in the batch) they belong to."""

    fd: int
    path: str
    start: int
    owner: int

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except BaseException:
            # Leave no unacknowledged record behind; if even this fails, a reader truncates.
            try:
                os.ftruncate(self.fd, self.start)
            except OSError:
                pass
            raise


@dataclass
class SyncGroup:
    """The syncs a batch of writes owes, and which of its calls failed for want of them."""

    sync_dir: Callable[[str], None]
    crew: SyncCrew
    owner: int = 0  # the call of the batch running now
    failed: dict[int, BaseException] = field(default_factory=dict)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _dirs: dict[str, list[int]] = field(default_factory=dict)

    def __enter__(self) -> SyncGroup:
        _active.group = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        _active.group = None
        self.commit()

    def holds(self, path: str) -> bool:
        return path in self._pending

    def defer(self, fd: int, path: str, start: int) -> None:
        """Leave the sync of ``path``'s bytes from ``start`` to the commit, keeping its lock
        (a second append under the same lock is synced with the first)."""
        if path not in self._pending:
            self._pending[path] = _Pending(os.dup(fd), path, start, self.owner)

    def defer_dir(self, directory: str) -> None:
        """Leave the sync of a new directory entry to the commit."""
        self._dirs.setdefault(directory, []).append(self.owner)

    def commit(self) -> None:
        """Sync everything deferred, in parallel, cut off what failed, release the locks."""
        pending, dirs = list(self._pending.values()), dict(self._dirs)
        self._pending.clear()
        self._dirs.clear()
        jobs: list[Job] = [item.sync for item in pending]
        jobs += [functools.partial(self.sync_dir, d) for d in dirs]
        owners = [[item.owner] for item in pending] + list(dirs.values())
        try:
            errors = self._errors_of(jobs)
        finally:
            for item in pending:
                os.close(item.fd)  # the last descriptor: the lock goes with it
        for error, failed_owners in zip(errors, owners, strict=True):
            if error is not None:
                for owner in failed_owners:
                    self.failed.setdefault(owner, error)

    def _errors_of(self, jobs: list[Job]) -> list[BaseException | None]:
        """Run the syncs, in parallel where there are several; what each one raised."""
        try:
            return self.crew.errors_of(jobs)
        except RuntimeError:  # the sync threads are shut down: sync one after another
            return [error_of(job) for job in jobs]


def active_group() -> SyncGroup | None:
    """The group this thread's writes belong to, if any."""
    return getattr(_active, "group", None)
