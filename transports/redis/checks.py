"""Checks of the store's arguments: a setting that cannot work fails at construction, saying
what to change, before anything connects; and how a server is named in messages (host and
port, never the password the URL may carry).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from capture.errors import ConfigError

# How every message names one server: this, then its host:port or socket path.
NAME_PREFIX = "redis at "


def address_of(name: str) -> str:
    """The host:port (or socket path) in a server's name: a metric label, say."""
    return name.removeprefix(NAME_PREFIX)


def server_name(client: aioredis.Redis | RedisCluster) -> str:
    """Where a client connects, for messages: host and port or socket, never credentials."""
    if isinstance(client, RedisCluster):
        nodes = client.startup_nodes or list(client.nodes_manager.startup_nodes.values())
        first = nodes[0] if nodes else None
        return f"redis cluster at {getattr(first, 'host', '?')}:{getattr(first, 'port', '?')}"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"{NAME_PREFIX}{kwargs['path']}"
    return f"{NAME_PREFIX}{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def node_name(node: Any) -> str:
    """A cluster node as connections name it in messages (``connection_name``)."""
    return f"{NAME_PREFIX}{node.host}:{node.port}"


def check_server(url: str | None, client: Any, cluster: bool) -> None:
    if (url is None) == (client is None):
        raise ConfigError("RedisTokenStore needs exactly one of url= or client=")
    if not isinstance(cluster, bool):
        raise ConfigError(f"cluster must be true or false, got {cluster!r}")
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(  # the URL may carry a password: show its scheme only
            f"url must start with redis://, rediss:// or unix://, got {url.split(':')[0]!r}"
        )
    if cluster and url is not None and url.startswith("unix://"):
        raise ConfigError("a Redis Cluster is reached over TCP: use redis:// or rediss://")
    if client is None or isinstance(client, RedisCluster):
        return
    if cluster:
        raise ConfigError(
            f"cluster=True needs url= or a redis.asyncio.cluster.RedisCluster client, "
            f"got {type(client).__name__}"
        )
    if not hasattr(client, "connection_pool"):
        raise ConfigError(
            f"client must be a redis.asyncio.Redis or a redis.asyncio.cluster.RedisCluster, "
            f"got {type(client).__name__}"
        )


def check_limits(
    key_prefix: str,
    tombstone_ttl_s: float,
    evidence_ttl_s: float | None,
    max_connections: int,
    pool_timeout_s: float,
) -> None:
    if max_connections < 1 or pool_timeout_s <= 0:
        raise ConfigError("max_connections must be >= 1 and pool_timeout_s > 0")
    if tombstone_ttl_s <= 0:
        raise ConfigError("tombstone_ttl_s must be > 0")
    if evidence_ttl_s is not None and evidence_ttl_s <= 0:
        raise ConfigError("evidence_ttl_s must be > 0, or None to keep frozen rollouts")
    if not key_prefix or "{" in key_prefix or "}" in key_prefix:
        raise ConfigError("key_prefix must be non-empty and contain no braces")


def check_call_id(model_call_id: str) -> None:
    if not isinstance(model_call_id, str) or not model_call_id:
        raise ValueError("model_call_id must be a non-empty string")
