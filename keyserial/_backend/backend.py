"""The Redis boundary: the one module that sends keyserial's commands and scripts (through
redis-py, or keyserial's own connection, ``_backend.resp``), and the one place that reads what Redis
answers: :func:`classify_reply` maps every failure to keyserial's exceptions, as httpx's
``map_httpcore_exceptions`` maps its transport's. An unreachable server or a "not now" reply
becomes ``BackendUnavailable``, refused credentials ``ConfigError``, an error reply what
``_scripts.refusals.refusal`` makes of it. Above it keyserial speaks its own types:
:class:`Backend`'s methods name each read and write by what the keys hold (the commands as data
in ``_backend.commands``), ``_backend.durability`` confirms writes, and script calls are typed in
``_scripts.calls`` and its siblings. Every script touches one shard's keys (one cluster slot),
except a step that writes other shards for a cross-shard op, which only runs so on a standalone
server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool, parse_url
from redis.cluster import PRIMARY, REPLICA

from .._backoff import Backoff
from .._scripts.calls import ScriptArg, ScriptCall, decoded
from .._scripts.refusals import Refused, ScriptMissing, refusal
from .._scripts.submit import SubmitArgs, submit
from .._urls import redact
from .._wire.codec import LARGEST_ID
from .._wire.layout import (
    PAUSES_CHANGED,
    Layout,
    ShardKeys,
    activity_key,
    is_shard_channel,
    meta_key,
    pauses_key,
    roster_key,
    signers_key,
)
from .._wire.resharding import LayoutRecord, Seal, sealed_key
from ..errors import BackendUnavailable, ConfigError, KeyserialError, ShardCountMismatch
from .commands import Command, merged_stored, publish_command, raise_errors, raised, stored_commands
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

__all__ = ["AnyRedis", "Backend"]

log = logging.getLogger("keyserial")

R = TypeVar("R")

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


class Backend:
    """A connection to one Redis deployment, standalone or cluster, and keyserial's commands
    over it: script calls, and reads and writes of its keys by what they hold. Every method
    raises ``BackendUnavailable`` if the server does not answer."""

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
        #: The hot path's connection (see ``_backend.resp``), on plain TCP connections we opened;
        #: on a cluster, one per master (``_backend.nodes``).
        self._pipelined = pipelined_connection(client) if owned else None
        self._nodes = (
            NodeConnections(self._cluster)
            if owned and self._cluster is not None and own_connections(url)
            else None
        )
        #: On a cluster, a plain client per master, for :meth:`on_node`.
        self._node_clients: dict[str, Redis] = {}
        #: Whether wake-ups, replies and coordination messages travel as shard messages
        #: (``_wire.layout.in_shard``): on a cluster of servers that have them (Redis 7+,
        #: Valkey); set by :meth:`connect`.
        self.sharded_pubsub = False

    @classmethod
    async def connect(cls, redis: str | AnyRedis) -> Backend:
        """Open ``redis`` (a URL, or a client the caller configured and keeps owning). A URL
        that points at a cluster node gets a cluster client: the deployment is asked.

        :raises BackendUnavailable: if the server does not answer.
        """
        if not isinstance(redis, str):
            backend = cls(redis, describe(redis), owned=False)
            await backend.ping()
            await backend._learn_pubsub()
            return backend
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
            backend = cls(cluster, redis, owned=True)
            await backend._learn_pubsub()
            return backend
        return cls(Redis.from_url(redis, **client_options(redis)), redis, owned=True)

    async def _learn_pubsub(self) -> None:
        """Use sharded pub/sub on a cluster whose servers have it (Redis 7+, Valkey): else every
        PUBLISH travels to every node of the cluster."""
        if self._cluster is None:
            return
        node = self._cluster.get_default_node()
        with _translating(self.url, cluster=self._cluster):
            info = await self._cluster.execute_command("INFO", "server", target_nodes=node)
        self.sharded_pubsub = has_sharded_pubsub(str(info.get("redis_version", "")))

    @property
    def publish_after_waits(self) -> bool:
        """Whether :meth:`publish_after` waits for a round trip (redis-py's connections: a
        pool, whose next command may go out on another connection); where it does, a batch's
        scripts publish their own messages instead (``_backend.durability.run_publishing``)."""
        return self._pipelined is None

    async def aclose(self) -> None:
        for client in self._node_clients.values():
            await client.aclose()
        if self._nodes is not None:
            await self._nodes.aclose()
        if self._pipelined is not None:
            await self._pipelined.aclose()
        if self._owned:
            await self.client.aclose()

    # -- sending -------------------------------------------------------------------------------

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Commands in one pipeline (on a cluster, routed by key): each reply, or its error."""
        return await self._send(commands)

    async def call(self, *command: ScriptArg) -> Any:
        """One command's reply; its error reply raised."""
        (reply,) = await self.pipeline([command])
        return raised(reply)

    async def ping(self) -> None:
        await self.call("PING")

    async def on_node(self, key: str, commands: Sequence[Command]) -> list[Any]:
        """Commands in order on one connection to the master that holds ``key`` (as a WAIT
        must follow the write it covers): each reply, or its error. On a cluster, an unreachable
        node may have failed over: the routing is learnt again before the error is raised."""
        try:
            return await self._send(commands, key)
        except BackendUnavailable:
            if self.is_cluster:
                with contextlib.suppress(BackendUnavailable):
                    await self.refresh_routing()
            raise

    async def _send(self, commands: Sequence[Command], node_of: str | None = None) -> list[Any]:
        own = None
        if self._nodes is not None and node_of is None:
            if self._nodes.stale:
                with _translating(self.url, cluster=self._cluster):
                    await self._nodes.learn_routing()
            own = self._nodes.connection_for(commands)
        if own is not None:
            replies = await self._on_own_node_connection(own, commands)
            self.outage.answered()
            return [classify_reply(reply, self.url) for reply in replies]
        with _translating(self.url, cluster=self._cluster):
            if self._pipelined is not None:
                replies = await self._pipelined.execute(commands)
            else:
                client = self.client if node_of is None else self._node_client(node_of)
                replies = await self._redis_py(client, commands)
        self.outage.answered()
        return [classify_reply(reply, self.url) for reply in replies]

    async def _on_own_node_connection(
        self, connection: PipelinedConnection, commands: Sequence[Command]
    ) -> list[Any]:
        """A batch for one cluster master on keyserial's connection to it (if it fails, the
        next batch learns the routing first: the master may have failed over)."""
        assert self._nodes is not None
        with _translating(self.url, cluster=self._cluster):
            return await self._nodes.execute(connection, commands)

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
        any sent once this returns, at most once: on keyserial's own connection written at
        once, without waiting for the replies; elsewhere each sent and answered in turn. What
        cannot go out (the connection lost meanwhile, no answer) is logged, not raised: a
        message is a hint, whose reader looks up what it tells once it is overdue."""
        if self._pipelined is not None:
            commands = [publish_command(channel, message) for channel, message in messages]
            if not self._pipelined.send_nowait(commands):
                log.warning("connection lost: %d messages not published", len(messages))
            return
        try:
            for channel, message in messages:
                await self.publish(channel, message)
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
        if not isinstance(self.client, RedisCluster):
            return
        with _translating(self.url, cluster=self.client):
            await self.client.nodes_manager.initialize()

    def _node_client(self, key: str) -> Redis:
        """A plain client of the master that holds ``key`` (one connection, as a cluster's
        routing cannot promise)."""
        if not isinstance(self.client, RedisCluster):
            return self.client
        node = self.client.get_node_from_key(key)
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
        if self._pipelined is not None:
            return Subscriber(self._pipelined, channels, on_message)
        if self._cluster is not None and any(map(is_shard_channel, channels)):
            return GroupedSubscription(partial(self._cluster_parts, channels, on_message))
        if isinstance(self.client, RedisCluster):
            node = self.client.get_default_node()
            assert node is not None, "cluster client is initialized in connect()"
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
            assert default is not None, "cluster client is initialized in connect()"
            parts.append(
                PubSubSubscription(_PubSub(_pubsub_of(default), self.url), classic, on_message)
            )
        return parts

    def _shard_subscription(
        self, node: Any, channels: list[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        """A subscription to shard channels of one master: on keyserial's own connection to it
        where it has one, else redis-py's."""
        if self._nodes is not None:
            return Subscriber(self._nodes.to_node(node.name), channels, on_message, sharded=True)
        pubsub = _PubSub(_pubsub_of(node), self.url)
        return PubSubSubscription(pubsub, channels, on_message, sharded=True)

    # -- scripts -------------------------------------------------------------------------------

    async def run_many(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """Run scripts in one pipeline: each reply as its call decodes it, or its error."""
        replies = await self.pipeline([call.evalsha_command() for call in calls])
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, ScriptMissing)]
        if missing:  # a restarted or flushed server: send those once as EVAL
            again = await self.pipeline([calls[index].eval_command() for index in missing])
            for index, reply in zip(missing, again, strict=True):
                replies[index] = reply
        return decoded(calls, replies)

    async def run_call(self, call: ScriptCall[R]) -> R:
        """Run one script: its reply, decoded; its refusal raised."""
        (reply,) = await self.run_many([call])
        result: R = raised(reply)
        return result

    async def append(self, entries: Sequence[tuple[ShardKeys, SubmitArgs]]) -> list[Any]:
        """Append stream entries (``submit`` calls) in one pipeline: each entry's id, or its
        error. An entry marked ``fresh`` (op ids appended for the first time: its owner looks
        none up) must land once, so it goes out marked only where a command is sent at most
        once: on keyserial's own connection, which never sends one again (redis-py may, after
        a lost connection)."""
        if self._pipelined is None:
            entries = [(keys, replace(args, fresh=False)) for keys, args in entries]
        return await self.run_many([submit(keys, args) for keys, args in entries])

    # -- keys ----------------------------------------------------------------------------------

    async def stored(self, shard: ShardKeys, fields: Sequence[str]) -> list[bytes | None]:
        """Stored results (or cross-shard records) of ``fields`` in a shard: from the current
        generation, else the previous one (both read in one round trip)."""
        return merged_stored(raise_errors(await self.pipeline(stored_commands(shard, fields))))

    async def stored_on_many(
        self, wanted: Sequence[tuple[ShardKeys, Sequence[str]]]
    ) -> list[list[bytes | None]]:
        """:meth:`stored` of several shards in one pipeline (on a cluster, one round trip
        per node, in parallel)."""
        commands = [
            command for shard, fields in wanted for command in stored_commands(shard, fields)
        ]
        replies = raise_errors(await self.pipeline(commands))
        return [merged_stored(replies[at : at + 2]) for at in range(0, len(replies), 2)]

    async def entries_present(self, shard: ShardKeys, ids: Sequence[bytes]) -> list[bool]:
        """Whether each entry is still in the shard's stream (one round trip)."""
        commands = [("XRANGE", shard.stream, id_, id_) for id_ in ids]
        return [bool(reply) for reply in raise_errors(await self.pipeline(commands))]

    async def state(self, shard: ShardKeys, key: str) -> bytes | None:
        """The committed state (JSON) of ``key``, or None."""
        state: bytes | None = await self.call("HGET", shard.state, key)
        return state

    async def states(self, shard: ShardKeys, keys: Sequence[str]) -> list[bytes | None]:
        """The committed states (JSON) of ``keys``, None for a key that has none."""
        states: list[bytes | None] = await self.call("HMGET", shard.state, *keys)
        return states

    async def state_count(self, shard: ShardKeys) -> int:
        """How many keys of the shard have a state."""
        return int(await self.call("HLEN", shard.state))

    async def all_states(self, shard: ShardKeys) -> dict[bytes, bytes]:
        """Every state of the shard, by key."""
        return _as_dict(await self.call("HGETALL", shard.state))

    async def list_signer(self, namespace: str, signer_id: str, record: str) -> dict[bytes, bytes]:
        """Write a reply signer's entry in the namespace's signers hash; every entry listed."""
        return await self._renew_listing(signers_key(namespace), signer_id, record)

    async def drop_signers(self, namespace: str, signer_ids: Sequence[str | bytes]) -> None:
        raise_errors(await self.pipeline([("HDEL", signers_key(namespace), *signer_ids)]))

    async def list_worker(self, namespace: str, token: str, entry: str) -> dict[bytes, bytes]:
        """Write a worker's roster entry; every entry listed."""
        return await self._renew_listing(roster_key(namespace), token, entry)

    async def drop_workers(self, namespace: str, tokens: Sequence[str | bytes]) -> None:
        """Drop workers' roster entries, and what they posted of their activity."""
        raise_errors(
            await self.pipeline(
                [
                    ("HDEL", roster_key(namespace), *tokens),
                    ("HDEL", activity_key(namespace), *tokens),
                ]
            )
        )

    async def post_activity(self, namespace: str, token: str, record: str) -> None:
        """Write what a worker ran lately (see ``_worker.activity``)."""
        raise_errors(await self.pipeline([("HSET", activity_key(namespace), token, record)]))

    async def activities(self, namespace: str) -> dict[bytes, bytes]:
        """What each worker posted of its activity, by token."""
        (posted,) = raise_errors(await self.pipeline([("HGETALL", activity_key(namespace))]))
        return _as_dict(posted)

    async def roster(self, namespace: str) -> dict[bytes, bytes]:
        """The namespace's roster of workers, as listed (see ``_wire.roster``)."""
        (listed,) = raise_errors(await self.pipeline([("HGETALL", roster_key(namespace))]))
        return _as_dict(listed)

    async def _renew_listing(self, key: str, field: str, record: str) -> dict[bytes, bytes]:
        """Write one entry of a hash that processes list themselves in; every entry."""
        _, listed = raise_errors(
            await self.pipeline([("HSET", key, field, record), ("HGETALL", key)])
        )
        return _as_dict(listed)

    async def signer_records(self, namespace: str, signer_ids: Sequence[str]) -> list[bytes | None]:
        """The signers hash's entries for ``signer_ids`` (None where there is none)."""
        (records,) = raise_errors(
            await self.pipeline([("HMGET", signers_key(namespace), *signer_ids)])
        )
        return list(records)

    async def entries_after(self, cursors: Sequence[tuple[ShardKeys, str]]) -> list[bool]:
        """For each (shard, entry id): whether the shard's stream has an entry after that one
        (True too where the server answered with an error: look, to be safe). One pipeline."""
        replies = await self.pipeline(
            [("XRANGE", shard.stream, f"({cursor}", "+", "COUNT", 1) for shard, cursor in cursors]
        )
        return [isinstance(reply, Exception) or bool(reply) for reply in replies]

    async def entries_since(
        self, cursors: Sequence[tuple[ShardKeys, str]], count: int
    ) -> list[list[tuple[bytes, dict[bytes, bytes]]]]:
        """For each (shard, entry id): up to ``count`` entries after that one, oldest first
        (none after the largest id there is, where XRANGE would refuse the range). One
        pipeline."""
        asked = [(shard, cursor) for shard, cursor in cursors if cursor != LARGEST_ID]
        replies = (
            raise_errors(
                await self.pipeline(
                    [
                        ("XRANGE", shard.stream, f"({cursor}", "+", "COUNT", count)
                        for shard, cursor in asked
                    ]
                )
            )
            if asked
            else []
        )
        found = iter(replies)
        return [[] if cursor == LARGEST_ID else _entries(next(found)) for _, cursor in cursors]

    async def queued(self, shard: ShardKeys, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to ``count`` stream entries after the shard's progress marker, oldest first: (id,
        fields); ops waiting or under way."""
        progress = await self.call("GET", shard.progress)
        first = f"({progress.decode()}" if progress else "-"
        return _entries(await self.call("XRANGE", shard.stream, first, "+", "COUNT", count))

    async def paused_keys(self, shard: ShardKeys) -> dict[bytes, bytes]:
        """The shard's paused keys, with their records."""
        (paused,) = await self.all_paused([shard])
        return paused

    async def all_paused(self, shards: Sequence[ShardKeys]) -> list[dict[bytes, bytes]]:
        """Each shard's paused keys, in one pipeline."""
        replies = raise_errors(await self.pipeline([("HGETALL", s.paused) for s in shards]))
        return [_as_dict(paused) for paused in replies]

    async def seals(self, shards: Sequence[ShardKeys]) -> list[Seal | None]:
        """Each shard's seal by a reshard, if it has one, in one pipeline."""
        replies = raise_errors(await self.pipeline([("GET", sealed_key(s)) for s in shards]))
        return [
            None if record is None else Seal.decode(shard.namespace, record)
            for shard, record in zip(shards, replies, strict=True)
        ]

    async def pauses_changed(self, namespace: str) -> int:
        """The namespace's count of pauses and resumes (0: none yet)."""
        return int(await self.call("GET", pauses_key(namespace)) or 0)

    async def set_paused(self, shard: ShardKeys, key: str, record: str | None) -> bool:
        """Pause ``key`` (``record``: its JSON record) or resume it (None), then bump the
        namespace's counter and wake the shard's owner; whether the key was paused before."""
        change: Command = (
            ("HDEL", shard.paused, key) if record is None else ("HSET", shard.paused, key, record)
        )
        before, *_ = raise_errors(
            await self.pipeline(
                [
                    ("HEXISTS", shard.paused, key),
                    change,
                    ("INCR", pauses_key(shard.namespace)),
                    publish_command(shard.wake(self.sharded_pubsub), PAUSES_CHANGED),
                ]
            )
        )
        return bool(before)

    async def held_and_paused(
        self, shard: ShardKeys, keys: Sequence[str]
    ) -> tuple[bool, list[str]]:
        """Whether some worker holds the shard's lease, and which of ``keys`` (of the shard) an
        operator paused: one round trip, with the commands a client user may send (``EXISTS``,
        ``HMGET``)."""
        held, records = raise_errors(
            await self.pipeline([("EXISTS", shard.lease), ("HMGET", shard.paused, *keys)])
        )
        return bool(held), [key for key, record in zip(keys, records, strict=True) if record]

    async def dead_letters(
        self, shard: ShardKeys, first: str = "-", last: str = "+", count: int | None = None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The shard's dead letters from ``first`` to ``last`` (ids), oldest first: (id,
        fields)."""
        command: list[ScriptArg] = ["XRANGE", shard.dead, first, last]
        if count is not None:
            command += ["COUNT", count]
        return _entries(await self.call(*command))

    async def drop_dead_letter(self, shard: ShardKeys, letter_id: str) -> bool:
        """Delete one dead letter: whether it was there."""
        return bool(await self.call("XDEL", shard.dead, letter_id))

    async def publish(self, channel: str, message: str) -> None:
        await self.call(*publish_command(channel, message))

    async def recorded_layout(self, namespace: str) -> Layout | None:
        """The layout the namespace records, or None if nothing has used it yet."""
        record = await self.layout_record(namespace)
        return None if record is None else record.live

    async def layout_record(self, namespace: str) -> LayoutRecord | None:
        """The namespace's layout, the reshard under way and the layouts before; None if
        nothing has used the namespace yet."""
        shards, *rest = await self.call(
            "HMGET", meta_key(namespace), "shards", "generation", "move", "history"
        )
        return None if shards is None else LayoutRecord.decode(namespace, shards, *rest)

    async def ensure_layout(self, namespace: str, shard_count: int | None) -> Layout:
        """Record the namespace's shard count on first use; return the recorded layout.

        ``None`` adopts the recorded count, or records 16 for a new namespace. A namespace in
        use is only read, so a client's ACL user needs no write access to it.

        :raises ShardCountMismatch: when ``shard_count`` differs from the recorded count.
        :raises ConfigError: when the count is not recorded yet and this user may not record it.
        """
        wanted = 16 if shard_count is None else shard_count
        if wanted < 1:
            raise ConfigError(f"shard count must be at least 1, not {wanted}")
        recorded = await self.recorded_layout(namespace)
        if recorded is None:
            try:
                await self.call("HSETNX", meta_key(namespace), "shards", wanted)
            except ConfigError as exc:  # the ACL refused it (see classify_reply)
                raise ConfigError(
                    f"namespace {namespace!r} has no shard count recorded yet, and this Redis"
                    f" user may not record it ({exc.__cause__}); start a worker first, which"
                    " records it"
                ) from exc
            recorded = await self.recorded_layout(namespace)
            assert recorded is not None, "recorded just now"
        if shard_count is not None and recorded.shards != shard_count:
            raise ShardCountMismatch(
                namespace=namespace, recorded=recorded.shards, configured=shard_count
            )
        return recorded


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


def _entries(entries: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as XRANGE returns them, each entry's fields as a dict."""
    return [(entry_id, _as_dict(fields)) for entry_id, fields in entries]


def _as_dict(flat: Any) -> dict[bytes, bytes]:
    """A hash as HGETALL returns it: a dict already (RESP3, or a client that parses it), else
    a flat list of fields and values."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True))
