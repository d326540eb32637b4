"""keyserial's own connection to each master of a Redis Cluster, for batches bound to one node.

On a cluster, redis-py's cluster pipeline spends more Python per command than the commands cost
the server: it parses each command's keys, groups them by node, and wraps every reply. Yet a
batch of keyserial's hot path (a worker's step scripts, a client's appends) already goes to one
node: ``_backend.batching`` queues per node, and every script touches one shard's slot. Such a
batch goes out here in one write on a :class:`~._backend.resp.PipelinedConnection` to that
master, as on a standalone server. A command whose slot has moved (``MOVED``, ``ASK``,
``TRYAGAIN``: it did not run) is sent again through redis-py's cluster client, which follows
the redirect, once the routing has been learnt again: what redis-py's cluster pipeline does
itself. After a batch that fails, times out or is cancelled (a lease renewal's deadline), the
routing is learnt again before the next batch: its node may be paused, or gone. (A cancelled
batch leaves the connection open, as on a standalone server: other callers' batches wait on
it. Whatever a paused node runs late is fenced like any write of a deposed owner.) Any other
batch (keys on several nodes, a command without a key) is left to redis-py.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from .resp import Command, PipelinedConnection

#: Commands of one key, the first argument, that keyserial sends in batches (named as keyserial
#: spells them).
_KEY_FIRST = frozenset(
    {"GET", "HGET", "HMGET", "HGETALL", "HLEN", "HSET", "HDEL", "XRANGE", "XREVRANGE", "XLEN"}
)
_SCRIPTS = frozenset({"EVALSHA", "EVAL"})
#: Replies that mean "not run here": the slot is served elsewhere, or moving.
_REDIRECTS = (redis_errors.MovedError, redis_errors.AskError, redis_errors.TryAgainError)


def command_key(command: Command) -> str | bytes | None:
    """The key that routes ``command`` (its script's first key), or None if it has none that
    this module knows."""
    name = command[0]
    if name in _SCRIPTS:
        if len(command) > 3 and int(command[2]) > 0:
            key: str | bytes = command[3]
            return key
        return None
    if name in _KEY_FIRST and len(command) > 1:
        key = command[1]
        return key
    return None


@lru_cache(maxsize=4096)
def _slot(key: str | bytes) -> int:
    """A key's slot (keyserial's keys are few: a shard's hash tag, a client's channel)."""
    return int(key_slot(key.encode() if isinstance(key, str) else key))


class NodeConnections:
    """A :class:`PipelinedConnection` per master of ``cluster``, opened on first use, with the
    credentials and timeouts of the cluster client's own connections to it."""

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        self._by_node: dict[str, PipelinedConnection] = {}
        #: Whether the routing must be learnt again before the next batch.
        self.stale = False

    def connection_for(self, commands: Sequence[Command]) -> PipelinedConnection | None:
        """The connection to the one master that every command's key is on, as the routing
        stands now; None if they are not all on one (or some command has no key)."""
        name = None
        slots = self._cluster.nodes_manager.slots_cache
        for command in commands:
            key = command_key(command)
            if key is None:
                return None
            nodes = slots.get(_slot(key))
            if not nodes:
                return None
            if name is None:
                name = nodes[0].name
            elif nodes[0].name != name:
                return None
        return None if name is None else self.to_node(name)

    def to_node(self, name: str) -> PipelinedConnection:
        """The connection to the node named ``name`` (``host:port``)."""
        connection = self._by_node.get(name)
        if connection is None:
            connection = self._by_node[name] = self._connect(name)
        return connection

    def _connect(self, name: str) -> PipelinedConnection:
        node = self._cluster.get_node(node_name=name)
        assert node is not None, "a node of the slots cache"
        options = node.connection_kwargs
        return PipelinedConnection(
            node.host,
            int(node.port),
            username=options.get("username"),
            password=options.get("password"),
            connect_timeout=options.get("socket_connect_timeout"),
            timeout=options.get("socket_timeout"),
        )

    async def execute(
        self, connection: PipelinedConnection, commands: Sequence[Command]
    ) -> list[Any]:
        """Each command's reply or error reply; a redirected command's from its new node."""
        try:
            replies = await connection.execute(commands)
        except BaseException:
            self.stale = True
            raise
        moved = [index for index, reply in enumerate(replies) if isinstance(reply, _REDIRECTS)]
        if not moved:
            return replies
        await self.learn_routing()
        for index in moved:  # (in order: one shard's commands keep theirs)
            try:
                replies[index] = await self._cluster.execute_command(*commands[index])
            except redis_errors.ResponseError as exc:
                replies[index] = exc
        return replies

    async def learn_routing(self) -> None:
        """Ask the cluster which master serves which slot."""
        self.stale = False
        try:
            await self._cluster.nodes_manager.initialize()
        except BaseException:
            self.stale = True
            raise

    async def aclose(self) -> None:
        for connection in self._by_node.values():
            await connection.aclose()
        self._by_node.clear()
