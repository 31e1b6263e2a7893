"""The node-local file store: the default token sink, and a token source for one node.

Each rollout is one append-only log (``<dir>/<rollout_id>.log``, see ``capture.filestore.log``) of
small records: entries, intents, voids, lost-call marks and the freeze. Entries use the shared
codec, and a record carries only the blocks the rollout has not stored yet, so the
bytes on disk grow with the final context, not with turns x context. Every write is fsynced
before the call returns, but an intent: it is read by every process at once, and durable
with the next write to its log, which comes before any reply (the entry, a void, a lost
mark, the freeze), so its own fsync would only repeat that one's. The version is the
number of state changes, so any write that races a freeze leaves the frozen snapshot's
version behind and its drop fails. Dropping replaces the log by a tombstone (the frozen
state with ``snapshot_id`` and ``version``) so a late writer still sees the freeze;
tombstones are swept after ``tombstone_ttl_s``.

Blocking file work runs off the event loop so a model server keeps serving: a call's writes
on one writer thread, batched and group-committed (``capture.filestore.writer``), reads and
rare writes in a thread pool.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from capture.codec.entries import DEFAULT_BLOCK_SIZE, ChainMemo, encode_entry
from capture.errors import (
    ConflictingEntryError,
    RolloutFrozenError,
    RoutesPrefixError,
    TokenCaptureError,
)
from capture.filestore.log import LockedLog, frame, fsync_dir, fsync_new_entry, locked_log
from capture.filestore.policy import read_policy_version, write_policy_version
from capture.filestore.records import (
    RolloutState,
    entries_from_records,
    head_record,
    put_record,
    stored_entries,
)
from capture.filestore.writer import GroupWriter
from capture.inspection import Inspection, state_name
from capture.lineage import entry_with_key
from capture.reasons import (
    CONFLICTING_PAYLOAD,
    MARKED_INCOMPLETE,
    call_reason,
    incomplete_reasons,
)
from capture.records import TokenCaptureSnapshot, TokenEntry
from capture.retention import TOMBSTONE_TTL_S
from capture.rollout_ids import validate_rollout_id

LOG_SUFFIX = ".log"
_CACHED_ROLLOUTS = 1024
# Threads for the syncs of a group commit (concurrent fsyncs of different logs are cheap for
# the file system to batch), and as many for the reads, and for the writes that wait for a
# rollout's lock.
THREADS = 32
SWEEP_INTERVAL_S = 3600.0  # drops sweep old tombstones at most this often
_PEEK_BYTES = 1 << 20  # a tomb is small; a larger second record is an entry


@dataclass
class _Cached:
    """A rollout's folded state as of ``offset``, valid while the log starts with ``head``."""

    head: bytes
    offset: int
    state: RolloutState


class FileTokenStore:
    """Node-local, crash-safe, multi-process token store (sink and source)."""

    reads_packed_ids = True  # an entry's prompt may be PackedIds (capture.protocols)
    reads_chained_routes = True  # its routes may continue a stored prefix (capture.protocols)

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tombstone_ttl_s: float = TOMBSTONE_TTL_S,
        fsync: bool = True,
        threads: int = THREADS,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.dir = Path(dir).expanduser().resolve()
        self.block_size = block_size
        self._memo = ChainMemo()  # re-encodes only what a rollout's next call adds
        self.tombstone_ttl_s = tombstone_ttl_s
        self.fsync = fsync
        self._closed = False
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._next_sweep = 0.0  # monotonic time of the next sweep a drop runs
        # Its own threads: asyncio's default pool has cpu + 4 of them and also resolves
        # every engine connection's host name; fsyncs queued there would stall those.
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="tokcap-filestore")
        self._writer = GroupWriter(fsync_dir, self._threads, threads)
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            if fsync:
                fsync_dir(self.dir.parent)

    def __repr__(self) -> str:
        return f"FileTokenStore({str(self.dir)!r})"

    # -- sink ---------------------------------------------------------------------------

    async def put(self, entry: Any) -> None:
        """Record one call's entry; durable on return. See the module docstring."""
        return await self._write(self._put, TokenEntry.coerce(entry))

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably note a lost call; allowed after freeze and drop (it advances the version)."""
        await self._write(self._mark_incomplete, rollout_id, model_call_id)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durable intent before dispatch; an intent without an entry makes a freeze incomplete."""
        await self._write(self._intent, rollout_id, model_call_id, "intent")

    async def void_call(self, rollout_id: str, model_call_id: str) -> None:
        """Resolve the intent of a call that returned nothing (not a loss)."""
        await self._write(self._intent, rollout_id, model_call_id, "void")

    async def mark_unreceived(self, rollout_id: str, model_call_id: str) -> None:
        """Note that the harness never received this call's reply; refused after freeze."""
        await self._write(self._intent, rollout_id, model_call_id, "unreceived")

    async def find_call(self, rollout_id: str, lineage_key: str) -> TokenEntry | None:
        """The call whose entry carries ``lineage_key`` (faithful prompts); reads only."""
        return await self._run(self._find_call, rollout_id, lineage_key)

    async def set_policy_version(self, version: str) -> None:
        """Set the version every front end on this directory stamps new calls with."""
        await self._run(write_policy_version, self.dir, version)

    async def policy_version(self) -> str | None:
        """The version last set (None: never)."""
        return read_policy_version(self.dir)

    # -- source -------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Stop writes and return one consistent snapshot; idempotent while nothing changes."""
        return await self._run(self._freeze, rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly that snapshot, leaving a tombstone; False if anything changed.

        At most once per ``SWEEP_INTERVAL_S`` a drop also sweeps the tombstones older than
        ``tombstone_ttl_s``, so they expire without an operator's cron (as Redis expires
        them by TTL); ``sweep_tombstones`` still runs a sweep on demand.
        """
        dropped = await self._run(self._drop, rollout_id, snapshot_id, version)
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            await self.sweep_tombstones()
        return dropped

    # -- administration -----------------------------------------------------------------

    async def delete(self, rollout_id: str) -> None:
        """Remove everything of a rollout, tombstone included (administrative)."""
        await self._run(self._delete, rollout_id)

    async def sweep_tombstones(self, older_than_s: float | None = None) -> int:
        """Delete tombstones retired more than ``older_than_s`` (default: the TTL) ago."""
        ttl = self.tombstone_ttl_s if older_than_s is None else older_than_s
        return await self._run(self._sweep, ttl)

    async def inspect(self, rollout_id: str) -> dict[str, Any]:
        """A summary of a rollout's stored state, without changing it."""
        return await self._run(self._inspect, rollout_id)

    async def peek(self, rollout_id: str) -> list[TokenEntry]:
        """The entries stored now, by call id, for operators (``tokcap inspect``).

        Reads only: unlike ``freeze`` it stops no writes, so a running rollout goes on. A
        retired rollout's entries are gone, so it peeks as none.
        """
        return await self._run(self._peek, rollout_id)

    async def rollouts(self) -> list[str]:
        """Ids of every rollout with a log (open, frozen or tombstone)."""
        return await self._run(self._rollout_ids)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        with self._cache_lock:
            self._cache.clear()
        self._writer.close()  # writes queued or under way finish; none start
        self._threads.shutdown(wait=False)

    async def _run(self, fn: Any, *args: Any) -> Any:
        """Reads and rare writes, in the store's threads."""
        if self._closed:
            raise TokenCaptureError(f"{self!r} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def _write(self, fn: Any, *args: Any) -> Any:
        """A call's writes, on the writer thread, group-committed (``capture.filestore.writer``)."""
        if self._closed:
            raise TokenCaptureError(f"{self!r} is closed")
        return await self._writer.run(fn, *args)

    # -- work done under a rollout's lock, in a worker thread ---------------------------

    def _path(self, rollout_id: str) -> str:
        validate_rollout_id(rollout_id)
        directory = str(self.dir)
        path = os.path.join(directory, rollout_id + LOG_SUFFIX)
        # The id pattern already forbids separators and leading dots; this is the backstop.
        if os.path.dirname(path) != directory:
            raise ValueError(f"rollout id {rollout_id!r} escapes {directory}")
        return path

    def _load(
        self, rollout_id: str, log: LockedLog, everything: list[tuple[int, dict]] | None = None
    ) -> RolloutState:
        """The rollout's current state, reading only what was appended since last time
        (``everything``: the log's records, when the caller read them all anyway)."""
        with self._cache_lock:
            cached = self._cache.get(rollout_id)
        if cached is not None and (
            log.size < cached.offset or log.pread(len(cached.head), 0) != cached.head
        ):
            cached = None  # the log was replaced or deleted since (another process, a drop)
        start = cached.offset if cached else 0
        if everything is None:
            records = log.read_from(start)
        else:
            records = [item for item in everything if item[0] > start]
        state = cached.state if cached else RolloutState()
        for _, record in records:
            state.apply(record)
        if cached is None and records:
            cached = _Cached(head=log.pread(records[0][0], 0), offset=0, state=state)
        self._remember(rollout_id, log, cached)
        return state

    def _remember(self, rollout_id: str, log: LockedLog | None, cached: _Cached | None) -> None:
        with self._cache_lock:
            if cached is None or log is None:
                self._cache.pop(rollout_id, None)
                return
            cached.offset = log.size
            self._cache[rollout_id] = cached
            self._cache.move_to_end(rollout_id)
            while len(self._cache) > _CACHED_ROLLOUTS:
                self._cache.popitem(last=False)

    def _append(
        self,
        rollout_id: str,
        log: LockedLog,
        state: RolloutState,
        records: list[dict],
        durable: bool = True,
    ) -> None:
        """Append records (durably, unless told not to) and fold them into the state; a new
        log gets its head, and its directory entry is made durable either way."""
        head = head_record(rollout_id) if log.size == 0 else None
        log.append([head, *records] if head else records, durable=durable)
        if head and self.fsync:
            fsync_new_entry(str(self.dir))  # the new log's directory entry must survive too
        for record in records:
            state.apply(record)
        with self._cache_lock:
            cached = self._cache.get(rollout_id)
        if head:
            cached = _Cached(head=frame(head), offset=0, state=state)
        elif cached is None or cached.state is not state:
            cached = None  # evicted meanwhile; the next load reads the log again
        self._remember(rollout_id, log, cached)

    def _frozen_error(self, rollout_id: str, state: RolloutState) -> RolloutFrozenError:
        what = "retired" if state.retired else "frozen"
        return RolloutFrozenError(
            f"rollout {rollout_id} is {what} (snapshot {state.snapshot_id}); "
            "no call can be recorded after freeze"
        )

    def _put(self, entry: TokenEntry) -> None:
        path = self._path(entry.rollout_id)
        encoded = encode_entry(entry, self.block_size, self._memo)
        with locked_log(path, create=True, fsync=self.fsync) as log:
            assert log is not None
            state = self._load(entry.rollout_id, log)
            if state.frozen:
                raise self._frozen_error(entry.rollout_id, state)
            stored = state.calls.get(entry.model_call_id)
            if stored == encoded.digest:
                return
            if stored is not None:
                reason = call_reason(entry.model_call_id, CONFLICTING_PAYLOAD)
                self._append(
                    entry.rollout_id,
                    log,
                    state,
                    [{"k": "lost", "call": entry.model_call_id, "reason": reason}],
                )
                raise ConflictingEntryError(
                    f"rollout {entry.rollout_id}: call {entry.model_call_id} was put twice with "
                    "different payloads; the rollout is marked incomplete"
                )
            missing = [name for name in encoded.requires if name not in state.blocks]
            if missing:
                raise RoutesPrefixError(
                    f"rollout {entry.rollout_id}: call {entry.model_call_id}'s routes continue "
                    f"block {missing[0]}, which the rollout does not hold"
                )
            self._append(entry.rollout_id, log, state, [put_record(entry, encoded, state)])

    def _mark_incomplete(self, rollout_id: str, model_call_id: str) -> None:
        path = self._path(rollout_id)
        reason = call_reason(model_call_id, MARKED_INCOMPLETE)
        with locked_log(path, create=True, fsync=self.fsync) as log:
            assert log is not None
            state = self._load(rollout_id, log)
            self._append(
                rollout_id, log, state, [{"k": "lost", "call": model_call_id, "reason": reason}]
            )

    def _intent(self, rollout_id: str, model_call_id: str, kind: str) -> None:
        path = self._path(rollout_id)
        if not model_call_id:
            raise ValueError("model_call_id must not be empty")
        # A receipt mark may precede a put still in flight (the front end gave up waiting for
        # it), so it creates the log too.
        create = kind in ("intent", "unreceived")
        with locked_log(path, create=create, fsync=self.fsync) as log:
            if log is None:  # voiding a call of a rollout with no log: nothing to resolve
                return
            state = self._load(rollout_id, log)
            if kind == "void" and model_call_id not in state.pending_intents:
                return  # nothing to resolve, frozen or not
            if state.frozen:
                raise self._frozen_error(rollout_id, state)
            if kind == "intent" and (
                model_call_id in state.intents or model_call_id in state.calls
            ):
                return  # already recorded, or already resolved by its entry
            record = {"k": kind, "call": model_call_id}
            self._append(rollout_id, log, state, [record], durable=kind != "intent")

    def _freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        path = self._path(rollout_id)
        with locked_log(path, create=True, fsync=self.fsync) as log:
            assert log is not None
            records = log.read_from(0)  # parsed once, for the state and the entries
            state = self._load(rollout_id, log, records)
            if not state.frozen:
                freeze = {"k": "freeze", "snapshot_id": uuid.uuid4().hex, "at": time.time()}
                self._append(rollout_id, log, state, [freeze])
            entries = [] if state.retired else entries_from_records(r for _, r in records)
        reasons = incomplete_reasons(state.lost, state.pending_intents, state.retired)
        return TokenCaptureSnapshot(
            rollout_id=rollout_id,
            entries=tuple(sorted(entries, key=lambda entry: entry.model_call_id)),
            incomplete=bool(reasons),
            snapshot_id=state.snapshot_id,
            version=state.version,
            incomplete_reasons=tuple(reasons),
            unreceived=tuple(sorted(state.unreceived)),
        )

    def _find_call(self, rollout_id: str, lineage_key: str) -> TokenEntry | None:
        with locked_log(self._path(rollout_id), create=False, fsync=self.fsync) as log:
            if log is None:
                return None
            bodies, blocks = stored_entries(record for _, record in log.read_from(0))
        return entry_with_key(bodies, blocks, lineage_key)

    def _peek(self, rollout_id: str) -> list[TokenEntry]:
        with locked_log(self._path(rollout_id), create=False, fsync=self.fsync) as log:
            entries = self._read_entries(log) if log is not None else []
        return sorted(entries, key=lambda entry: entry.model_call_id)

    def _read_entries(self, log: LockedLog) -> list[TokenEntry]:
        return entries_from_records(record for _, record in log.read_from(0))

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        path = self._path(rollout_id)
        with locked_log(path, create=False, fsync=self.fsync) as log:
            if log is None:
                return False
            state = self._load(rollout_id, log)
            if not state.frozen or (state.snapshot_id, state.version) != (snapshot_id, version):
                return False
            if state.retired:
                return True
            head = head_record(rollout_id)
            # The tombstone keeps why the snapshot was incomplete; its intents are gone.
            lost = incomplete_reasons(state.lost, state.pending_intents, retired=False)
            tomb = {
                "k": "tomb",
                "snapshot_id": snapshot_id,
                "version": version,
                "lost": lost,
                "at": time.time(),
            }
            log.replace([head, tomb])
            self._remember(rollout_id, None, None)
            return True

    def _delete(self, rollout_id: str) -> None:
        path = self._path(rollout_id)
        with locked_log(path, create=False, fsync=self.fsync) as log:
            if log is not None:
                log.remove()
            self._remember(rollout_id, None, None)

    def _sweep(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        swept = 0
        for rollout_id in self._rollout_ids():
            with locked_log(self._path(rollout_id), create=False, fsync=self.fsync) as log:
                if log is None:
                    continue
                # A tombstone log starts head, tomb: read just that, not a whole open rollout.
                records = log.read_first(2, max_bytes=_PEEK_BYTES)
                tomb = records[1] if len(records) > 1 else {}
                if tomb.get("k") == "tomb" and tomb["at"] <= cutoff:
                    log.remove()
                    self._remember(rollout_id, None, None)
                    swept += 1
        return swept

    def _inspect(self, rollout_id: str) -> dict[str, Any]:
        path = self._path(rollout_id)
        with locked_log(path, create=False, fsync=self.fsync) as log:
            state = self._load(rollout_id, log) if log is not None else None
        exists = state is not None and (state.version > 0 or state.retired)
        state = state or RolloutState()
        return Inspection(
            rollout_id=rollout_id,
            state=state_name(exists=exists, frozen=state.frozen, retired=state.retired),
            calls=len(state.calls),
            pending_intents=len(state.pending_intents),
            unreceived=len(state.unreceived),
            prompt_tokens_max=state.prompt_tokens_max,
            generated_tokens=state.generated_tokens,
            version=state.version,
            snapshot_id=state.snapshot_id,
            incomplete=state.incomplete,
            tombstone=state.retired,
        ).as_dict()

    def _rollout_ids(self) -> list[str]:
        names = []
        for name in os.listdir(self.dir):
            if name.endswith(LOG_SUFFIX):
                rollout_id = name[: -len(LOG_SUFFIX)]
                try:
                    names.append(validate_rollout_id(rollout_id))
                except ValueError:
                    continue
        return sorted(names)


# The file store's name before it was FileTokenStore (issue 24), for callers that import it.
TokenCaptureStore = FileTokenStore
