"""How keyserial's commands reach Redis: one transport per connection, chosen once when it
connects (:func:`open_transport`), and the one place that reads what Redis answers:
:func:`classify_reply` maps every failure to keyserial's exceptions, as httpx's
``map_httpcore_exceptions`` maps its transport's. An unreachable server or a "not now" reply
becomes ``BackendUnavailable``, refused credentials ``ConfigError``, an error reply what
``_scripts.refusals.refusal`` makes of it.

Every transport does the same three things, whatever is below it: send a batch of commands (to
one node: the one a key lives on, where the batch must stay on one connection), publish after
what was sent, and subscribe. Three kinds:

- :class:`Transport`, redis-py's client: a caller's own, or one keyserial opened where it keeps
  redis-py's connections (TLS, a Unix socket, no hiredis);
- :class:`OwnConnection`, keyserial's own pipelined connection (``_backend.resp``) to a
  standalone server: the hot path's, which publishes without waiting;
- :class:`OwnNodeConnections`, keyserial's own connection per master of a cluster
  (``_backend.nodes``), redis-py's client for the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool, parse_url
from redis.cluster import PRIMARY, REPLICA

from .._backoff import Backoff
from .._scripts.refusals import Refused, refusal
from .._wire.layout import is_shard_channel
from ..errors import BackendUnavailable, ConfigError, KeyserialError, redact
from .commands import Command, publish_command, raised
from .nodes import NodeConnections
from .outage import Outage
from .resp import (
    URL_TIMEOUTS,
    AnyRedis,
    PipelinedConnection,
    Subscriber,
    client_options,
    describe,
    own_connections,
    pipelined_connection,
    use_close_safe_connections,
)
from .subscriptions import (
    FIRST_SUBSCRIPTION_WITHIN,
    SUBSCRIBE_ROUND_TRIPS,
    GroupedSubscription,
    PubSubSubscription,
    Subscription,
)

log = logging.getLogger("keyserial")

#: Errors that mean "the server could not be reached or answered in time". A cluster client
#: reports an unreachable cluster as RedisClusterException; a node that is still joining after
#: a restart answers CLUSTERDOWN.
_UNREACHABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.RedisClusterException,
    redis_errors.ClusterDownError,
    OSError,
)
#: Error replies that mean "not now": the server is loading its dataset, running a slow script
#: (BUSY), or its cluster is failing over; or it refuses writes for now, out of memory (OOM) or
#: unable to persist (MISCONF). The command was not executed; it may be sent again. (A script
#: meets OOM at its first write, so one refused so wrote nothing before.)
_TRANSIENT_PREFIXES = (
    "BUSY ",
    "LOADING",
    "TRYAGAIN",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "READONLY",
    "NOREPLICAS",
    "NOTREADY",
    "UNBLOCKED",
    "OOM ",
    "MISCONF ",
)
#: An append to a stream whose last id is the largest there is (an entry appended under it by
#: hand): "not now" too, since its owner starts the stream again once it has run that entry.
_STREAM_EXHAUSTED = "exhausted the last possible ID"
#: The same, as redis-py classes them (it strips their code from the message). MOVED and ASK
#: reach keyserial on a connection to one node (a write sent with its WAIT): the slot moved.
_TRANSIENT_TYPES = (
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.AskError,
    redis_errors.OutOfMemoryError,
)
#: Error replies that no retry cures: the credentials or the ACL user do not allow keyserial in.
_REFUSED = (redis_errors.AuthenticationError, redis_errors.NoPermissionError)
#: Everything redis-py raises (a cluster client's "no node reachable" is not a RedisError).
_REDIS_ERRORS = (redis_errors.RedisError, redis_errors.RedisClusterException)
#: What a subscription is made again after: a lost connection, or any error reply (BUSY...).
_RESUBSCRIBE_AFTER = (*_REDIS_ERRORS, KeyserialError, OSError)


def classify_reply(reply: Any, url: str) -> Any:
    """A reply as keyserial sees it (every reply from Redis passes through here): an error
    becomes keyserial's exception (see the module's doc); other replies pass through."""
    if not isinstance(reply, _REDIS_ERRORS):
        return reply
    error: Exception
    if isinstance(reply, _REFUSED):
        error = ConfigError(f"Redis at {redact(url)} refused keyserial: {reply}")
    elif (
        isinstance(reply, (*_UNREACHABLE, *_TRANSIENT_TYPES))
        or str(reply).startswith(_TRANSIENT_PREFIXES)
        or _STREAM_EXHAUSTED in str(reply)
    ):
        error = BackendUnavailable(url, reply)
    elif isinstance(reply, redis_errors.ResponseError):
        missing = isinstance(reply, redis_errors.NoScriptError)
        error = refusal(str(reply), script_missing=missing)
    else:
        return reply  # (a defect, such as an argument redis-py cannot pack: shown as it is)
    error.__cause__ = reply  # (kept when it is raised later, from a pipeline's replies)
    return error


@contextlib.contextmanager
def _translating(
    url: str, *, lost: bool = False, cluster: RedisCluster | None = None
) -> Iterator[None]:
    """Raise keyserial's errors for redis-py's and a socket's; ``lost``: any but an error reply
    means an unusable connection (a subscription's); ``cluster``: the client, to repair."""
    try:
        yield
    except redis_errors.InvalidResponse as exc:  # a port another server listens on
        error = BackendUnavailable(url, f"the server there does not speak Redis ({exc})")
        raise error from exc
    except _REDIS_ERRORS as exc:
        translated = classify_reply(exc, url)
        if translated is not exc:
            raise translated from exc
        if lost:
            raise BackendUnavailable(url, exc) from exc
        raise
    except OSError as exc:
        raise BackendUnavailable(url, exc) from exc
    except IndexError as exc:  # a cluster client learning the routing found no master
        if not _raised_by_redis_py(exc):  # (from elsewhere: a bug)
            raise
        if cluster is not None:
            _retype_nodes(cluster)
        raise BackendUnavailable(url, "no master known yet") from exc


def has_sharded_pubsub(version: str) -> bool:
    """Whether a server of ``version`` (``redis_version``: Valkey reports 7.2.4) has SPUBLISH."""
    major = version.partition(".")[0]
    return major.isdigit() and int(major) >= 7


def _retype_nodes(cluster: RedisCluster) -> None:
    """Give each node the type the slots it just read say. redis-py keeps a node's cached type
    across a failover (redis/redis-py#2433): once every master has been a replica, it finds no
    master at all, at every command, for good."""
    manager = cluster.nodes_manager
    masters = {nodes[0].name for nodes in manager.slots_cache.values() if nodes}
    for name, node in manager.nodes_cache.items():
        node.server_type = PRIMARY if name in masters else REPLICA


def _raised_by_redis_py(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}redis{os.sep}" in frames[-1].filename


def check_url(url: str) -> None:
    """Refuse a URL that redis-py cannot use (a scheme, a port), before anything connects.

    :raises ConfigError: naming the URL, its password hidden.
    """
    try:
        parse_url(url)
    except ValueError as exc:  # (redis-py's word for a URL it cannot use)
        raise ConfigError(f"{redact(url)} is not a usable Redis URL: {exc}") from None


async def open_transport(redis: str | AnyRedis) -> Transport:
    """Open ``redis`` (a URL, or a client the caller configured and keeps owning), with the
    transport that serves it. A URL that points at a cluster node gets a cluster client: the
    deployment is asked.

    :raises BackendUnavailable: if the server does not answer.
    """
    if not isinstance(redis, str):
        transport = Transport(redis, describe(redis), owned=False)
        await transport.ping()
        await transport.learn_pubsub()
        return transport
    try:
        probe = Redis.from_url(redis, **URL_TIMEOUTS)
    except ValueError as exc:  # (redis-py's word for a URL it cannot use)
        raise ConfigError(f"{redact(redis)} is not a usable Redis URL: {exc}") from None
    try:
        with _translating(redis):
            info = await probe.info("cluster")
    except Refused as exc:  # (at connecting: a database the server does not have)
        raise ConfigError(f"Redis at {redact(redis)} refused the connection: {exc}") from None
    finally:
        await probe.aclose()
    if info.get("cluster_enabled"):
        cluster = RedisCluster.from_url(redis, **URL_TIMEOUTS)
        use_close_safe_connections(cluster, redis)
        try:
            with _translating(redis):
                await cluster.initialize()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await cluster.aclose()
            raise
        if own_connections(redis):
            transport = OwnNodeConnections(cluster, redis)
        else:
            transport = Transport(cluster, redis, owned=True)
        await transport.learn_pubsub()
        return transport
    client = Redis.from_url(redis, **client_options(redis))
    connection = pipelined_connection(client)
    if connection is None:
        return Transport(client, redis, owned=True)
    return OwnConnection(client, redis, connection)


class Transport:
    """A connection to one Redis deployment, standalone or cluster, through redis-py's client;
    the base of keyserial's own (:class:`OwnConnection`, :class:`OwnNodeConnections`). Every
    method raises ``BackendUnavailable`` if the server does not answer."""

    #: Whether :meth:`publish_after` waits for a round trip (redis-py's connections: a pool,
    #: whose next command may go out on another connection); where it does, a batch's scripts
    #: publish their own messages instead (``_backend.durability.run_publishing``).
    publish_after_waits = True
    #: Whether a command is sent at most once (redis-py may send one again after a lost
    #: connection; keyserial's own connection never does).
    sends_once = False

    def __init__(self, client: AnyRedis, url: str, *, owned: bool) -> None:
        self.client = client
        #: For messages and logs: the password is hidden.
        self.url = redact(url)
        #: Whether the server has failed to answer since it last did; warnings of callers that
        #: retry go through it (see ``_backend.outage``).
        self.outage = Outage(self.url)
        #: The client if it is a cluster's (checked once: RedisCluster is a Protocol, whose
        #: isinstance is slow, and node_of runs for every call).
        self._cluster = client if isinstance(client, RedisCluster) else None
        self._owned = owned
        #: On a cluster, a plain client per master, for :meth:`send` to one node.
        self._node_clients: dict[str, Redis] = {}
        #: Whether wake-ups, replies and coordination messages travel as shard messages
        #: (``_wire.layout.in_shard``): on a cluster of servers that have them (Redis 7+,
        #: Valkey); set by :meth:`learn_pubsub`.
        self.sharded_pubsub = False

    async def learn_pubsub(self) -> None:
        """Use sharded pub/sub on a cluster whose servers have it (Redis 7+, Valkey): else every
        PUBLISH travels to every node of the cluster."""
        if self._cluster is None:
            return
        node = self._cluster.get_default_node()
        with _translating(self.url, cluster=self._cluster):
            info = await self._cluster.execute_command("INFO", "server", target_nodes=node)
        self.sharded_pubsub = has_sharded_pubsub(str(info.get("redis_version", "")))

    async def aclose(self) -> None:
        for client in self._node_clients.values():
            await client.aclose()
        if self._owned:
            await self.client.aclose()

    async def ping(self) -> None:
        (reply,) = await self.send([("PING",)])
        raised(reply)

    # -- sending -------------------------------------------------------------------------------

    async def send(self, commands: Sequence[Command], key: str | None = None) -> list[Any]:
        """Commands in one pipeline (on a cluster, routed by key): each reply, or its error.
        ``key``: the commands go in order on one connection to the master that holds it (as a
        WAIT must follow the write it covers)."""
        with _translating(self.url, cluster=self._cluster):
            client = self.client if key is None else self._node_client(key)
            replies = await self._redis_py(client, commands)
        return self._answered(replies)

    async def on_node(self, key: str, commands: Sequence[Command]) -> list[Any]:
        """Commands in order on one connection to the master that holds ``key`` (as a WAIT
        must follow the write it covers): each reply, or its error. On a cluster, an unreachable
        node may have failed over: the routing is learnt again before the error is raised."""
        try:
            return await self.send(commands, key)
        except BackendUnavailable:
            if self._cluster is not None:
                with contextlib.suppress(BackendUnavailable):
                    await self.refresh_routing()
            raise

    def _answered(self, replies: list[Any]) -> list[Any]:
        self.outage.answered()
        return [classify_reply(reply, self.url) for reply in replies]

    async def _redis_py(self, client: AnyRedis, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply or its error reply (not raised, as in a pipeline)."""
        if len(commands) == 1:
            try:
                return [await client.execute_command(*commands[0])]
            except redis_errors.ResponseError as exc:
                return [exc]
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        # A cluster pipeline returns a node's connection error as that command's reply.
        for reply in replies:
            if isinstance(reply, _UNREACHABLE):
                raise BackendUnavailable(self.url, reply)
        return replies

    async def publish_after(self, messages: Sequence[tuple[str, str]]) -> None:
        """``PUBLISH`` each ``(channel, message)`` after every command sent so far and before
        any sent once this returns, at most once: here each sent and answered in turn (on
        keyserial's own connection, written at once, see :class:`OwnConnection`). What cannot
        go out (the connection lost meanwhile, no answer) is logged, not raised: a message is a
        hint, whose reader looks up what it tells once it is overdue."""
        try:
            for channel, message in messages:
                raised((await self.send([publish_command(channel, message)]))[0])
        except BackendUnavailable as exc:
            log.warning("%d messages not published: %s", len(messages), exc)

    # -- routing -------------------------------------------------------------------------------

    @property
    def is_cluster(self) -> bool:
        """Whether the deployment is a cluster: its slots on several masters, routed by key."""
        return self._cluster is not None

    @property
    def one_script_reaches_every_shard(self) -> bool:
        """Whether one script may read and write the keys of several shards (a standalone
        server): on a cluster a script's keys must share a slot, and each shard has its own."""
        return self._cluster is None

    def node_of(self, key: str) -> str:
        """The master that serves ``key``, as this client knows ('' on a standalone server)."""
        if self._cluster is None:
            return ""
        try:
            node = self._cluster.get_node_from_key(key)
        except redis_errors.RedisClusterException:  # a slot no master serves right now
            return ""
        return "" if node is None else node.name

    async def refresh_routing(self) -> None:
        """Ask a cluster again which master serves which slot (after a failover).

        :raises BackendUnavailable: if no node answers, or none knows a master yet."""
        if self._cluster is None:
            return
        with _translating(self.url, cluster=self._cluster):
            await self._cluster.nodes_manager.initialize()

    def _node_client(self, key: str) -> AnyRedis:
        """A plain client of the master that holds ``key`` (one connection, as a cluster's
        routing cannot promise)."""
        if self._cluster is None:
            return self.client
        node = self._cluster.get_node_from_key(key)
        if node is None:
            raise BackendUnavailable(self.url, f"no node serves the slot of {key!r}")
        client = self._node_clients.get(node.name)
        if client is None:
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            client = self._node_clients[node.name] = Redis.from_pool(pool)
        return client

    # -- subscriptions -------------------------------------------------------------------------

    async def listen(
        self,
        channels: Sequence[str],
        on_message: Callable[[str, bytes], None],
        *,
        health_interval: float = 5.0,
        on_resubscribed: Callable[[], None] | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Subscribe to ``channels`` and hand every message to ``on_message(channel, data)``
        until cancelled, resubscribing after a lost connection, an error reply, or a failed
        health check (a PING every ``health_interval`` seconds, answered within as long: a
        connection dropped without a word only goes quiet). Messages published while the
        connection was down are lost: ``on_resubscribed()`` is called after each
        resubscription, for the caller to read at once what a lost message would have told it
        (it keeps a fallback too: result sweep, idle polling).

        :raises BackendUnavailable: if the first subscription fails (before ``started()``).
        """
        subscription = self._subscription(channels, on_message)
        try:
            with _translating(self.url):
                await subscription.subscribe(FIRST_SUBSCRIPTION_WITHIN)
            task_status.started()
            while True:
                error = await subscription.until_lost(health_interval)
                self.outage.warn(
                    log, "subscription to %s lost (%s); resubscribing", self.url, error
                )
                await self._resubscribe(subscription, SUBSCRIBE_ROUND_TRIPS * health_interval)
                if on_resubscribed is not None:
                    on_resubscribed()
        finally:
            with anyio.CancelScope(shield=True):
                await subscription.aclose()

    async def _resubscribe(self, subscription: Subscription, within: float) -> None:
        """Subscribe again, each try for at most ``within`` seconds (one that goes quiet before
        it confirms is lost too), at a steady pace: a growing gap would only delay replies."""
        pause = Backoff(0.2, 0.2)
        while True:
            await pause.sleep()
            try:
                await subscription.subscribe(within)
                self.outage.answered()
                return
            except _RESUBSCRIBE_AFTER as exc:
                self.outage.warn(
                    log,
                    "resubscribing to %s failed (%s); trying again in %gs",
                    self.url,
                    exc,
                    pause.delay,
                )

    def _subscription(
        self, channels: Sequence[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        """A subscription that connects as the command connections do (TLS and its
        certificates included), with no read timeout. On a cluster, channel messages reach
        every node, so one node does; shard channels are subscribed on the master of each."""
        if self._cluster is not None and any(map(is_shard_channel, channels)):
            return GroupedSubscription(partial(self._cluster_parts, channels, on_message))
        if isinstance(self.client, RedisCluster):
            node = self.client.get_default_node()
            assert node is not None, "cluster client is initialized when it connects"
            kind: type[AbstractConnection] = node.connection_class
            options = node.connection_kwargs
        elif self._owned:
            pool = self.client.connection_pool
            kind, options = pool.connection_class, pool.connection_kwargs
        else:
            return PubSubSubscription(_PubSub(self.client.pubsub(), self.url), channels, on_message)
        # (With its class: a TLS connection's options alone would make a plaintext one.)
        pool = ConnectionPool(connection_class=kind, **{**options, "socket_timeout": None})
        pubsub = Redis.from_pool(pool).pubsub()
        return PubSubSubscription(_PubSub(pubsub, self.url), channels, on_message)

    async def _cluster_parts(
        self, channels: Sequence[str], on_message: Callable[[str, bytes], None], again: bool
    ) -> list[Subscription]:
        """A subscription per master for the shard channels of the slots it serves, and one
        for the other channels. ``again`` (after a loss): the routing is learnt again first,
        since a failover or a slot move has changed it."""
        cluster = self._cluster
        assert cluster is not None
        if again:
            await self.refresh_routing()
        by_node: dict[str, tuple[Any, list[str]]] = {}
        with _translating(self.url, cluster=cluster):
            for channel in filter(is_shard_channel, channels):
                node = cluster.get_node_from_key(channel)
                if node is None:
                    raise BackendUnavailable(self.url, f"no master serves {channel!r}")
                by_node.setdefault(node.name, (node, []))[1].append(channel)
        parts: list[Subscription] = [
            self._shard_subscription(node, shard_channels, on_message)
            for node, shard_channels in by_node.values()
        ]
        classic = [channel for channel in channels if not is_shard_channel(channel)]
        if classic:
            default = cluster.get_default_node()
            assert default is not None, "cluster client is initialized when it connects"
            parts.append(
                PubSubSubscription(_PubSub(_pubsub_of(default), self.url), classic, on_message)
            )
        return parts

    def _shard_subscription(
        self, node: Any, channels: list[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        """A subscription to shard channels of one master, on redis-py's connection to it."""
        pubsub = _PubSub(_pubsub_of(node), self.url)
        return PubSubSubscription(pubsub, channels, on_message, sharded=True)


class OwnConnection(Transport):
    """keyserial's own pipelined connection to a standalone server (``_backend.resp``): the
    hot path's. It publishes after a batch without waiting (the next batch goes out behind
    it on the same connection), and a subscription shares its socket's reader."""

    publish_after_waits = False
    sends_once = True

    def __init__(self, client: Redis, url: str, connection: PipelinedConnection) -> None:
        super().__init__(client, url, owned=True)
        self._connection = connection

    async def aclose(self) -> None:
        await self._connection.aclose()
        await super().aclose()

    async def send(self, commands: Sequence[Command], key: str | None = None) -> list[Any]:
        with _translating(self.url):
            replies = await self._connection.execute(commands)
        return self._answered(replies)

    async def publish_after(self, messages: Sequence[tuple[str, str]]) -> None:
        commands = [publish_command(channel, message) for channel, message in messages]
        if not self._connection.send_nowait(commands):
            log.warning("connection lost: %d messages not published", len(messages))

    def _subscription(
        self, channels: Sequence[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        return Subscriber(self._connection, channels, on_message)


class OwnNodeConnections(Transport):
    """keyserial's own connection per master of a cluster (``_backend.nodes``), for batches
    whose keys one master serves and for shard channels; redis-py's cluster client for the
    rest (a batch sent in order to one node, a batch across masters)."""

    def __init__(self, cluster: RedisCluster, url: str) -> None:
        super().__init__(cluster, url, owned=True)
        self._nodes = NodeConnections(cluster)

    async def aclose(self) -> None:
        await self._nodes.aclose()
        await super().aclose()

    async def send(self, commands: Sequence[Command], key: str | None = None) -> list[Any]:
        if key is not None:
            return await super().send(commands, key)
        if self._nodes.stale:
            with _translating(self.url, cluster=self._cluster):
                await self._nodes.learn_routing()
        own = self._nodes.connection_for(commands)
        if own is None:
            return await super().send(commands)
        # (If it fails, the next batch learns the routing first: the master may have failed
        # over.)
        with _translating(self.url, cluster=self._cluster):
            replies = await self._nodes.execute(own, commands)
        return self._answered(replies)

    def _shard_subscription(
        self, node: Any, channels: list[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        return Subscriber(self._nodes.to_node(node.name), channels, on_message, sharded=True)


def _pubsub_of(node: Any) -> PubSub:
    """A pub/sub connection to a cluster node, made as its command connections are (TLS
    included), with no read timeout."""
    options = {**node.connection_kwargs, "socket_timeout": None}
    pool = ConnectionPool(connection_class=node.connection_class, **options)
    return Redis.from_pool(pool).pubsub()


class _PubSub:
    """redis-py's ``PubSub`` as a ``_backend.subscriptions.PubSubPort``: keyserial's errors only, an
    error reply as a message of type ``"error"``."""

    def __init__(self, pubsub: PubSub, url: str) -> None:
        self._pubsub = pubsub
        self._url = url

    async def subscribe(self, channels: Sequence[str], *, sharded: bool = False) -> None:
        await self._drop_connection()
        with _translating(self._url, lost=True):
            # (redis-py's asyncio PubSub has no ssubscribe, but reads its messages. One command
            # per channel: the channels of one SSUBSCRIBE must share a slot.)
            if sharded:
                for channel in channels:
                    await self._pubsub.execute_command("SSUBSCRIBE", channel)
            else:
                await self._pubsub.subscribe(*channels)

    async def get_message(self, timeout: float) -> dict[str, Any] | None:
        with _translating(self._url, lost=True):
            try:
                message: dict[str, Any] | None = await self._pubsub.get_message(timeout=timeout)
            except redis_errors.ResponseError as exc:
                return {"type": "error", "data": classify_reply(exc, self._url)}
        return message

    async def ping(self, token: bytes) -> None:
        with _translating(self._url, lost=True):
            await self._pubsub.ping(token)

    async def aclose(self) -> None:
        await self._drop_connection()
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _drop_connection(self) -> None:
        """Close without awaiting the peer (a dropped TLS one could wait its connect timeout)."""
        if self._pubsub.connection is not None:
            await self._pubsub.connection.disconnect(nowait=True)
