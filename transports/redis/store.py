"""RedisTokenStore: the capture contract on Redis, one hash per rollout.

Every state change runs as an optimistic transaction on the rollout's hash: WATCH, read what
decides, MULTI ... EXEC; a refused EXEC means another writer changed the rollout first, so the
decision is made again on fresh state. Entries use the shared codec; a put sends only the
blocks the hash does not hold yet. Durability is proven once, before the first write,
and every write waits for it where the server needs a wait (WAITAOF / WAIT).

The same class is the sink a model server writes through (``RedisTokenSink``) and the source
a trainer freezes and drops through (``RedisTokenSource``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from capture.codec.entries import DEFAULT_BLOCK_SIZE, ChainMemo, encode_entry
from capture.errors import (
    ConfigError,
    ConflictingEntryError,
    RolloutFrozenError,
    TokenCaptureError,
)
from capture.reasons import CONFLICTING_PAYLOAD, MARKED_INCOMPLETE
from capture.records import TokenCaptureSnapshot, TokenEntry
from capture.retention import EVIDENCE_TTL_S, TOMBSTONE_TTL_S
from capture.rollout_ids import validate_rollout_id
from transports.redis import keys as k
from transports.redis.connections import ProvingConnections
from transports.redis.durability import Durability, check_durability
from transports.redis.records import snapshot_of, summary_of
from transports.redis.watch import Command, execute_raw, watching

T = TypeVar("T")
BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # the codec's; chosen so a whole block fits 1 KiB in Redis
_KNOWN_ROLLOUTS = 256  # rollouts whose block names a store remembers


class RedisUnavailableError(TokenCaptureError, ConnectionError):
    """Redis could not be reached within the bounded retries; nothing is assumed stored."""


class ContentionError(TokenCaptureError):
    """A write lost the WATCH race more times than allowed; it was not applied."""


@dataclass
class Plan:
    """What one transaction decided: writes to commit, then a result or an error to raise."""

    writes: list[Command] = field(default_factory=list)
    result: Any = None
    error: Exception | None = None
    again: bool = False  # what was read cannot decide (a stale cache): read again


def _int(value: bytes | None) -> int:
    return int(value) if value else 0


def _pairs(reply: Any) -> dict[bytes, bytes]:
    if isinstance(reply, dict):
        return dict(reply)
    return dict(zip(reply[0::2], reply[1::2], strict=True))


def server_name(client: aioredis.Redis) -> str:
    """Where a client connects, for messages: host and port or socket, never credentials."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"redis at {kwargs['path']}"
    return f"redis at {kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


class RedisTokenStore:
    """Token sink and source on Redis; see the module docstring for how it stays consistent.

    Keyword arguments only: ``url`` (``redis://``, ``rediss://`` for TLS, password in the URL)
    or ``client`` (an existing ``redis.asyncio.Redis``, left open on close); ``key_prefix``;
    ``durability`` ("fsync", "replicas:N" or "none"); ``tombstone_ttl_s``; ``evidence_ttl_s``
    (how long a frozen rollout that is never retired, such as a masked one, is kept; None
    keeps it until ``delete``); socket, connect and durability-wait timeouts; ``max_retries``
    on connection errors; ``max_connections`` and ``pool_timeout_s`` (a call waits that long
    for a free connection instead of failing); ``block_size`` (writers of one rollout share
    blocks only when they use the same; the payload digest does not depend on it). Nothing
    connects until first use, so the store can be built outside an event loop. Built from a
    ``url``, every new connection proves durability before it is used
    (``transports.redis.connections``); a ``client`` passed in is proven once, at start.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        client: aioredis.Redis | None = None,
        key_prefix: str = k.DEFAULT_PREFIX,
        durability: str = "fsync",
        tombstone_ttl_s: float = TOMBSTONE_TTL_S,
        evidence_ttl_s: float | None = EVIDENCE_TTL_S,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        wait_timeout_ms: int = 1000,
        max_retries: int = 3,
        max_watch_retries: int = 200,
        block_size: int = BLOCK_SIZE,
        max_connections: int = 100,
        pool_timeout_s: float = 10.0,
    ) -> None:
        if (url is None) == (client is None):
            raise ConfigError("RedisTokenStore needs exactly one of url= or client=")
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(  # the URL may carry a password: show its scheme only
                f"url must start with redis://, rediss:// or unix://, got {url.split(':')[0]!r}"
            )
        if client is not None and not hasattr(client, "connection_pool"):
            raise ConfigError(
                f"client must be a redis.asyncio.Redis (one node, or a proxy in front of a "
                f"cluster), got {type(client).__name__}"
            )
        if max_connections < 1 or pool_timeout_s <= 0:
            raise ConfigError("max_connections must be >= 1 and pool_timeout_s > 0")
        if tombstone_ttl_s <= 0:
            raise ConfigError("tombstone_ttl_s must be > 0")
        if evidence_ttl_s is not None and evidence_ttl_s <= 0:
            raise ConfigError("evidence_ttl_s must be > 0, or None to keep frozen rollouts")
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ConfigError("key_prefix must be non-empty and contain no braces")
        self._url = url
        self._client = client
        self._owns_client = client is None
        self.key_prefix = key_prefix
        self._chosen = Durability.parse(durability)
        self.durability: Durability | None = None  # set once proven against the server
        self.tombstone_ttl_s = tombstone_ttl_s
        self.evidence_ttl_s = evidence_ttl_s
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._wait_timeout_ms = wait_timeout_ms
        self._max_retries = max_retries
        self._max_watch_retries = max_watch_retries
        self._block_size = block_size
        self._max_connections = max_connections
        self._pool_timeout_s = pool_timeout_s
        self._connections: ProvingConnections | None = None  # None for a client passed in
        self._memo = ChainMemo()  # re-encodes only what a rollout's next call adds
        self._lock = asyncio.Lock()
        self._closed = False
        # rollout id -> (epoch of its hash, block names it holds); saves asking about blocks
        # this process already wrote. Trusted only while the hash's epoch field is unchanged.
        self._known: OrderedDict[str, tuple[bytes, set[str]]] = OrderedDict()

    # -- connection and start-up ---------------------------------------------------------

    @property
    def where(self) -> str:
        """The server, for messages; never the password."""
        if self._client is None:
            return "redis (not connected yet)"
        return server_name(self._client)

    def _make_connections(self) -> ProvingConnections:
        assert self._url is not None
        return ProvingConnections(
            self._url,
            self._chosen,
            max_connections=self._max_connections,
            pool_timeout_s=self._pool_timeout_s,
            socket_timeout_s=self._socket_timeout_s,
            connect_timeout_s=self._connect_timeout_s,
            wait_timeout_ms=self._wait_timeout_ms,
        )

    async def check(self) -> Durability:
        """Connect and prove the durability guarantee; runs by itself before the first write."""
        if self._closed:
            raise TokenCaptureError("this RedisTokenStore is closed")
        if self.durability is None:
            async with self._lock:
                if self.durability is None:
                    self.durability = await self._retrying(self._prove)
        return self._current_durability()

    async def _prove(self) -> Durability:
        """The first proof: a connection of our own pool proves itself as it opens."""
        if self._client is None:
            self._connections = self._make_connections()
            self._client = self._connections.client
        pool = self._client.connection_pool
        if self._connections is not None and self._chosen.mode != "none":
            connection = await pool.get_connection()
            await pool.release(connection)
            assert self._connections.durability is not None
            return self._connections.durability

        async def execute(*args: Any) -> Any:
            return await execute_raw(pool, *args)

        return await check_durability(
            execute, self._chosen, where=self.where, wait_timeout_ms=self._wait_timeout_ms
        )

    def _current_durability(self) -> Durability:
        """What the latest connection proved (a server may come back configured otherwise)."""
        if self._connections is not None and self._connections.durability is not None:
            return self._connections.durability
        assert self.durability is not None
        return self.durability

    start = check

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client and self._client is not None:
            await self._client.aclose()

    async def _retrying(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation``; on a connection failure retry it a bounded number of times.

        Every operation here is safe to repeat: a put whose EXEC landed but whose reply was
        lost finds its own digest on the retry and returns as a no-op.
        """
        last: Exception | None = None
        for attempt in range(self._max_retries + 1):
            try:
                return await operation()
            except AuthenticationError:
                raise  # wrong credentials do not get better by retrying
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                last = exc
                if attempt < self._max_retries:
                    await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
        raise RedisUnavailableError(
            f"{self.where} unreachable after {self._max_retries + 1} attempts: {last}"
        ) from last

    async def _transact(
        self,
        rollout_id: str,
        reads: Callable[[str], Sequence[Command]],
        decide: Callable[[str, list[Any]], Plan],
    ) -> Any:
        """WATCH the rollout, read, decide, and commit the decision atomically."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))

        async def attempt() -> Plan | None:
            async with watching(self._client.connection_pool, key) as watch:
                plan = decide(key, await watch.read(*reads(key)))
                if not plan.writes:
                    return plan
                # Read after the connection proved itself, so a restarted server's own
                # guarantee is the one waited for.
                durability = self._current_durability()
                committed = await watch.commit(plan.writes, after=durability.wait)
            if committed is None:
                # Lost the race: another writer changed this rollout after our WATCH, so
                # what we decided on is stale. Nothing was applied; read and decide again.
                return None
            durability.verify(committed[1])
            return plan

        for lost in range(self._max_watch_retries):
            plan = await self._retrying(attempt)
            if plan is not None and not plan.again:
                if plan.error is not None:
                    raise plan.error
                return plan.result
            # Someone else committed first, so the rollout made progress; after a few losses
            # in a row, a short random pause lets the crowd of writers spread out.
            await asyncio.sleep(0 if lost < 3 else random.uniform(0, min(0.001 * lost, 0.02)))
        raise ContentionError(
            f"rollout {rollout_id}: gave up after {self._max_watch_retries} conflicting writes"
        )

    # -- sink ----------------------------------------------------------------------------

    async def put(self, entry: Any) -> None:
        """Store one call's entry, durably; idempotent for the same payload."""
        entry = TokenEntry.coerce(entry)
        encoded = encode_entry(entry, self._block_size, self._memo)
        call_id = encoded.model_call_id
        digest = encoded.digest.encode()

        cached_epoch, known = self._known.get(entry.rollout_id, (b"", set()))
        asked: list[str] = []
        tail_parent = ""
        seen_epoch = b""

        def reads(key: str) -> list[Command]:
            nonlocal asked, tail_parent
            # Ask about each block not known to be held, in the same round trip as WATCH
            # (HEXISTS downloads nothing), and for the tail the first of them may extend.
            asked = [name for name in encoded.block_names if not cached_epoch or name not in known]
            tail_parent = encoded.tail_parent(known if cached_epoch else ())
            state = (
                "HMGET",
                key,
                k.VERSION,
                k.FROZEN,
                k.field(k.DIGEST, call_id),
                k.EPOCH,
                k.field(k.TAIL, tail_parent),
            )
            return [state, *(("HEXISTS", key, k.field(k.BLOCK, name)) for name in asked)]

        def decide(key: str, replies: list[Any]) -> Plan:
            nonlocal cached_epoch, known, seen_epoch
            (version, frozen, stored_digest, epoch, tail), held = replies[0], replies[1:]
            if frozen == b"1":
                return Plan(
                    error=RolloutFrozenError(
                        f"rollout {entry.rollout_id} is frozen; call {call_id} came too late"
                    )
                )
            if cached_epoch and epoch != cached_epoch:
                # The hash was deleted and made anew since we cached its blocks: ask again.
                self._known.pop(entry.rollout_id, None)
                cached_epoch, known = b"", set()
                return Plan(again=True)
            seen_epoch = epoch or uuid.uuid4().hex.encode()
            if stored_digest == digest:
                # The same payload again. Its first write may have lost its connection before
                # the durability wait answered, so where a wait proves durability, rewrite one
                # unchanged field: waiting for that later write covers the earlier one.
                if self._current_durability().wait:
                    return Plan(writes=[("HSET", key, k.EPOCH, seen_epoch)])
                return Plan()
            if stored_digest is not None:
                mark = k.field(k.MARK, call_id)
                return Plan(
                    writes=[
                        (
                            "HSET",
                            key,
                            k.INCOMPLETE,
                            1,
                            mark,
                            CONFLICTING_PAYLOAD,
                            k.VERSION,
                            _int(version) + 1,
                        )
                    ],
                    error=ConflictingEntryError(
                        f"rollout {entry.rollout_id}: call {call_id} was already stored with "
                        "a different payload; the rollout is now marked incomplete"
                    ),
                )
            held_names = {name for name, present in zip(asked, held, strict=True) if present}
            if cached_epoch:
                held_names |= known
            # The codec decides which bytes are new; only those cross the wire.
            writes = encoded.plan(held_names, {tail_parent: tail} if tail else {})
            fields: list[Any] = [
                k.VERSION,
                _int(version) + 1,
                k.field(k.ENTRY, call_id),
                encoded.body,
                k.field(k.DIGEST, call_id),
                digest,
                k.EPOCH,
                seen_epoch,
            ]
            for name, stored in writes.blocks:
                fields += [k.field(k.BLOCK, name), stored]
            for parent, value in writes.tails:
                fields += [k.field(k.TAIL, parent), value]
            return Plan(writes=[("HSET", key, *fields)])

        await self._transact(entry.rollout_id, reads, decide)
        names = set(encoded.block_names)
        if seen_epoch == cached_epoch:
            names |= known
        self._known[entry.rollout_id] = (seen_epoch, names)
        self._known.move_to_end(entry.rollout_id)
        if len(self._known) > _KNOWN_ROLLOUTS:
            self._known.popitem(last=False)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably note a lost call; allowed after freeze and drop (it advances the version)."""

        def decide(key: str, replies: list[Any]) -> Plan:
            (version,) = replies[0]
            mark = k.field(k.MARK, model_call_id)
            return Plan(
                writes=[
                    (
                        "HSET",
                        key,
                        k.INCOMPLETE,
                        1,
                        mark,
                        MARKED_INCOMPLETE,
                        k.VERSION,
                        _int(version) + 1,
                    )
                ]
            )

        await self._transact(rollout_id, lambda key: [("HMGET", key, k.VERSION)], decide)

    async def _intent(self, rollout_id: str, model_call_id: str, value: bytes) -> None:
        if not isinstance(model_call_id, str) or not model_call_id:
            raise ValueError("model_call_id must be a non-empty string")
        intent = k.field(k.INTENT, model_call_id)
        entry = k.field(k.ENTRY, model_call_id)

        def decide(key: str, replies: list[Any]) -> Plan:
            version, frozen, current, stored = replies[0]
            pending = current == k.INTENT_OPEN and stored is None
            if value == k.INTENT_VOID and not pending:
                return Plan()  # nothing to resolve, frozen or not
            if frozen == b"1":
                return Plan(
                    error=RolloutFrozenError(
                        f"rollout {rollout_id} is frozen; the {value.decode()} of call "
                        f"{model_call_id} is too late (the snapshot counts it as it was)"
                    )
                )
            if current == value:
                return Plan()
            return Plan(writes=[("HSET", key, intent, value, k.VERSION, _int(version) + 1)])

        await self._transact(
            rollout_id, lambda key: [("HMGET", key, k.VERSION, k.FROZEN, intent, entry)], decide
        )

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durable intent before dispatch: without an entry at freeze, the rollout is incomplete."""
        await self._intent(rollout_id, model_call_id, k.INTENT_OPEN)

    async def void_call(self, rollout_id: str, model_call_id: str) -> None:
        """Resolve a pending intent of a call that returned nothing (not a loss)."""
        await self._intent(rollout_id, model_call_id, k.INTENT_VOID)

    async def mark_unreceived(self, rollout_id: str, model_call_id: str) -> None:
        """Note that the harness never received this call's reply; refused after freeze."""
        if not isinstance(model_call_id, str) or not model_call_id:
            raise ValueError("model_call_id must be a non-empty string")
        mark = k.field(k.UNRECEIVED, model_call_id)

        def decide(key: str, replies: list[Any]) -> Plan:
            version, frozen, current = replies[0]
            if frozen == b"1":
                return Plan(
                    error=RolloutFrozenError(
                        f"rollout {rollout_id} is frozen; the note that call {model_call_id} "
                        "went unreceived is too late"
                    )
                )
            if current is not None:
                return Plan()
            return Plan(writes=[("HSET", key, mark, 1, k.VERSION, _int(version) + 1)])

        await self._transact(
            rollout_id, lambda key: [("HMGET", key, k.VERSION, k.FROZEN, mark)], decide
        )

    # -- source --------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Stop all writes and return one atomic snapshot; idempotent while nothing changes."""

        def decide(key: str, replies: list[Any]) -> Plan:
            fields = _pairs(replies[0])
            state = {name: fields.get(name.encode()) for name in k.STATE_FIELDS}
            if state[k.FROZEN] == b"1":
                return Plan(result=(fields, _int(state[k.VERSION]), state[k.SNAPSHOT_ID]))
            snapshot_id = state[k.SNAPSHOT_ID] or uuid.uuid4().hex.encode()
            version = _int(state[k.VERSION]) + 1
            writes = [("HSET", key, k.FROZEN, 1, k.SNAPSHOT_ID, snapshot_id, k.VERSION, version)]
            if self.evidence_ttl_s is not None:
                # Retiring replaces this with the tombstone's TTL; a rollout never retired
                # (a masked one, kept as evidence) still leaves memory in the end.
                writes.append(("PEXPIRE", key, max(1, int(self.evidence_ttl_s * 1000))))
            return Plan(writes=writes, result=(fields, version, snapshot_id))

        fields, version, snapshot_id = await self._transact(
            rollout_id, lambda key: [("HGETALL", key)], decide
        )
        return snapshot_of(rollout_id, fields, version, snapshot_id.decode())

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly this snapshot, keeping a tombstone; False if anything changed."""
        names = (k.VERSION, k.FROZEN, k.SNAPSHOT_ID, k.RETIRED, k.INCOMPLETE, k.RETIRED_AT)

        def decide(key: str, replies: list[Any]) -> Plan:
            current, frozen, stored_id, retired, incomplete, _ = replies[0]
            same = (
                frozen == b"1"
                and stored_id is not None
                and stored_id.decode() == snapshot_id
                and _int(current) == version
            )
            if not same:
                return Plan(result=False)
            if retired == b"1":
                return Plan(result=True)  # this very snapshot was already retired
            tombstone = [
                k.VERSION,
                version,
                k.FROZEN,
                1,
                k.SNAPSHOT_ID,
                snapshot_id,
                k.INCOMPLETE,
                _int(incomplete),
                k.RETIRED,
                1,
                k.RETIRED_AT,
                time.time(),
            ]
            ttl_ms = max(1, int(self.tombstone_ttl_s * 1000))
            writes = [("DEL", key), ("HSET", key, *tombstone), ("PEXPIRE", key, ttl_ms)]
            return Plan(writes=writes, result=True)

        return await self._transact(rollout_id, lambda key: [("HMGET", key, *names)], decide)

    # -- administration ------------------------------------------------------------------

    async def delete(self, rollout_id: str) -> None:
        """Remove everything of one rollout, tombstone included (administrative)."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        await self._retrying(lambda: execute_raw(self._client.connection_pool, "DEL", key))

    async def sweep_tombstones(self, older_than_s: float | None = None) -> int:
        """Delete tombstones retired more than ``older_than_s`` ago (default: the TTL)."""
        await self.check()
        limit = self.tombstone_ttl_s if older_than_s is None else older_than_s
        pool = self._client.connection_pool
        pattern = k.rollout_pattern(self.key_prefix)
        swept, cursor = 0, b"0"
        while True:
            cursor, keys = await self._retrying(
                lambda c=cursor: execute_raw(pool, "SCAN", c, "MATCH", pattern, "COUNT", 500)
            )
            for key in keys:
                rollout_id = k.rollout_id_of(self.key_prefix, key.decode())
                if rollout_id and await self._sweep_one(rollout_id, limit):
                    swept += 1
            if cursor in (b"0", 0):
                return swept

    async def _sweep_one(self, rollout_id: str, older_than_s: float) -> bool:
        def decide(key: str, replies: list[Any]) -> Plan:
            retired, retired_at = replies[0]
            if retired != b"1" or time.time() - float(retired_at or 0) < older_than_s:
                return Plan(result=False)
            return Plan(writes=[("DEL", key)], result=True)

        return await self._transact(
            rollout_id, lambda key: [("HMGET", key, k.RETIRED, k.RETIRED_AT)], decide
        )

    async def inspect(self, rollout_id: str) -> dict[str, Any]:
        """A summary of one rollout for operators; reads only."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        fields = _pairs(
            await self._retrying(lambda: execute_raw(self._client.connection_pool, "HGETALL", key))
        )
        return summary_of(rollout_id, fields).as_dict()


RedisTokenSink = RedisTokenStore
RedisTokenSource = RedisTokenStore
