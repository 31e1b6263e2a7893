"""RedisTokenStore: the capture contract on Redis, one hash per rollout.

A put, the hot path, is one server-side script that decides and writes atomically, usually
in one round trip, sending only the blocks the hash does not hold yet
(``transports.redis.put``); so is a call's intent and its void (``transports.redis.intent``).
Every other state change runs as an optimistic transaction on
the rollout's hash: WATCH, read what decides, MULTI ... EXEC; a refused EXEC means another
writer changed the rollout first, so the decision is made again on fresh state
(``transports.redis.watch.attempt``); what each change reads and decides is a pure
operation in ``transports.redis.plans``. A script's writes touch the hash, so a freeze
watching it sees a put that lands in between. Durability is proven before the first write,
and every write waits for it where the server needs a wait (WAITAOF / WAIT).

The same class is the sink a model server writes through (``RedisTokenSink``) and the source
a trainer freezes and drops through (``RedisTokenSource``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any, Self, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.codec.entries import DEFAULT_BLOCK_SIZE, ChainMemo, decode_entries, encode_entry
from capture.errors import (
    ConflictingEntryError,
    RolloutFrozenError,
    RoutesPrefixError,
    TokenCaptureError,
)
from capture.lineage import entry_with_key
from capture.records import TokenCaptureSnapshot, TokenEntry
from capture.retention import EVIDENCE_TTL_S, TOMBSTONE_TTL_S
from capture.rollout_ids import validate_rollout_id
from capture.routes import Routes
from transports.redis import keys as k
from transports.redis.checks import check_call_id, check_limits, check_server
from transports.redis.clients import RedisOptions
from transports.redis.durability import Durability
from transports.redis.eviction import Memory
from transports.redis.intent import INTENT_SCRIPT, INTENT_SHA, intent_args
from transports.redis.plans import (
    Drop,
    Freeze,
    MarkIncomplete,
    MarkUnreceived,
    Operation,
    SweepOne,
    pairs,
)
from transports.redis.put import PUT_SCRIPT, PUT_SHA, KnownBlocks, Put
from transports.redis.reach import RedisReach
from transports.redis.records import snapshot_of, split, summary_of
from transports.redis.scripts import ScriptBatch, run_durably
from transports.redis.watch import attempt, execute_raw

T = TypeVar("T")
BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # the codec's; chosen so a whole block fits 1 KiB in Redis
_KNOWN_ROLLOUTS = 256  # rollouts whose block names a store remembers
# A lost WATCH race is retried at once the first few times; after that a random pause of
# up to 1 ms per loss (20 ms at most) lets a crowd of writers of one rollout spread out.
EAGER_RETRIES, PAUSE_PER_LOSS_S, MAX_LOSS_PAUSE_S = 3, 0.001, 0.02


class ContentionError(TokenCaptureError):
    """A write lost the WATCH race more times than allowed; it was not applied."""


class RedisTokenStore:
    """Token sink and source on Redis; see the module docstring for how it stays consistent.

    Keyword arguments only. The connection is one ``RedisOptions``
    (``transports.redis.clients``): ``options`` whole, as the rebuild worker passes it
    (``from_options``), and any of its fields as a keyword of its own, which overrides that
    field, as a Gym config's ``sink_kwargs`` give them: ``url`` (``redis://``, ``rediss://``
    for TLS, password in the URL); ``cluster`` (the url names any one node of a Redis
    Cluster, ``transports.redis.cluster``); ``durability`` ("fsync", "replicas:N" or
    "none"); socket, connect and durability-wait timeouts; ``max_connections`` and
    ``pool_timeout_s`` (a call waits that long for a free connection instead of failing);
    ``max_retries`` on connection errors; ``failover_timeout_s``, how long an operation
    keeps retrying while the cluster replaces a lost master. Instead of a url, ``client``:
    an existing ``redis.asyncio.Redis``, left open on close (a ``RedisCluster`` client that
    has not connected yet is taken as a cluster's). The store's own keywords: ``key_prefix``;
    ``tombstone_ttl_s``; ``evidence_ttl_s`` (how long a frozen rollout that is never
    retired, such as a masked one, is kept; None keeps it until ``delete``);
    ``max_watch_retries``; ``block_size`` (writers of one rollout share blocks only when
    they use the same; the payload digest does not depend on it). Nothing connects until
    first use, so the store can be built outside an event loop. Built from a ``url``, every
    new connection proves durability before it is used (``transports.redis.connections``);
    a ``client`` passed in is proven once, at start.
    """

    reads_packed_ids = True  # an entry's prompt may be PackedIds (capture.protocols)
    reads_chained_routes = True  # its routes may continue a stored prefix (capture.protocols)

    @classmethod
    def from_options(cls, options: RedisOptions, **store: Any) -> RedisTokenStore:
        """The store on the Redis ``options`` names, taken whole as arq's pool takes its
        ``RedisSettings`` (``store``: the store's own keywords, such as ``key_prefix``)."""
        return cls(options=options, **store)

    def __init__(
        self,
        *,
        options: RedisOptions | None = None,
        client: aioredis.Redis | None = None,
        key_prefix: str = k.DEFAULT_PREFIX,
        tombstone_ttl_s: float = TOMBSTONE_TTL_S,
        evidence_ttl_s: float | None = EVIDENCE_TTL_S,
        max_watch_retries: int = 200,
        block_size: int = BLOCK_SIZE,
        **connection: Any,
    ) -> None:
        # A keyword that is no field of RedisOptions is a TypeError here, naming it.
        options = dataclasses.replace(RedisOptions() if options is None else options, **connection)
        cluster = options.cluster or isinstance(client, RedisCluster)
        check_server(options.url, client, cluster)
        check_limits(
            key_prefix,
            tombstone_ttl_s,
            evidence_ttl_s,
            options.max_connections,
            options.pool_timeout_s,
        )
        self._reach = RedisReach(dataclasses.replace(options, cluster=cluster), client)
        self.key_prefix = key_prefix
        self.tombstone_ttl_s = tombstone_ttl_s
        self.evidence_ttl_s = evidence_ttl_s
        self._max_watch_retries = max_watch_retries
        self._block_size = block_size
        self._memo = ChainMemo()  # re-encodes only what a rollout's next call adds
        self._closed = False
        # Saves asking about blocks this process already wrote (see transports.redis.put).
        self._known = KnownBlocks(_KNOWN_ROLLOUTS)
        self._puts: dict[Any, ScriptBatch] = {}  # per pool: puts ready at once share a trip
        self._intents: dict[Any, ScriptBatch] = {}  # and so do intents

    @property
    def block_size(self) -> int:
        """Ids (and route rows) a stored block holds."""
        return self._block_size

    # -- connection and start-up (transports.redis.reach) -------------------------------

    @property
    def where(self) -> str:
        """The server, for messages; never the password."""
        return self._reach.where

    @property
    def cluster(self) -> bool:
        """Whether the store writes to a Redis Cluster's masters."""
        return self._reach.cluster

    @property
    def durability(self) -> Durability | None:
        """The guarantee proven against the server (None until the first ``check``)."""
        return self._reach.durability

    async def check(self) -> Durability:
        """Connect and prove the durability guarantee; runs by itself before the first write."""
        if self._closed:
            raise TokenCaptureError("this RedisTokenStore is closed")
        return await self._reach.check()

    start = check

    def is_outage(self, exc: Exception) -> bool:
        """Whether ``exc``, raised through this store's client, passes by waiting, as the
        store's own operations judge it: a lost connection, a cluster replacing a master,
        or (on a cluster, once proven) a node whose new connection cannot prove the
        durability yet, such as a promoted master before its lost peer is back as its
        replica. Whoever else uses ``client`` (the rebuild worker's job reads) asks here
        instead of judging by the error's type alone."""
        return self._reach.is_outage(exc)

    async def refresh(self) -> None:
        """On a cluster, read the slot map again (nothing on one server), as the store does
        between the tries of its own operations; for whoever else retries on ``client``."""
        await self._reach.refresh()

    @property
    def client(self) -> Any:
        """The store's own client once ``check`` has connected it (None before): its
        connections prove durability as they open. The rebuild worker reads its jobs with it."""
        return self._reach.client

    async def ping(self) -> None:
        """One PING on the store's own client (its pool, its password): for readiness."""
        if self._reach.client is None:
            raise TokenCaptureError(f"{self.where}: not started")
        await self._reach.client.ping()

    async def memory(self) -> list[Memory]:
        """Memory used against ``maxmemory``, per server (each master of a cluster): the
        headroom left before a full server refuses writes."""
        await self.check()
        return await self._reach.memory()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._reach.close()

    async def _transact(self, rollout_id: str, operation: Operation) -> Any:
        """Run ``operation`` on the rollout as a transaction until it wins the race."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))

        async def once() -> Any:
            pool, durability = self._reach.route(key)  # asked again on each try: a slot may move
            return await attempt(pool, key, operation, durability)

        for lost in range(self._max_watch_retries):
            plan = await self._reach.retrying(once)
            if plan is not None:
                if plan.error is not None:
                    raise plan.error
                return plan.result
            # Someone else committed first, so the rollout made progress; after a few losses
            # in a row, a short random pause lets the crowd of writers spread out.
            pause = min(PAUSE_PER_LOSS_S * lost, MAX_LOSS_PAUSE_S)
            await asyncio.sleep(0 if lost < EAGER_RETRIES else random.uniform(0, pause))
        raise ContentionError(
            f"rollout {rollout_id}: gave up after {self._max_watch_retries} conflicting writes"
        )

    # -- sink ----------------------------------------------------------------------------

    async def put(self, entry: Any) -> None:
        """Store one call's entry, durably; idempotent for the same payload.

        One script decides and writes atomically (``transports.redis.put``); it is asked
        again only when what this process knew of the rollout turned out stale or short.
        """
        entry = TokenEntry.coerce(entry)
        if isinstance(entry.routed_experts, Routes):  # hashing them takes ms at long contexts
            encoded = await asyncio.to_thread(encode_entry, entry, self._block_size, self._memo)
        else:
            encoded = encode_entry(entry, self._block_size, self._memo)
        rollout_id = entry.rollout_id
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        attempt = Put.plan(encoded, self._known.get(rollout_id))
        for _ in range(self._max_watch_retries):
            reply, waited, proven = await self._reach.retrying(
                lambda attempt=attempt: self._batch(key, self._puts, PUT_SCRIPT, PUT_SHA).run(
                    key, attempt.args
                )
            )
            outcome, _, epoch = reply.partition(b" ") if type(reply) is bytes else (b"", b"", b"")
            if outcome in (b"stored", b"same"):
                if outcome == b"stored" or proven.wait:
                    proven.verify(waited)
                if outcome == b"stored":
                    # "same": an earlier put stored this payload, maybe cut at another block
                    # size, so this put's block names are not known to be held.
                    self._known.remember(rollout_id, attempt.learned(epoch))
                return
            if outcome == b"frozen":
                raise RolloutFrozenError(
                    f"rollout {rollout_id} is frozen; call {entry.model_call_id} came too late"
                )
            if outcome == b"conflict":
                proven.verify(waited)
                raise ConflictingEntryError(
                    f"rollout {rollout_id}: call {entry.model_call_id} was already stored "
                    "with a different payload; the rollout is now marked incomplete"
                )
            if outcome == b"stale":
                # The hash was deleted and made anew since this process wrote to it: what it
                # knew of the blocks there is void, so ask about every one of them.
                self._known.forget(rollout_id)
                attempt = Put.plan(encoded, None)
            else:  # lacking: nothing was written; plan again from what the hash holds
                missing = attempt.lacks_required(reply)
                if missing is not None:
                    raise RoutesPrefixError(
                        f"rollout {rollout_id}: call {entry.model_call_id}'s routes continue "
                        f"block {missing}, which the rollout does not hold"
                    )
                attempt = attempt.replan(reply)
        raise ContentionError(
            f"rollout {rollout_id}: gave up after {self._max_watch_retries} attempts to put "
            f"call {entry.model_call_id}"
        )

    def _batch(
        self, key: str, batches: dict[Any, ScriptBatch], script: str, sha: str
    ) -> ScriptBatch:
        """The batch of ``script`` for the pool serving ``key`` (on a cluster, one per master)."""
        pool, durability = self._reach.route(key)
        batch = batches.get(pool)
        if batch is None:
            batch = batches[pool] = ScriptBatch(pool, script, sha, durability)
        return batch

    async def _set_intent(self, rollout_id: str, model_call_id: str, value: bytes) -> None:
        """Open or void a call's intent in one script (``transports.redis.intent``)."""
        check_call_id(model_call_id)
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        args = intent_args(model_call_id, value)
        reply, waited, proven = await self._reach.retrying(
            lambda: self._batch(key, self._intents, INTENT_SCRIPT, INTENT_SHA).run(
                key, lambda _: args
            )
        )
        if reply == b"frozen":
            raise RolloutFrozenError(
                f"rollout {rollout_id} is frozen; the {value.decode()} of call "
                f"{model_call_id} is too late (the snapshot counts it as it was)"
            )
        if reply == b"stored":
            proven.verify(waited)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably note a lost call; allowed after freeze and drop (it advances the version)."""
        await self._transact(rollout_id, MarkIncomplete(model_call_id))

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durable intent before dispatch: without an entry at freeze, the rollout is incomplete."""
        await self._set_intent(rollout_id, model_call_id, k.INTENT_OPEN)

    async def void_call(self, rollout_id: str, model_call_id: str) -> None:
        """Resolve a pending intent of a call that returned nothing (not a loss)."""
        await self._set_intent(rollout_id, model_call_id, k.INTENT_VOID)

    async def mark_unreceived(self, rollout_id: str, model_call_id: str) -> None:
        """Note that the harness never received this call's reply; refused after freeze."""
        check_call_id(model_call_id)
        await self._transact(rollout_id, MarkUnreceived(rollout_id, model_call_id))

    # -- source --------------------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Stop all writes and return one atomic snapshot; idempotent while nothing changes."""
        fields, version, snapshot_id = await self._transact(rollout_id, Freeze(self.evidence_ttl_s))
        return snapshot_of(rollout_id, fields, version, snapshot_id.decode())

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly this snapshot, keeping a tombstone; False if anything changed."""
        return await self._transact(rollout_id, Drop(snapshot_id, version, self.tombstone_ttl_s))

    # -- administration ------------------------------------------------------------------

    async def delete(self, rollout_id: str) -> None:
        """Remove everything of one rollout, tombstone included (administrative)."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        await self._reach.retrying(lambda: execute_raw(self._reach.route(key)[0], "DEL", key))

    async def set_policy_version(self, version: str) -> None:
        """Set the version every front end on this store stamps new calls with; durable."""
        await self.run_durably(
            k.policy_version_key(self.key_prefix),
            [("SET", k.policy_version_key(self.key_prefix), version)],
        )

    async def policy_version(self) -> str | None:
        """The version last set (None: never)."""
        await self.check()
        key = k.policy_version_key(self.key_prefix)
        value = await self._reach.retrying(
            lambda: execute_raw(self._reach.route(key)[0], "GET", key)
        )
        return None if value is None else k.as_text(value)

    async def run_durably(self, key: str, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Run ``commands`` (all on ``key``'s slot) and the durability wait after them on one
        connection of the server that holds ``key``; their replies, once durable.

        For writes that are safe to repeat (the rebuild worker's publish script): a
        connection failure is retried like every operation of the store.
        """
        await self.check()

        async def once() -> list[Any]:
            pool, durability = self._reach.route(key)
            return await run_durably(pool, commands, durability)

        return await self._reach.retrying(once)

    async def sweep_tombstones(self, older_than_s: float | None = None) -> int:
        """Delete tombstones retired more than ``older_than_s`` ago (default: the TTL)."""
        await self.check()
        limit = self.tombstone_ttl_s if older_than_s is None else older_than_s
        swept = 0
        for pool in self._reach.pools():  # a cluster's keys: each master scanned in turn
            swept += await self._sweep_one_server(pool, limit)
        return swept

    async def _sweep_one_server(self, pool: Any, limit: float) -> int:
        pattern = k.rollout_pattern(self.key_prefix)
        swept, cursor = 0, b"0"
        while True:
            cursor, keys = await self._reach.retrying(
                lambda c=cursor: execute_raw(pool, "SCAN", c, "MATCH", pattern, "COUNT", 500)
            )
            for key in keys:
                rollout_id = k.rollout_id_of(self.key_prefix, key.decode())
                if rollout_id and await self._transact(rollout_id, SweepOne(limit)):
                    swept += 1
            if cursor in (b"0", 0):
                return swept

    async def inspect(self, rollout_id: str) -> dict[str, Any]:
        """A summary of one rollout for operators; reads only."""
        fields = await self._read_hash(rollout_id)
        return summary_of(rollout_id, fields).as_dict()

    async def peek(self, rollout_id: str) -> list[TokenEntry]:
        """The entries stored now, by call id, for operators (``tokcap inspect``).

        Reads only: unlike ``freeze`` it stops no writes, so a running rollout goes on. A
        retired rollout's entries are gone, so it peeks as none.
        """
        fields = await self._read_hash(rollout_id)
        kinds = split(fields)
        bodies = kinds[k.ENTRY]
        return decode_entries([bodies[c] for c in sorted(bodies)], kinds[k.BLOCK], trusted=True)

    async def find_call(self, rollout_id: str, lineage_key: str) -> TokenEntry | None:
        """The call of a running rollout whose entry carries ``lineage_key`` (faithful
        prompts); reads only, and decodes only that call."""
        fields = await self._read_hash(rollout_id)
        kinds = split(fields)
        return entry_with_key(kinds[k.ENTRY].values(), kinds[k.BLOCK], lineage_key)

    async def _read_hash(self, rollout_id: str) -> dict[bytes, bytes]:
        """Every field of the rollout's hash, read once without changing it."""
        await self.check()
        key = k.rollout_key(self.key_prefix, validate_rollout_id(rollout_id))
        return pairs(
            await self._reach.retrying(
                lambda: execute_raw(self._reach.route(key)[0], "HGETALL", key)
            )
        )


RedisTokenSink = RedisTokenStore
RedisTokenSource = RedisTokenStore
