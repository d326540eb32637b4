"""The cluster profile's system: a 3-master / 3-replica Redis Cluster and the worker slots.

Workers and clients reach the cluster directly: a TCP proxy cannot stand between a cluster
client and the nodes its redirections name. Every node persists with ``appendfsync always``,
so a master killed and restarted before its failover comes back with what it acknowledged (a
master that restarts empty and keeps its slots loses everything, whatever keyserial does).
"""

from __future__ import annotations

from pathlib import Path

import anyio
from redis.asyncio.cluster import RedisCluster

from keyserial.testing import LocalCluster
from tests.nemesis.schedule import Plan
from tests.nemesis.system import BaseSystem
from tests.nemesis.tap import StreamTap

#: Seconds a healed cluster may take to have every slot served and every replica in sync.
HEAL_SECONDS = 60.0


class ClusterSystem(BaseSystem):
    def __init__(self, plan: Plan, workdir: Path) -> None:
        super().__init__(plan, workdir)
        self.cluster = LocalCluster(
            appendfsync="always", node_timeout_ms=1500, data_dir=workdir / "cluster"
        )

    def client(self) -> RedisCluster:
        """A cluster client through a node that answers now."""
        return RedisCluster.from_url(self.cluster.url, socket_timeout=5, socket_connect_timeout=2)

    async def start_redis(self) -> None:
        await anyio.to_thread.run_sync(self.cluster.start)
        self.inspector = self.client()

    async def stop_redis(self) -> None:
        await anyio.to_thread.run_sync(self.cluster.stop)

    def worker_url(self, slot: int) -> str:
        return self.cluster.url

    def client_urls(self) -> list[str]:
        return [self.cluster.url] * self.profile.clients

    def tap(self) -> StreamTap:
        return StreamTap(self.client, self.namespace, self.profile.shard_count, per_stream=True)

    async def heal_redis(self) -> None:
        """Resume paused nodes, restart dead ones (each rejoins, as a replica if it was failed
        over), and wait until the cluster is whole."""
        for node in self.cluster.nodes:
            if node.port in self.cluster.paused:
                self.cluster.resume(node)
            if not node.running:
                await anyio.to_thread.run_sync(node.start)
        try:
            await anyio.to_thread.run_sync(self.cluster.wait_healthy, HEAL_SECONDS)
        except RuntimeError as error:
            self.heal_notes.append(str(error))
