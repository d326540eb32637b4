"""The deployment a run measures: one standalone server, or every master of a Redis Cluster.

The harness reads statistics (``INFO commandstats``, ``INFO cpu``) and deletes a run's keys
node by node, summing over a cluster's masters, so a figure per op means the same on both; it
seeds and reads balances through a client that routes each key to its node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from . import metrics

_CHUNK = 1000


class BenchServer:
    """Admin access to the server (or cluster) at ``url``; :meth:`open` asks which it is."""

    def __init__(self, url: str, data: Redis | RedisCluster, nodes: list[Redis]) -> None:
        self.url = url
        #: Routes each key to the node that holds it.
        self.data = data
        #: A client per node that serves keys: the server itself, or each cluster master.
        self.nodes = nodes

    @classmethod
    async def open(cls, url: str) -> BenchServer:
        probe = Redis.from_url(url)
        try:
            cluster = bool((await probe.info("cluster")).get("cluster_enabled"))
        except BaseException:
            await probe.aclose()
            raise
        if not cluster:
            return cls(url, probe, [probe])
        await probe.aclose()
        routing = RedisCluster.from_url(url)
        await routing.initialize()
        masters = [Redis(host=node.host, port=int(node.port)) for node in routing.get_primaries()]
        return cls(url, routing, masters)

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.data, RedisCluster)

    @property
    def first(self) -> Redis:
        """The node whose ``INFO server`` describes the deployment."""
        return self.nodes[0]

    async def aclose(self) -> None:
        for node in self.nodes:
            await node.aclose()
        if self.is_cluster:
            await self.data.aclose()

    async def commandstats(self) -> Counter[str]:
        calls: Counter[str] = Counter()
        for node in self.nodes:
            calls.update(await metrics.commandstats(node))
        return calls

    async def cpu_seconds(self) -> float:
        return sum([await metrics.server_cpu_seconds(node) for node in self.nodes])

    async def reset_stats(self) -> None:
        for node in self.nodes:
            await node.config_resetstat()

    async def set_many(self, values: Mapping[str, int]) -> None:
        if isinstance(self.data, RedisCluster):
            await self.data.mset_nonatomic(dict(values))
        else:
            await self.data.mset(dict(values))

    async def get_many(self, keys: Sequence[str]) -> list[Any]:
        if isinstance(self.data, RedisCluster):
            return list(await self.data.mget_nonatomic(list(keys)))
        return list(await self.data.mget(list(keys)))

    async def delete_matching(self, pattern: str) -> int:
        """Delete every key matching ``pattern`` on every node; how many."""
        deleted = 0
        for node in self.nodes:
            batch: list[bytes] = []
            async for key in node.scan_iter(match=pattern, count=_CHUNK):
                batch.append(key)
                if len(batch) >= _CHUNK:
                    deleted += await _unlink(node, batch)
                    batch = []
            deleted += await _unlink(node, batch)
        return deleted


async def _unlink(node: Redis, keys: list[bytes]) -> int:
    """Unlink ``keys`` of one node: one UNLINK each, in one pipeline (a cluster node refuses one
    UNLINK of keys in different slots)."""
    if not keys:
        return 0
    async with node.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.unlink(key)
        return sum(await pipe.execute())
