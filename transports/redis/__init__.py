"""The Redis transport: the token store, its keys, transactions and durability proof.

``transports.redis:RedisTokenSink`` is the path a Gym config names, so the store's public
names are exported here.
"""

from transports.redis.reach import RedisUnavailableError
from transports.redis.store import (
    ContentionError,
    RedisTokenSink,
    RedisTokenSource,
    RedisTokenStore,
)

__all__ = [
    "ContentionError",
    "RedisTokenSink",
    "RedisTokenSource",
    "RedisTokenStore",
    "RedisUnavailableError",
]
