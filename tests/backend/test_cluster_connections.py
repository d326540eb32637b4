"""keyserial's own connection to each master of a cluster (``_backend.nodes``): a batch bound to
one node goes out on it, and a command whose slot has moved is followed to its new master."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from keyserial._backend.backend import Backend
from keyserial._backend.transport import OwnNodeConnections
from keyserial.testing import LocalCluster, LocalServer

# A 3-master cluster per test, and slots moved.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=0) as cluster:
        yield cluster


def _node_id(node: LocalServer) -> str:
    client = redis.Redis(port=node.port)
    try:
        return str(client.execute_command("CLUSTER", "MYID").decode())  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _move_empty_slot(cluster: LocalCluster, slot: int, target: LocalServer) -> None:
    """Hand an empty slot to ``target``, telling every node (no keys to migrate)."""
    target_id = _node_id(target)
    for node in [target, *(n for n in cluster.nodes if n is not target)]:
        cluster.cluster_command(node, "SETSLOT", slot, "NODE", target_id)


def _last_sent_hget(port: int) -> list[str]:
    """The addresses of the connections whose last command to the node at ``port`` was HGET."""
    client = redis.Redis(port=port)
    try:
        return [c["addr"] for c in client.client_list() if c["cmd"] == "hget"]
    finally:
        client.close()


async def test_a_batch_for_one_master_goes_on_keyserial_s_connection_to_it(
    cluster: LocalCluster,
) -> None:
    backend = await Backend.connect(f"{cluster.url}?socket_timeout=7")
    try:
        keys = [f"{{own-{n}}}:h" for n in range(12)]  # over every master
        for key in keys:
            assert await backend.pipeline([("HSET", key, "f", key), ("HGET", key, "f")]) == [
                1,
                key.encode(),
            ]
        assert isinstance(backend.transport, OwnNodeConnections)
        nodes = backend.transport._nodes
        assert len(nodes._by_node) == 3  # a connection per master
        for name, connection in nodes._by_node.items():
            assert connection.timeout == 7  # the URL's, as redis-py's connections have it
            protocol = connection._protocol
            assert protocol is not None and protocol._transport is not None
            host, port = protocol._transport.get_extra_info("sockname")[:2]
            # every connection that sent the master an HGET last is keyserial's own
            assert _last_sent_hget(int(name.rsplit(":", 1)[1])) == [f"{host}:{port}"]
        # Keys on two masters in one batch: left to redis-py, which splits it.
        mixed = [("HGET", key, "f") for key in keys]
        assert await backend.pipeline(mixed) == [key.encode() for key in keys]
    finally:
        await backend.aclose()


async def test_a_command_whose_slot_moved_is_followed_to_its_new_master(
    cluster: LocalCluster,
) -> None:
    backend = await Backend.connect(cluster.url)
    try:
        key = "{moving}:h"
        slot = key_slot(key.encode())
        await backend.call("HSET", "{moving}:other", "f", "1")  # the routing is learnt
        await backend.call("DEL", "{moving}:other")
        owner = cluster.master_of(slot)
        assert owner is not None
        target = next(node for node in cluster.nodes if node is not owner)
        _move_empty_slot(cluster, slot, target)
        # This backend still routes the slot to its old master, which answers MOVED.
        assert backend.node_of(key) == f"127.0.0.1:{owner.port}"
        assert await backend.pipeline([("HSET", key, "f", "v"), ("HGET", key, "f")]) == [1, b"v"]
        assert backend.node_of(key) == f"127.0.0.1:{target.port}"  # learnt again
        direct = redis.Redis(port=target.port)
        try:
            assert direct.hget(key, "f") == b"v"
        finally:
            direct.close()
    finally:
        await backend.aclose()
