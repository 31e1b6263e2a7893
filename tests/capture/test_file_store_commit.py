"""The file store's group commit: a batch of calls' writes, durable before any is answered."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import threading
from pathlib import Path

import pytest

from capture.filestore import writer as writer_module
from capture.filestore.commit import SyncGroup, active_group
from capture.filestore.crew import SyncCrew
from capture.filestore.log import fsync_dir
from capture.filestore.store import FileTokenStore
from tests.support.fixtures_stores import make_token_entry


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def lockable(path: Path) -> bool:
    """Whether another holder could take the log's lock now."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def syncs(monkeypatch) -> list[str]:
    """The path of every log ``fdatasync``ed and every directory ``fsync``ed, in order."""
    done: list[str] = []
    real_datasync, real_sync = os.fdatasync, os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (done.append(fd_path(fd)), real_datasync(fd)))
    monkeypatch.setattr(os, "fsync", lambda fd: (done.append(fd_path(fd)), real_sync(fd)))
    return done


def test_a_group_syncs_each_log_once_at_commit_holding_its_lock_till_then(tmp_path, syncs):
    store = FileTokenStore(tmp_path)
    crew = SyncCrew(4, "test-sync")
    logs = [tmp_path / f"r{n}.log" for n in range(6)]
    with SyncGroup(fsync_dir, crew) as group:
        assert active_group() is group
        for n in range(6):
            group.owner = n
            store._intent(f"r{n}", "c-1", "intent")
            store._put(make_token_entry(f"r{n}", "c-1"))
        assert syncs == []  # nothing synced yet, so nothing may be answered yet
        assert not any(lockable(log) for log in logs)  # and nobody else reads it meanwhile
    assert active_group() is None
    assert sorted(syncs) == sorted([str(tmp_path)] + [str(log) for log in logs])
    assert all(lockable(log) for log in logs) and group.failed == {}
    reopened = FileTokenStore(tmp_path)
    assert all(reopened._peek(f"r{n}")[0].model_call_id == "c-1" for n in range(6))
    crew.shutdown()


def test_a_second_write_to_a_log_of_the_group_commits_the_first(tmp_path, syncs):
    store = FileTokenStore(tmp_path)
    with SyncGroup(fsync_dir, SyncCrew(2, "test-sync")) as group:
        store._put(make_token_entry("r", "c-1"))
        assert syncs == []
        group.owner = 1
        store._put(make_token_entry("r", "c-2"))  # would wait for its own lock forever
        assert sorted(syncs) == [str(tmp_path), str(tmp_path / "r.log")]
    assert syncs[2:] == [str(tmp_path / "r.log")]
    assert [e.model_call_id for e in FileTokenStore(tmp_path)._peek("r")] == ["c-1", "c-2"]


async def test_a_failed_sync_fails_its_call_alone_and_cuts_its_record(tmp_path, monkeypatch):
    store = FileTokenStore(tmp_path)
    await asyncio.gather(*(store.put(make_token_entry(f"r{n}", "c-0")) for n in range(3)))
    sizes = [(tmp_path / f"r{n}.log").stat().st_size for n in range(3)]
    real = os.fdatasync

    def failing(fd: int) -> None:
        if fd_path(fd).endswith("r1.log"):
            raise OSError(errno.EIO, "simulated I/O error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    results = await asyncio.gather(
        *(store.put(make_token_entry(f"r{n}", "c-1")) for n in range(3)), return_exceptions=True
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], OSError) and results[1].errno == errno.EIO
    assert (tmp_path / "r1.log").stat().st_size == sizes[1]  # cut off again
    assert (tmp_path / "r0.log").stat().st_size > sizes[0]
    monkeypatch.setattr(os, "fdatasync", real)
    await store.put(make_token_entry("r1", "c-1"))  # the retry lands
    reopened = FileTokenStore(tmp_path)
    assert [e.model_call_id for e in await reopened.peek("r1")] == ["c-0", "c-1"]
    await store.close()
    await reopened.close()


async def test_a_rollout_locked_elsewhere_holds_up_only_its_own_write(tmp_path):
    store = FileTokenStore(tmp_path)
    await store.put(make_token_entry("held", "c-0"))
    fd = os.open(tmp_path / "held.log", os.O_RDWR)  # as another process's freeze would
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        held = asyncio.ensure_future(store.put(make_token_entry("held", "c-1")))
        await asyncio.wait_for(store.put(make_token_entry("free", "c-1")), 10)
        await asyncio.sleep(0.1)
        assert not held.done()
    finally:
        os.close(fd)
    await asyncio.wait_for(held, 10)
    assert [e.model_call_id for e in await store.peek("held")] == ["c-0", "c-1"]
    await store.close()


async def test_writes_waiting_for_the_writer_go_out_as_one_batch(tmp_path, monkeypatch):
    store = FileTokenStore(tmp_path)
    first_runs, release = threading.Event(), threading.Event()
    groups: list[object] = []

    def stalled() -> None:
        first_runs.set()
        release.wait(10)

    def write(n: int) -> int:
        groups.append(active_group())
        store._put(make_token_entry(f"r{n}", "c-1"))
        return n

    stall = asyncio.ensure_future(store._write(stalled))
    await asyncio.get_running_loop().run_in_executor(None, first_runs.wait, 10)
    waiting = [asyncio.ensure_future(store._write(write, n)) for n in range(10)]
    await asyncio.sleep(0.05)
    release.set()
    assert await asyncio.gather(stall, *waiting) == [None, *range(10)]
    assert len(groups) == 10 and all(group is groups[0] for group in groups)
    await store.close()


async def test_the_writer_thread_ends_when_idle_and_starts_again(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "IDLE_S", 0.05)
    store = FileTokenStore(tmp_path)

    await store.put(make_token_entry("r", "c-1"))
    first = store._writer.thread
    assert first is not None and first.is_alive()
    first.join(5)
    assert not first.is_alive() and store._writer.thread is None
    await store.put(make_token_entry("r", "c-2"))
    assert store._writer.thread is not None and store._writer.thread is not first
    assert [e.model_call_id for e in await store.peek("r")] == ["c-1", "c-2"]
    await store.close()


async def test_a_write_whose_caller_stopped_waiting_still_lands(tmp_path):
    store = FileTokenStore(tmp_path)
    release = threading.Event()
    stall = asyncio.ensure_future(store._write(release.wait, 10))
    put = asyncio.ensure_future(store.put(make_token_entry("r", "c-1")))
    await asyncio.sleep(0.05)
    put.cancel()
    release.set()
    await stall
    await store.put(make_token_entry("r", "c-2"))  # after the cancelled one, on one thread
    assert [e.model_call_id for e in await store.peek("r")] == ["c-1", "c-2"]
    await store.close()


async def test_a_child_forked_with_a_running_writer_writes_through_its_own(tmp_path):
    store = FileTokenStore(tmp_path)
    await store.put(make_token_entry("parent", "c-1"))  # the parent's writer thread runs
    assert store._writer.thread is not None
    pid = os.fork()
    if pid == 0:  # the child: the copied writer has no thread behind it
        code = 1
        try:
            asyncio.run(asyncio.wait_for(store.put(make_token_entry("child", "c-1")), 10))
            code = 0
        finally:
            os._exit(code)
    _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [e.model_call_id for e in await store.peek("child")] == ["c-1"]
    await store.close()
