"""How tokcap reaches a Redis: one options object, one way to open a client, one word on
which errors pass.

``RedisOptions`` is everything about a connection: the URL, whether it names a node of a
Redis Cluster, the socket and pool limits, the durability the store's connections prove and
how often an operation is tried. It travels whole, from the store to its pool and from a
worker's settings to its store, whose client the worker also reads its jobs with.
``open_client`` gives the plain client that the other stream users (the queue, the results
reader; ``tokcap report`` its blocking twin) read and acknowledge with, under the same
timeouts; the store builds its own proving pool from the same options
(``transports.redis.reach``). ``TRANSIENT_ERRORS`` are what every
user rides out by waiting and trying again: a lost or refused connection, a timeout, a
cluster replacing a master.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Replies and failures after which a cluster's slot map may be stale: re-read it, try again.
TOPOLOGY_ERRORS = (AskError, ClusterDownError, TryAgainError, RedisClusterException)
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, *TOPOLOGY_ERRORS)


@dataclass(frozen=True)
class RedisOptions:
    """A Redis connection's settings; the store's keyword arguments of the same names."""

    url: str | None = None  # never assumed: every caller names its Redis
    cluster: bool = False  # the url names one node of a Redis Cluster
    durability: str = "fsync"  # what the store's connections prove (durability.py)
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    wait_timeout_ms: int = 1000  # WAIT / WAITAOF, when the durability uses them
    max_connections: int = 100
    pool_timeout_s: float = 10.0  # how long a caller waits for a free pooled connection
    max_retries: int = 3  # tries of one store operation after a transient error
    failover_timeout_s: float = 15.0  # how long a cluster operation rides out a failover


def open_client(options: RedisOptions, block_ms: int = 0) -> aioredis.Redis | RedisCluster:
    """A client of the Redis (or Cluster) ``options`` names, with its timeouts; a read that
    blocks up to ``block_ms`` on the server is given that much more socket time."""
    url, timeouts = _url_and_timeouts(options, block_ms)
    if options.cluster:
        return RedisCluster.from_url(url, **timeouts)
    return aioredis.Redis.from_url(url, **timeouts)


def open_sync_client(options: RedisOptions) -> redis.Redis | redis.RedisCluster:
    """The blocking client of the same Redis, for commands that run outside an event loop."""
    url, timeouts = _url_and_timeouts(options, 0)
    if options.cluster:
        return redis.RedisCluster.from_url(url, **timeouts)
    return redis.Redis.from_url(url, **timeouts)


def _url_and_timeouts(options: RedisOptions, block_ms: int) -> tuple[str, dict[str, float]]:
    if not options.url:
        raise ValueError("RedisOptions.url names no Redis")
    timeouts = {
        "socket_timeout": options.socket_timeout_s + block_ms / 1000,
        "socket_connect_timeout": options.connect_timeout_s,
    }
    return options.url, timeouts
