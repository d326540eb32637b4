"""redis-py's own connections, where keyserial still uses them (clusters, TLS, callers' clients)."""

from __future__ import annotations

import pytest
import redis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection

from keyserial import BackendUnavailable
from keyserial._backend.backend import Backend
from keyserial._backend.resp import CloseSafeConnection
from keyserial.testing import LocalServer


def closed_under_the_write(base: type[Connection]) -> type[Connection]:
    """A connection that another task closes while it writes (as a cluster client resetting its
    connections after one failed does): the writer is torn down after the connected check."""

    class Raced(base):  # type: ignore[valid-type,misc]
        armed = False

        async def check_health(self) -> None:
            if self.armed:
                self.armed = False
                self._writer = None

    return Raced


@pytest.mark.parametrize("timeout", [None, 5.0])
async def test_a_connection_closed_under_a_write_is_a_connection_error(
    standalone_server: LocalServer, timeout: float | None
) -> None:
    """redis-py leaks AttributeError there (redis/redis-py#3546), which no retry recognises."""
    port = standalone_server.port
    plain = closed_under_the_write(Connection)(port=port, socket_timeout=timeout)
    safe = closed_under_the_write(CloseSafeConnection)(port=port, socket_timeout=timeout)
    for connection in (plain, safe):
        await connection.connect()
        connection.armed = True  # type: ignore[attr-defined]
    try:
        with pytest.raises(AttributeError):
            await plain.send_packed_command(plain.pack_command("PING"))
        with pytest.raises(redis_errors.ConnectionError, match="closed during a write"):
            await safe.send_packed_command(safe.pack_command("PING"))
        await safe.send_packed_command(safe.pack_command("PING"))  # it reconnects
        assert await safe.read_response() == b"PONG"
    finally:
        for connection in (plain, safe):
            await connection.disconnect()


async def test_a_cluster_backend_opens_close_safe_connections(cluster_server: LocalServer) -> None:
    backend = await Backend.connect(cluster_server.url)
    try:
        await backend.call("SET", "{close-safe}key", "1")
        client = backend.transport.client
        assert isinstance(client, RedisCluster)
        connections = [c for node in client.get_nodes() for c in node._connections]
        assert connections
        assert all(isinstance(c, CloseSafeConnection) for c in connections)
    finally:
        await backend.aclose()


@pytest.mark.slow
async def test_a_command_whose_client_learns_the_routing_while_no_master_is_known_waits() -> None:
    """redis-py's cluster client learns the routing inside any command it sends after a node
    failed (or before its first): mid-failover that raises its IndexError too. The boundary
    makes it BackendUnavailable, which worker loops wait out (a takeover run once had a worker
    exit on it, from a lease release); any other IndexError stays a bug, raised as it is."""
    with LocalServer(cluster=True) as server:
        with redis.Redis(port=server.port) as admin:
            admin.execute_command("CLUSTER", "FLUSHSLOTS")  # no node serves any slot now
        client = RedisCluster(host="127.0.0.1", port=server.port, require_full_coverage=False)
        try:
            with pytest.raises(BackendUnavailable, match="no master known yet"):
                await Backend.connect(client)  # its first command learns the routing
        finally:
            await client.aclose()


@pytest.mark.slow
async def test_a_cluster_client_whose_masters_were_all_replicas_once_recovers() -> None:
    """redis-py keeps each node's cached type across failovers (redis/redis-py#2433): once
    every master has been a replica (three takeovers on three masters), its client finds no
    master at every command, for good. A takeover run had a worker stuck so, holding a shard.
    The first command after that is BackendUnavailable; the boundary gives the nodes the types
    the slots say, and the next command goes through."""
    with LocalServer(cluster=True) as server:
        client = RedisCluster(host="127.0.0.1", port=server.port)
        backend = await Backend.connect(client)
        try:
            for node in client.nodes_manager.nodes_cache.values():
                node.server_type = "replica"  # as cached before this node was promoted
            with pytest.raises(BackendUnavailable, match="no master known yet"):
                await backend.refresh_routing()
            await backend.refresh_routing()
            assert await backend.call("SET", "recovered", "1") is True
        finally:
            await backend.aclose()
            await client.aclose()


@pytest.mark.slow
async def test_routing_learnt_while_no_master_is_known_is_a_backend_outage() -> None:
    """Mid-failover, a cluster can report no master at all; redis-py then fails with an
    IndexError. Learning the routing again (as keyserial does after a failover's errors) must
    raise BackendUnavailable, which every caller waits out, not crash whoever asked."""
    with LocalServer(cluster=True) as server:
        client = RedisCluster(host="127.0.0.1", port=server.port, require_full_coverage=False)
        backend = await Backend.connect(client)
        try:
            with redis.Redis(port=server.port) as admin:
                admin.execute_command("CLUSTER", "FLUSHSLOTS")  # no node serves any slot now
            with pytest.raises(BackendUnavailable, match="no master known yet"):
                await backend.refresh_routing()
        finally:
            await backend.aclose()
            await client.aclose()
