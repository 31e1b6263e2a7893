"""File-store specifics: several writer processes, crash recovery, paths, bytes on disk."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.errors import InvalidRolloutIdError, RolloutFrozenError, TokenCaptureError
from capture.filestore.log import frame, parse
from capture.filestore.store import FileTokenStore
from tests.support.fixtures_stores import make_token_entry, shared_entry
from tests.support.rollouts import growing_rollout

REPO = Path(__file__).resolve().parents[2]
WRITER = """
import asyncio, sys
from capture.filestore.store import FileTokenStore
from tests.support.rollouts import growing_rollout
from tests.support.fixtures_stores import shared_entry

async def main(directory, writer, count):
    store = FileTokenStore(directory)
    own = growing_rollout(f"own-{writer}", count, system_tokens=300, seed=writer)
    for index in range(count):
        await store.put(shared_entry(writer, index))
        await store.put(own[index])
    await store.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""

CRASH_TURNS = 120
CRASHING_WRITER = f"""
import asyncio, os, sys
CRASH_TURNS = {CRASH_TURNS}
from capture.filestore.store import FileTokenStore
from tests.support.rollouts import growing_rollout

async def main(directory, acks_path):
    store = FileTokenStore(directory)
    acks = os.open(acks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for entry in growing_rollout("crash", CRASH_TURNS, system_tokens=1000):
        await store.put(entry)
        os.write(acks, (entry.model_call_id + "\\n").encode())  # only after put returned
    await asyncio.sleep(60)  # a fast child still waits for its kill

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def start_python(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stderr:
        proc.stderr.close()


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


async def test_several_writer_processes(tmp_path):
    directory = tmp_path / "captures"
    writers, count = 4, 25
    procs = [start_python(WRITER, str(directory), str(w), str(count)) for w in range(writers)]
    try:
        for proc in procs:
            assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        for proc in procs:
            stop(proc)
    store = FileTokenStore(directory)
    shared = await store.freeze("shared")
    assert not shared.incomplete
    want = {(w, i): shared_entry(w, i) for w in range(writers) for i in range(count)}
    assert len(shared.entries) == len(want)
    for entry in shared.entries:
        expected = want[(entry.writer, int(entry.model_call_id.split("-c")[1]))]
        assert entry.model_dump() == expected.model_dump()
    for writer in range(writers):
        own = await store.freeze(f"own-{writer}")
        expected = growing_rollout(f"own-{writer}", count, system_tokens=300, seed=writer)
        assert [e.model_dump() for e in own.entries] == [e.model_dump() for e in expected]
    assert (await store.inspect("shared"))["version"] == len(want) + 1
    # Writers raced to store the shared prefix; each block is still stored once.
    records, _ = parse((directory / "shared.log").read_bytes())
    names = [
        block[0] for _, record in records if record["k"] == "put" for block in record["blocks"]
    ]
    assert len(names) == len(set(names))


async def test_acknowledged_entries_survive_a_killed_writer(tmp_path):
    directory = tmp_path / "captures"
    acks_path = tmp_path / "acks"
    proc = start_python(CRASHING_WRITER, str(directory), str(acks_path))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if acks_path.exists() and acks_path.read_text().count("\n") >= 20:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)  # mid put loop, likely mid write
        proc.wait(timeout=30)
    finally:
        stop(proc)
    acknowledged = acks_path.read_text().split()
    assert len(acknowledged) >= 20

    # Whatever the kill hit, also leave a torn final record, as a crash mid-write would.
    log_path = directory / "crash.log"
    torn = frame({"k": "put", "call": "torn", "body": b"x" * 5000})
    with open(log_path, "ab") as log:
        log.write(torn[: len(torn) // 2])
    torn_size = log_path.stat().st_size

    store = FileTokenStore(directory)
    late = make_token_entry("crash", "after-crash")
    await store.put(late)  # recovery truncates the torn tail before appending
    snapshot = await store.freeze("crash")
    data = log_path.read_bytes()
    assert len(data) < torn_size + 200_000
    assert parse(data)[1] == len(data)  # no torn bytes left anywhere in the log
    expected = {
        e.model_call_id: e for e in growing_rollout("crash", CRASH_TURNS, system_tokens=1000)
    }
    expected["after-crash"] = late
    stored = {e.model_call_id: e for e in snapshot.entries}
    assert set(acknowledged) <= stored.keys()
    # At most one put finished its fsync without getting to write its ack.
    assert len(stored) - 1 - len(acknowledged) in (0, 1)
    for call_id, entry in stored.items():
        assert entry.model_dump() == expected[call_id].model_dump()
    assert "torn" not in stored


def _cut_tail(record: bytes) -> bytes:
    return record[: len(record) - 3]


def _bad_checksum(record: bytes) -> bytes:
    return record[:-1] + bytes([record[-1] ^ 0xFF])


@pytest.mark.parametrize(
    "tail",
    [_cut_tail, _bad_checksum, lambda record: record[:5], lambda record: b"\0" * 4096],
    ids=["cut-payload", "bad-checksum", "cut-frame", "zeros"],
)
async def test_torn_tail_is_recovered_on_open(tmp_path, tail):
    directory = tmp_path / "captures"
    store = FileTokenStore(directory)
    first = make_token_entry("torn", "c-1", prompt=list(range(700)))
    await store.put(first)
    await store.close()
    log_path = directory / "torn.log"
    good_size = log_path.stat().st_size
    with open(log_path, "ab") as log:
        log.write(tail(frame({"k": "intent", "call": "never-acknowledged"})))

    reopened = FileTokenStore(directory)
    info = await reopened.inspect("torn")
    assert info["calls"] == 1 and info["pending_intents"] == 0
    assert log_path.stat().st_size == good_size
    second = make_token_entry("torn", "c-2", prompt=list(range(900)))
    await reopened.put(second)
    snapshot = await reopened.freeze("torn")
    assert [e.model_dump() for e in snapshot.entries] == [first.model_dump(), second.model_dump()]
    assert not snapshot.incomplete


@pytest.mark.parametrize(
    "bad_id", ["../outside", "..", "/etc/passwd", "a/../../b", ".hidden", "x\n", "a\0b"]
)
async def test_invalid_ids_never_touch_paths_outside_the_directory(tmp_path, bad_id):
    directory = tmp_path / "captures"
    store = FileTokenStore(directory)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    operations = [
        lambda: store.put(make_token_entry(bad_id, "c-1")),
        lambda: store.mark_incomplete(bad_id),
        lambda: store.begin_call(bad_id, "c-1"),
        lambda: store.void_call(bad_id, "c-1"),
        lambda: store.freeze(bad_id),
        lambda: store.drop(bad_id, snapshot_id="s", version=1),
        lambda: store.delete(bad_id),
        lambda: store.inspect(bad_id),
    ]
    for operation in operations:
        with pytest.raises(InvalidRolloutIdError):
            await operation()
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert await store.rollouts() == []


async def test_bytes_on_disk_grow_with_the_final_context(tmp_path):
    directory = tmp_path / "captures"
    store = FileTokenStore(directory)
    entries = growing_rollout("grow", 50)  # 2,000 system tokens; 200 generated + 300 tool/turn
    for entry in entries:
        await store.put(entry)
    final = entries[-1]
    raw = 4 * (len(final.prompt_token_ids) + len(final.generation_token_ids)) + 8 * sum(
        len(entry.generation_log_probs) for entry in entries
    )
    stored = disk_bytes(directory)
    assert stored <= 1.5 * raw, f"{stored} bytes on disk for {raw} raw bytes"
    snapshot = await store.freeze("grow")
    assert [e.model_dump() for e in snapshot.entries] == [e.model_dump() for e in entries]


async def test_two_store_instances_stay_coherent(tmp_path):
    """Each instance caches what it read; another writer's changes must still be seen."""
    directory = tmp_path / "captures"
    a, b = FileTokenStore(directory), FileTokenStore(directory)
    await a.put(make_token_entry("both", "c-1", prompt=list(range(300))))
    await b.put(make_token_entry("both", "c-2", prompt=list(range(400))))
    await a.put(make_token_entry("both", "c-3", prompt=list(range(500))))
    snapshot = await b.freeze("both")
    assert [e.model_call_id for e in snapshot.entries] == ["c-1", "c-2", "c-3"]
    with pytest.raises(RolloutFrozenError):
        await a.put(make_token_entry("both", "c-4"))
    assert await a.drop("both", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    with pytest.raises(RolloutFrozenError):
        await b.put(make_token_entry("both", "c-5"))
    await b.delete("both")
    fresh = make_token_entry("both", "c-6", prompt=list(range(300)))
    await a.put(fresh)
    again = await b.freeze("both")
    assert [e.model_dump() for e in again.entries] == [fresh.model_dump()]
    assert (await a.inspect("both"))["state"] == "frozen"


async def test_state_survives_reopening(tmp_path):
    directory = tmp_path / "captures"
    store = FileTokenStore(directory)
    await store.put(make_token_entry("kept", "c-1"))
    await store.begin_call("kept", "c-2")
    snapshot = await store.freeze("kept")
    await store.close()
    reopened = FileTokenStore(directory)
    again = await reopened.freeze("kept")
    assert (again.snapshot_id, again.version, again.incomplete) == (
        snapshot.snapshot_id,
        snapshot.version,
        True,
    )
    assert await reopened.drop("kept", snapshot_id=again.snapshot_id, version=again.version)
    await reopened.close()
    third = FileTokenStore(directory)
    with pytest.raises(RolloutFrozenError):
        await third.put(make_token_entry("kept", "c-3"))
    assert (await third.inspect("kept"))["tombstone"] is True


async def test_relative_directory_is_resolved_and_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = FileTokenStore("nested/captures")
    assert store.dir == tmp_path / "nested" / "captures"
    assert store.dir.is_dir()
    await store.put(make_token_entry("rel", "c-1"))
    assert await store.rollouts() == ["rel"]


async def test_foreign_files_in_the_directory_are_ignored(tmp_path):
    directory = tmp_path / "captures"
    store = FileTokenStore(directory)
    (directory / "notes.txt").write_text("not a log")
    (directory / ".hidden.log").write_text("not a rollout")
    await store.put(make_token_entry("real", "c-1"))
    assert await store.rollouts() == ["real"]
    assert await store.sweep_tombstones(older_than_s=0) == 0


async def test_closed_store_refuses_work(tmp_path):
    store = FileTokenStore(tmp_path / "captures")
    await store.close()
    with pytest.raises(TokenCaptureError):
        await store.put(make_token_entry("closed", "c-1"))
    with pytest.raises(TokenCaptureError):
        await store.freeze("closed")


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(min_value=0, max_value=2), max_size=23), min_size=1, max_size=12
    ),
    reopen_at=st.integers(min_value=0, max_value=12),
)
def test_stored_blocks_round_trip_any_prompt_family(prompts, reopen_at):
    """Shared, branching, shrinking and partially extended prompts all read back exactly.

    A tiny alphabet and block size make prompts share prefixes and partial blocks often;
    reopening midway checks that a fresh fold of the log agrees with the cached one.
    """

    async def scenario(directory: str) -> None:
        store = FileTokenStore(directory, block_size=4, fsync=False)
        entries = []
        for index, prompt in enumerate(prompts):
            if index == reopen_at:
                await store.close()
                store = FileTokenStore(directory, block_size=4, fsync=False)
            entry = make_token_entry("family", f"c-{index:02d}", prompt=prompt)
            entries.append(entry)
            await store.put(entry)
        snapshot = await FileTokenStore(directory, block_size=4).freeze("family")
        assert [e.model_dump() for e in snapshot.entries] == [e.model_dump() for e in entries]

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(scenario(directory))


async def test_drops_sweep_old_tombstones_once_an_interval(tmp_path):
    """Tombstones expire without an operator: a drop sweeps those past the TTL."""
    store = FileTokenStore(tmp_path / "captures", tombstone_ttl_s=0.05)

    async def retire(rollout_id: str) -> None:
        await store.put(make_token_entry(rollout_id, "c-1"))
        snapshot = await store.freeze(rollout_id)
        assert await store.drop(
            rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version
        )

    await retire("old")
    await asyncio.sleep(0.1)
    await retire("new")  # within the interval: no sweep yet
    assert await store.rollouts() == ["new", "old"]
    store._next_sweep = 0.0  # the interval has passed
    await retire("newer")
    left = await store.rollouts()
    assert "old" not in left and "newer" in left
    await store.close()


async def test_an_intent_is_seen_at_once_and_made_durable_by_the_write_after_it(
    tmp_path, monkeypatch
):
    """An intent is read by every process at once; its own fsync would only repeat the one
    of the write that follows it before any reply (the entry, or a void)."""
    directory = tmp_path / "captures"
    writer, freezer = FileTokenStore(directory), FileTokenStore(directory)
    await writer.put(make_token_entry("r", "c-0"))  # the log exists: no head to write
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    await writer.begin_call("r", "c-1")
    assert synced == []
    await writer.put(make_token_entry("r", "c-1"))
    assert len(synced) == 1  # the entry's fdatasync, which flushes the intent before it
    await writer.begin_call("r", "c-2")
    await writer.void_call("r", "c-2")
    assert len(synced) == 2  # a void is durable itself, and so is the intent it follows
    await writer.begin_call("r", "c-3")
    snapshot = await freezer.freeze("r")  # another store's freeze sees the intent
    assert snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == ["c-0", "c-1"]
