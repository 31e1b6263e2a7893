"""What a rebuild worker process is told: its Redis, streams, group, pace, delivery and
where it serves its metrics.

The CLI (``tokcap worker``) fills it from flags; tests and embedders build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capture.build.segments import Delivery, checked_delivery
from capture.retention import TOMBSTONE_TTL_S
from transports.redis import keys as k
from transports.redis.clients import RedisOptions
from transports.redis.keys import Streams


@dataclass
class WorkerSettings:
    """Everything a worker process needs; the CLI fills it from flags."""

    url: str  # no Redis is assumed (``tokcap.commands.redis_url``): the caller names it
    key_prefix: str = k.DEFAULT_PREFIX
    group: str = "rebuild"
    consumer: str = field(default_factory=k.consumer_name)
    concurrency: int = 4
    claim_idle_ms: int = 60_000
    max_attempts: int = 5
    block_ms: int = 1000
    durability: str = "fsync"
    wait_timeout_ms: int = 5000
    guard_ttl_s: int = TOMBSTONE_TTL_S  # a re-run while the tombstone lives finds its guard
    jobs_stream: str | None = None  # default <key_prefix>:rebuild
    results_stream: str | None = None  # default <key_prefix>:results
    dead_stream: str | None = None  # default <key_prefix>:rebuild:dead
    shards: int = 1  # job and result streams; submitters and trainers must use as many
    cluster: bool = False  # the url names one node of a Redis Cluster
    # What a rebuild delivers and the least it may (token_id_capture's keys of the same name).
    delivery: Delivery = "chain"
    min_delivered_fraction: float | None = None
    # Prometheus metrics (``transports.rebuild.metrics``): served only when a port is given
    # (0: any free one), on loopback unless another host is named; the queue is sampled
    # every metrics_interval_s while they are served.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_interval_s: float = 5.0

    @property
    def redis(self) -> RedisOptions:
        """The worker's Redis as one options object, for its store, whose client also reads
        the jobs: the socket timeout leaves room for a read that blocks ``block_ms``."""
        return RedisOptions(
            url=self.url,
            cluster=self.cluster,
            durability=self.durability,
            wait_timeout_ms=self.wait_timeout_ms,
            socket_timeout_s=RedisOptions.socket_timeout_s + self.block_ms / 1000,
        )

    def __post_init__(self) -> None:
        jobs, results, dead = k.stream_names(self.key_prefix)
        self.jobs_stream = self.jobs_stream or jobs
        self.results_stream = self.results_stream or results
        self.dead_stream = self.dead_stream or dead
        if self.concurrency < 1 or self.max_attempts < 1 or self.claim_idle_ms < 1:
            raise ValueError("concurrency, max_attempts and claim_idle_ms must be >= 1")
        checked_delivery(self.delivery)
        fraction = self.min_delivered_fraction
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise ValueError(f"min_delivered_fraction must be within [0, 1], not {fraction}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be within [0, 65535], not {self.metrics_port}")
        if self.metrics_interval_s <= 0:
            raise ValueError("metrics_interval_s must be > 0")
        base = Streams(self.jobs_stream, self.results_stream, self.dead_stream)
        self.shard_streams = k.shard_streams(base, self.shards, tagged=self.cluster)
