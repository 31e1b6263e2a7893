"""A private Redis Cluster of child processes on 127.0.0.1: masters, one replica each.

For the tests and the cluster bench: each node is a ``RedisServer`` (AOF, ``appendfsync
always``) with cluster mode on, in a directory of its own, on a free port with a free bus
port (``cluster-port``). ``redis-cli --cluster create`` joins them and assigns each master
one contiguous range of slots. A short ``cluster-node-timeout`` makes a failover take
about a second or two. Nodes are stopped by the PID they were started with.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tokcap_devtools.processes import distinct_free_ports
from tokcap_devtools.redis_server import RedisServer, RedisServerUnavailable

NODE_TIMEOUT_MS = 1000


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each; ``start`` / ``stop``."""

    def __init__(self, data_dir: Path, masters: int = 3, replicas: int = 1, **options: str) -> None:
        self.data_dir = Path(data_dir)
        self.nodes: list[RedisServer] = []
        count = masters * (1 + replicas)
        ports = distinct_free_ports(2 * count)  # a client port and a bus port per node
        for index in range(count):
            node_dir = self.data_dir / f"node-{index}"
            node_dir.mkdir(parents=True, exist_ok=True)
            cluster_options = {
                "cluster-enabled": "yes",
                "cluster-config-file": "nodes.conf",
                "cluster-node-timeout": str(NODE_TIMEOUT_MS),
                "cluster-port": str(ports[count + index]),
                **options,
            }
            node = RedisServer(node_dir, **cluster_options)
            node.port = ports[index]
            self.nodes.append(node)
        self.replicas = replicas

    @property
    def url(self) -> str:
        """Any one node names the cluster; this is the first's."""
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> LocalCluster:
        if shutil.which("redis-cli") is None:
            raise RedisServerUnavailable("redis-cli is not installed (apt-get install redis-tools)")
        try:
            for node in self.nodes:
                self.start_node(node)
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                ["redis-cli", "--cluster", "create", *addresses]
                + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, node: RedisServer) -> None:
        """Start (or restart) one node, and make sure the server on its port is that node:
        a port taken meanwhile by someone else's Redis must never join this cluster."""
        node.start()
        with redis.Redis(port=node.port, socket_timeout=5) as client:
            answering = client.info("server")["process_id"]
        if node.proc is None or answering != node.proc.pid:
            node.stop()
            raise RuntimeError(f"port {node.port} is served by another process ({answering})")

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every running node says the cluster is ok and each master has its replicas."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the cluster in {self.data_dir} is not healthy after {timeout}s"
                )
            time.sleep(0.1)

    def healthy(self) -> bool:
        try:
            running = [node for node in self.nodes if node.proc and node.proc.poll() is None]
            for node in running:
                with redis.Redis(port=node.port, socket_timeout=1) as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
            for node in self.masters():
                with redis.Redis(port=node.port, socket_timeout=1) as client:
                    replication = client.info("replication")
                    online = [
                        value
                        for name, value in replication.items()
                        if name.startswith("slave") and isinstance(value, dict)
                    ]
                    if len([r for r in online if r.get("state") == "online"]) < self.replicas:
                        return False
            return len(self.masters()) * (1 + self.replicas) == len(running)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters now (a failover changes which)."""
        found = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                if client.info("replication")["role"] == "master":
                    found.append(node)
        return found

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
