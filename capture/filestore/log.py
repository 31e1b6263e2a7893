"""An append-only, checksummed record log per file, locked across processes.

Each record is framed as magic, payload length and CRC32, so a reader can tell a complete
record from a torn one. A writer acknowledges only after the write and the fsync that follows
it, so a torn final record (a crash mid-write) was never acknowledged and may be dropped:
recovery truncates it away before anything new is appended.

Locks are ``flock`` on the log file itself, which holds between processes and between threads
of one process (each operation opens its own descriptor). A log is only ever replaced by
rename or removed while its lock is held, and a locker re-checks that the path still names
the file it locked, so nobody appends to a file that was retired or deleted. Inside a group
commit (``capture.filestore.commit``) a durable append leaves its sync to the group and keeps
its lock until then.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack

from capture.filestore.commit import LockBusy, active_group

log = logging.getLogger("tokcap.filelog")

MAGIC = b"\xc7T"
_FRAME = struct.Struct("<2sII")  # magic, payload length, crc32 of the payload
MAX_RECORD_BYTES = 1 << 30


def frame(record: dict[str, Any]) -> bytes:
    """One record as framed bytes."""
    payload = msgpack.packb(record, use_bin_type=True)
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def parse(data: bytes | memoryview, base: int = 0) -> tuple[list[tuple[int, dict]], int]:
    """Complete records in ``data`` as (end offset, record), and where the valid part ends.

    ``base`` is the file offset of ``data``. Parsing stops at the first frame that is cut
    short, has a wrong magic or checksum, or does not decode: everything from there on is a
    torn tail.
    """
    view = memoryview(data)
    records: list[tuple[int, dict]] = []
    pos = 0
    size = len(view)
    while pos + _FRAME.size <= size:
        magic, length, crc = _FRAME.unpack_from(view, pos)
        start = pos + _FRAME.size
        end = start + length
        if magic != MAGIC or length > MAX_RECORD_BYTES or end > size:
            break
        payload = view[start:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            record = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException):
            break
        if not isinstance(record, dict):
            break
        records.append((base + end, record))
        pos = end
    return records, base + pos


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a created, renamed or removed directory entry durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_new_entry(directory: str) -> None:
    """Make a new log's directory entry durable: now, or with this thread's group commit,
    which syncs the directory once for every log its batch created."""
    group = active_group()
    if group is None:
        fsync_dir(directory)
    else:
        group.defer_dir(directory)


@dataclass
class LockedLog:
    """A log file open under its exclusive lock; only valid inside ``locked_log``."""

    path: str
    fd: int
    size: int
    fsync: bool

    def pread(self, length: int, offset: int) -> bytes:
        chunks = []
        while length > 0:
            chunk = os.pread(self.fd, length, offset)
            if not chunk:
                break
            chunks.append(chunk)
            length -= len(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def read_from(self, offset: int) -> list[tuple[int, dict]]:
        """Records from ``offset`` to the end; a torn tail is truncated away first."""
        if offset >= self.size:
            return []
        data = self.pread(self.size - offset, offset)
        records, valid_end = parse(data, offset)
        if valid_end < self.size:
            self._truncate(valid_end)
        return records

    def read_first(self, count: int, max_bytes: int) -> list[dict]:
        """Up to ``count`` leading records, stopping at one larger than ``max_bytes``."""
        records: list[dict] = []
        offset = 0
        while len(records) < count and offset + _FRAME.size <= self.size:
            magic, length, _ = _FRAME.unpack(self.pread(_FRAME.size, offset))
            end = offset + _FRAME.size + length
            if magic != MAGIC or length > max_bytes or end > self.size:
                break
            found, _ = parse(self.pread(end - offset, offset), offset)
            if not found:
                break
            records.append(found[0][1])
            offset = end
        return records

    def _truncate(self, valid_end: int) -> None:
        # The lock is held, so the torn bytes belong to a writer that died mid-write; its
        # record was never acknowledged.
        log.warning(
            "%s: dropping a torn tail of %d bytes at offset %d",
            self.path,
            self.size - valid_end,
            valid_end,
        )
        os.ftruncate(self.fd, valid_end)
        if self.fsync:
            os.fsync(self.fd)
        self.size = valid_end

    def append(self, records: list[dict[str, Any]], *, durable: bool = True) -> None:
        """Append records; durable on return when the log fsyncs and ``durable`` is asked
        for (inside a group commit: when the group commits, and the lock is kept till then).
        Records appended without it are visible to every reader at once, and durable with
        the next durable append (``fdatasync`` flushes the whole file)."""
        data = b"".join(frame(record) for record in records)
        start = self.size
        group = active_group() if self.fsync and durable else None
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(self.fd, data[written:], start + written)
            if group is not None:
                group.defer(self.fd, self.path, start)
            elif self.fsync and durable:
                os.fdatasync(self.fd)
        except BaseException:
            # Leave no partial record behind; if even this fails, the next reader truncates.
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise
        self.size = start + len(data)

    def replace(self, records: list[dict[str, Any]]) -> None:
        """Atomically replace the file's content by ``records`` (write, fsync, rename)."""
        tmp = (
            self.path[: -len(".log")] + ".tmp" if self.path.endswith(".log") else self.path + ".tmp"
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = b"".join(frame(record) for record in records)
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self.fsync:
            fsync_dir(os.path.dirname(self.path))

    def remove(self) -> None:
        os.unlink(self.path)
        if self.fsync:
            fsync_dir(os.path.dirname(self.path))


@contextmanager
def locked_log(path: str, *, create: bool, fsync: bool = True) -> Iterator[LockedLog | None]:
    """Open ``path`` under an exclusive flock; yields None when it is absent and not created.

    Inside a group commit the lock is not waited for (``LockBusy``), and a log the group
    still holds is first committed.
    """
    group = active_group()
    if group is not None and group.holds(path):
        group.commit()
    how = fcntl.LOCK_EX | (fcntl.LOCK_NB if group is not None else 0)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            if create:
                raise
            yield None
            return
        try:
            fcntl.flock(fd, how)
            if _same_file(fd, path):
                break
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(path) from None
        except BaseException:
            os.close(fd)
            raise
        # Retired or deleted while we waited for the lock: start over on what the path names.
        os.close(fd)
    try:
        yield LockedLog(path=path, fd=fd, size=os.fstat(fd).st_size, fsync=fsync)
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _same_file(fd: int, path: str) -> bool:
    try:
        on_path = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_path.st_dev, on_path.st_ino)
