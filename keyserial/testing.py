"""Run keyserial for real in a test suite: a private server, a worker in process, the key layout.

keyserial's own tests use exactly these; so can yours (docs/testing.md)::

    with LocalServer() as server:
        async with running_worker(server.url), keyserial.connect(server.url) as ks:
            assert await ks.submit("account:5", deposit(100)) == 100

Real Redis rather than a fake: the guarantees live in Lua scripts, streams and pub/sub that a
fake would have to reimplement. :class:`LocalCluster` is a private Redis Cluster of several
nodes (with replicas, for failovers). :class:`ShardKeys` names a shard's keys (stream, state,
results; docs/wire-format.md), for a test that looks into Redis.
"""

from ._local.cluster import LocalCluster as LocalCluster
from ._local.running import running_worker as running_worker
from ._local.server import LocalServer as LocalServer
from ._local.server import find_server_binary as find_server_binary
from ._local.server import free_port as free_port
from ._wire.layout import ShardKeys as ShardKeys

__all__ = [
    "LocalCluster",
    "LocalServer",
    "ShardKeys",
    "find_server_binary",
    "free_port",
    "running_worker",
]
