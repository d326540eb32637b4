"""The one module the rest of keyserial talks to Redis through: connections, Lua scripts,
pub/sub, error translation (its hot path's own connections live in ``_resp``).

The rest of keyserial speaks in its own types. Standalone servers and Redis/Valkey Cluster are
both supported; every script touches the keys of one shard (one hash tag, one slot), except
``commit_across``, which only runs on a standalone server.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, ConnectionPool
from redis.typing import EncodableT
from redis.utils import HIREDIS_AVAILABLE

from ._layout import ShardKeys, meta_key, same_slot_key
from ._settings import Durability
from ._subscriptions import RESUBSCRIBE_AFTER, PubSubSubscription, Subscription, pubsub_on
from ._urls import redact

if HIREDIS_AVAILABLE:  # a dependency (redis[hiredis]), but redis-py also runs without it
    import hiredis

    from ._resp import PipelinedConnection, Subscriber
from .errors import BackendUnavailable, ConfigError, ShardCountMismatch

log = logging.getLogger("keyserial")

AnyRedis: TypeAlias = "Redis | RedisCluster"
ScriptArg: TypeAlias = str | int | float | bytes

#: Errors that mean "the server could not be reached or answered in time". A cluster client
#: reports an unreachable cluster as RedisClusterException; a node that is still joining after
#: a restart answers CLUSTERDOWN.
UNREACHABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.RedisClusterException,
    redis_errors.ClusterDownError,
    OSError,
)


#: Error replies that mean "not now": the server is loading its dataset, running a slow script
#: (BUSY), or its cluster is failing over. The command was not executed; it may be sent again.
_TRANSIENT_PREFIXES = ("BUSY ", "LOADING", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN", "READONLY",
                       "NOREPLICAS", "NOTREADY", "UNBLOCKED")
#: Error replies that no retry cures: the credentials or the ACL user do not allow keyserial in.
_REFUSED = (redis_errors.AuthenticationError, redis_errors.NoPermissionError)


#: Everything redis-py raises (a cluster client's "no node reachable" is not a RedisError).
_REDIS_ERRORS = (redis_errors.RedisError, redis_errors.RedisClusterException)


def classify_reply(reply: Any, url: str) -> Any:
    """An error reply as keyserial sees it (every reply from Redis passes through here): a
    transient refusal becomes :class:`BackendUnavailable` (retried like an outage), a refusal of
    the credentials or the ACL a :class:`ConfigError`; the scripts' own refusals (``FENCED``,
    ``BACKLOG``, ``ELSEWHERE``) and anything else stay a ``ResponseError``. Other replies pass
    through unchanged."""
    if not isinstance(reply, _REDIS_ERRORS):
        return reply
    if isinstance(reply, _REFUSED):
        return ConfigError(f"Redis at {redact(url)} refused keyserial: {reply}")
    if isinstance(reply, UNREACHABLE) or str(reply).startswith(_TRANSIENT_PREFIXES):
        return BackendUnavailable(url, reply)
    return reply


def _translated(exc: Exception, url: str) -> Exception:
    """What to raise for a redis-py error: keyserial's error (see :func:`classify_reply`), or
    the script's own refusal as it is."""
    if isinstance(exc, redis_errors.InvalidResponse):  # a port another server listens on
        return BackendUnavailable(url, f"the server there does not speak Redis ({exc})")
    error: Exception = classify_reply(exc, url)
    if error is exc and isinstance(exc, UNREACHABLE):
        return BackendUnavailable(url, exc)
    return error


@contextlib.contextmanager
def _translating(url: str) -> Iterator[None]:
    """Raise keyserial's errors for redis-py's (the one place that maps them, as httpx's
    ``map_httpcore_exceptions`` does); a script's own refusal is raised as it is."""
    try:
        yield
    except _REDIS_ERRORS as exc:
        error = _translated(exc, url)
        if error is exc:
            raise
        raise error from exc
    except OSError as exc:
        raise BackendUnavailable(url, exc) from exc


def _raise_if_error(reply: Any, url: str) -> Any:
    reply = classify_reply(reply, url)
    if isinstance(reply, Exception):
        raise reply
    return reply


#: Timeouts for the command connections keyserial opens from a URL (a ``?socket_timeout=`` in
#: the URL wins). No command keyserial sends blocks, so a reply that takes longer means a dead
#: connection; without a timeout, a half-open socket after a server restart could hang forever.
#: Pub/sub connections get no read timeout: they are idle between messages by design.
_URL_TIMEOUTS: dict[str, Any] = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}


class CloseSafeConnection(Connection):
    """A TCP connection whose write, when another task closes it meanwhile (a cluster client
    resets its connections after one fails), raises ``ConnectionError`` as any lost connection
    does. redis-py through 8.1 leaks ``AttributeError``/``TypeError`` there (redis/redis-py#3546,
    #4287), which no retry loop recognises: a worker would crash mid-outage instead of waiting
    it out. (redis-py has already dropped the connection when this re-raises.)"""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (AttributeError, TypeError) as exc:
            # The race's signature: a method called on, or of, a torn-down writer (None).
            # Anything else is a bug, shown as it is.
            if not (
                (isinstance(exc, AttributeError) and exc.obj is None)
                or "'NoneType' object is not callable" in str(exc)
            ):
                raise
            raise redis_errors.ConnectionError(f"connection closed during a write ({exc})") from exc


class HiredisPackedConnection(CloseSafeConnection):
    """A TCP connection that packs commands with hiredis's C packer, as redis-py's synchronous
    connection already does (its asyncio one packs in Python, 9x slower per command). It also
    marks a client whose script batches, commands and subscriptions can take the hot path's own
    connection (``_resp``). Anything hiredis cannot pack (a bool) goes to redis-py's packer and
    its error."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        command: tuple[Any, ...] = args
        if isinstance(args[0], str):  # "CLIENT SETNAME" is two words, as redis-py splits it
            command = (*args[0].encode().split(), *args[1:])
        try:
            return [hiredis.pack_command(command)]
        except TypeError:
            return super().pack_command(*args)


def _client_options(url: str) -> dict[str, Any]:
    """Options for a client opened from ``url``: timeouts, and the C packer on plain TCP (TLS
    and Unix sockets keep redis-py's own connection classes)."""
    options = dict(_URL_TIMEOUTS)
    if HIREDIS_AVAILABLE and urlsplit(url).scheme == "redis":
        options["connection_class"] = HiredisPackedConnection
    return options


def _use_close_safe_connections(cluster: RedisCluster, url: str) -> None:
    """Make ``cluster``'s nodes open :class:`CloseSafeConnection` s. (RedisCluster takes no
    connection class; its nodes take one from the connection options they are created with.)
    TLS keeps redis-py's own class."""
    if urlsplit(url).scheme != "redis":
        return
    cluster.nodes_manager.connection_kwargs["connection_class"] = CloseSafeConnection
    for node in cluster.nodes_manager.startup_nodes.values():
        node.connection_class = CloseSafeConnection


def _pipelined_connection(client: AnyRedis) -> PipelinedConnection | None:
    """The hot path's own connection, where redis-py's would be a plain TCP one with the C
    packer (see ``_client_options``)."""
    if isinstance(client, RedisCluster):
        return None
    pool = client.connection_pool
    if pool.connection_class is not HiredisPackedConnection:
        return None
    options = pool.connection_kwargs
    return PipelinedConnection(
        options.get("host", "localhost"),
        int(options.get("port", 6379)),
        db=int(options.get("db", 0) or 0),
        username=options.get("username"),
        password=options.get("password"),
        connect_timeout=options.get("socket_connect_timeout"),
        timeout=options.get("socket_timeout"),
    )


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script from ``keyserial/lua``, called by SHA with a fallback to EVAL."""

    name: str
    text: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        text = resources.files("keyserial").joinpath(f"lua/{name}.lua").read_text()
        return cls(name, text, hashlib.sha1(text.encode()).hexdigest())


SUBMIT = Script.load("submit")
STEP = Script.load("step")
ACQUIRE = Script.load("acquire")
RENEW = Script.load("renew")
RELEASE = Script.load("release")
DECIDE = Script.load("decide")
RESOLVE = Script.load("resolve")
GRANT = Script.load("grant")
COMMIT_ACROSS = Script.load("commit_across")


@dataclass(slots=True)  # (not frozen: one is made per step, and frozen ones build slower)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[ScriptArg]


class Backend:
    """A connection to one Redis deployment, standalone or cluster."""

    def __init__(self, client: AnyRedis, url: str, *, owned: bool) -> None:
        self.client = client
        #: For messages and logs: the password is hidden.
        self.url = redact(url)
        self.is_cluster = isinstance(client, RedisCluster)
        self._owned = owned
        #: The hot path's connection (see ``_resp``), on plain TCP connections we opened.
        self._pipelined = _pipelined_connection(client) if owned else None
        #: On a cluster, a plain client per master, for :meth:`confirm`.
        self._node_clients: dict[str, Redis] = {}

    @classmethod
    async def connect(cls, redis: str | AnyRedis) -> Backend:
        """Open ``redis`` (a URL, or a client the caller configured and keeps owning).

        A URL that points at a cluster node gets a cluster client: the deployment is asked,
        not guessed from the URL.

        :raises BackendUnavailable: if the server does not answer.
        """
        if not isinstance(redis, str):
            backend = cls(redis, _describe(redis), owned=False)
            await backend.ping()
            return backend
        probe = Redis.from_url(redis, **_URL_TIMEOUTS)
        try:
            with _translating(redis):
                info = await probe.info("cluster")
        finally:
            await probe.aclose()
        if info.get("cluster_enabled"):
            cluster = RedisCluster.from_url(redis, **_URL_TIMEOUTS)
            _use_close_safe_connections(cluster, redis)
            try:
                with _translating(redis):
                    await cluster.initialize()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await cluster.aclose()
                raise
            return cls(cluster, redis, owned=True)
        return cls(Redis.from_url(redis, **_client_options(redis)), redis, owned=True)

    @property
    def in_order(self) -> bool:
        """Whether commands reach the server in the order they were sent (one connection, not
        a pool): keyserial's own connection."""
        return self._pipelined is not None

    @property
    def sends_once(self) -> bool:
        """Whether a command is sent at most once (never retried by the transport), so an entry
        appended through it cannot land twice: keyserial's own connection does not retry."""
        return self._pipelined is not None

    async def aclose(self) -> None:
        for client in self._node_clients.values():
            await client.aclose()
        if self._pipelined is not None:
            await self._pipelined.aclose()
        if self._owned:
            await self.client.aclose()

    async def ping(self) -> None:
        with _translating(self.url):
            await self.client.execute_command("PING")

    def _subscription(
        self, channels: Sequence[str], on_message: Callable[[str, bytes], None]
    ) -> Subscription:
        """A subscription that connects as the command connections do (TLS and its
        certificates included), with no read timeout. On a cluster, channel messages reach
        every node, so one node does."""
        if self._pipelined is not None:
            return Subscriber(self._pipelined, channels, on_message)
        if isinstance(self.client, RedisCluster):
            node = self.client.get_default_node()
            assert node is not None, "cluster client is initialized in connect()"
            pubsub = pubsub_on(node.connection_class, node.connection_kwargs)
        elif self._owned:
            pool = self.client.connection_pool
            pubsub = pubsub_on(pool.connection_class, pool.connection_kwargs)
        else:
            pubsub = self.client.pubsub()
        return PubSubSubscription(pubsub, channels, on_message)

    async def listen(
        self,
        channels: Sequence[str],
        on_message: Callable[[str, bytes], None],
        *,
        health_interval: float = 5.0,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Subscribe to ``channels`` and hand every message to ``on_message(channel, data)``
        until cancelled, resubscribing after a lost connection, an error reply, or a failed
        health check (a PING every ``health_interval`` seconds, answered within as long: a
        connection dropped without a word only goes quiet). Messages published while the
        connection was down are lost: callers keep a fallback (result sweep, idle polling).

        :raises BackendUnavailable: if the first subscription fails (before ``started()``).
        """
        subscription = self._subscription(channels, on_message)
        try:
            with _translating(self.url):
                await subscription.subscribe()
            task_status.started()
            while True:
                error = await subscription.until_lost(health_interval)
                log.warning("subscription to %s lost (%s); resubscribing", self.url, error)
                await anyio.sleep(0.2)
                with contextlib.suppress(*RESUBSCRIBE_AFTER):
                    await subscription.subscribe()
        finally:
            with anyio.CancelScope(shield=True):
                await subscription.aclose()

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[ScriptArg]) -> Any:
        """Run one script. Script errors (``FENCED``, ``BACKLOG``) raise ``ResponseError``.

        :raises BackendUnavailable: if the server does not answer.
        """
        if self._pipelined is not None:
            (reply,) = await self._run_pipelined([ScriptCall(script, keys, args)])
            return _raise_if_error(reply, self.url)
        command = self.client.execute_command
        with _translating(self.url):
            try:
                return await command("EVALSHA", script.sha, len(keys), *keys, *args)
            except redis_errors.NoScriptError:
                return await command("EVAL", script.text, len(keys), *keys, *args)

    async def run_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run scripts in one pipeline; each item is its reply or its ``ResponseError``.

        :raises BackendUnavailable: if the server does not answer.
        """
        if self._pipelined is not None:
            replies = await self._run_pipelined(calls)
        else:
            replies = await self._run_redis_py(calls)
        return [classify_reply(reply, self.url) for reply in replies]

    async def _run_one(self, call: ScriptCall) -> Any:
        """One script's reply, or its error reply (not raised, as in a pipeline)."""
        try:
            return await self.run(call.script, call.keys, call.args)
        except (redis_errors.ResponseError, ConfigError) as exc:
            return exc
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, redis_errors.ResponseError):
                return exc  # a transient refusal of this call, not an outage
            raise

    async def _run_redis_py(self, calls: Sequence[ScriptCall]) -> list[Any]:
        if len(calls) == 1:
            return [await self._run_one(calls[0])]
        with _translating(self.url):
            pipe = self.client.pipeline(transaction=False)
            for each in calls:
                # execute_command, not evalsha(): redis-py blocks the latter in cluster pipelines,
                # though a script with all its keys in one slot is routed like any command.
                pipe.execute_command(
                    "EVALSHA", each.script.sha, len(each.keys), *each.keys, *each.args
                )
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        # A cluster pipeline returns a node's connection error as that command's reply.
        for reply in replies:
            if isinstance(reply, UNREACHABLE):
                raise BackendUnavailable(self.url, reply)
        for index, reply in enumerate(replies):
            if isinstance(reply, redis_errors.NoScriptError):
                replies[index] = await self._run_one(calls[index])
        return replies

    async def _run_pipelined(self, calls: Sequence[ScriptCall]) -> list[Any]:
        assert self._pipelined is not None
        with _translating(self.url):
            replies = await self._pipelined.execute(
                [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in calls]
            )
            missing = [
                index for index, reply in enumerate(replies)
                if isinstance(reply, redis_errors.NoScriptError)
            ]
            if missing:  # a restarted or flushed server: send those once as EVAL
                again = await self._pipelined.execute(
                    [
                        ("EVAL", calls[i].script.text, len(calls[i].keys), *calls[i].keys,
                         *calls[i].args)
                        for i in missing
                    ]
                )
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
        return replies

    async def run_confirmed(
        self, calls: Sequence[ScriptCall], durability: Durability
    ) -> tuple[list[Any], bool]:
        """:meth:`run_many`, then :meth:`confirm` behind its writes: the replies, and whether
        the durability asked for holds for them. On keyserial's own connection both go out in
        one round trip.

        :raises BackendUnavailable: if the server does not answer.
        """
        barrier = same_slot_key(calls[0].keys[0], "barrier")
        if self._pipelined is None or self.is_cluster:
            replies = await self.run_many(calls)
            # On a cluster, one barrier on each master the calls wrote to.
            barriers = {self.node_of(call.keys[0]): call.keys[0] for call in calls}
            for key in barriers.values():
                if not await self.confirm(same_slot_key(key, "barrier"), durability):
                    return replies, False
            return replies, True
        commands = [_evalsha(call) for call in calls] + _barrier_then_wait(barrier, durability)
        with _translating(self.url):
            replies = await self._pipelined.execute(commands)
        waited = replies.pop()
        replies.pop()  # the barrier's OK
        if any(isinstance(reply, redis_errors.NoScriptError) for reply in replies):
            # A restarted server: the EVALs that follow must be covered by a wait of their own.
            replies = await self._run_pipelined(calls)
            confirmed = await self.confirm(barrier, durability)
        else:
            confirmed = self._enough(waited, durability)
        return [classify_reply(reply, self.url) for reply in replies], confirmed

    async def confirm(self, key: str, durability: Durability) -> bool:
        """Whether every write the server had executed before this call is on
        ``durability.replicas`` replicas (and in the AOFs, with ``fsync``), waiting at most
        ``durability.wait_ms``: a write to ``key`` (its node, on a cluster), then WAIT or
        WAITAOF, on one connection. False when the server refuses either.

        :raises BackendUnavailable: if the server does not answer.
        """
        commands = _barrier_then_wait(key, durability)
        with _translating(self.url):
            if self._pipelined is not None:
                replies = await self._pipelined.execute(commands)
            else:
                pipe = self._node_client(key).pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        waited = replies[-1]
        if isinstance(waited, Exception) and isinstance(self.client, RedisCluster):
            # Most likely a failover moved the slot (MOVED, or a wait refused by what is now
            # a replica): learn where it lives now.
            with _translating(self.url):
                await self.client.nodes_manager.initialize()
        return self._enough(waited, durability)

    def _enough(self, waited: Any, durability: Durability) -> bool:
        """Whether a WAIT's (or WAITAOF's) reply meets ``durability``."""
        if isinstance(waited, Exception):
            log.warning("cannot confirm writes (%s): %s", self.url, waited)
            return False
        if durability.fsync:
            local, replicas = waited
            return int(local) >= 1 and int(replicas) >= durability.replicas
        return int(waited) >= durability.replicas

    async def check_durability(self, durability: Durability | None) -> None:
        """Refuse at once what could never be confirmed: ``durable_fsync`` on a server without
        WAITAOF or with appendonly off (every acknowledgement would wait forever).

        :raises ConfigError: naming what the server lacks.
        """
        if durability is None or not durability.fsync:
            return
        try:
            await self.call("WAITAOF", 1, 0, 1)
        except redis_errors.ResponseError as exc:
            raise ConfigError(
                f"durable_fsync needs WAITAOF (Redis 7.2+, Valkey 8+) with appendonly on;"
                f" {self.url} answered: {exc}"
            ) from None

    def node_of(self, key: str) -> str:
        """The name of the master that serves ``key`` as far as this client knows ('' on a
        standalone server)."""
        if not isinstance(self.client, RedisCluster):
            return ""
        try:
            node = self.client.get_node_from_key(key)
        except redis_errors.RedisClusterException:  # a slot no master serves right now
            return ""
        return "" if node is None else node.name

    def _node_client(self, key: str) -> Redis:
        """A plain client of the server that holds ``key``: on a cluster, its slot's master
        (a WAIT must follow the write it covers on one connection, which a cluster client's
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

    async def call(self, *command: ScriptArg) -> Any:
        """One plain command (routed by its key on a cluster).

        :raises BackendUnavailable: if the server does not answer.
        """
        with _translating(self.url):
            if self._pipelined is None:
                return await self.client.execute_command(*command)
            (reply,) = await self._pipelined.execute([command])
        return _raise_if_error(reply, self.url)

    def publish_nowait(self, messages: Sequence[tuple[str, str]]) -> bool:
        """``PUBLISH`` each message now, on keyserial's own open connection, without waiting
        for the server's replies; False (nothing sent) where there is none."""
        if self._pipelined is None:
            return False
        return self._pipelined.send_nowait(
            [("PUBLISH", channel, message) for channel, message in messages]
        )

    async def stored(self, shard: ShardKeys, fields: Sequence[str]) -> list[bytes | None]:
        """Stored results (or cross-shard records) of ``fields`` in a shard: from the current
        generation, else the previous one (both read in one round trip).

        :raises BackendUnavailable: if the server does not answer.
        """
        current, previous = await self._pipeline(
            [("HMGET", shard.results, *fields), ("HMGET", shard.results_old, *fields)]
        )
        pairs = zip(current, previous, strict=True)
        return [now if now is not None else before for now, before in pairs]

    async def entries_present(self, shard: ShardKeys, ids: Sequence[bytes]) -> list[bool]:
        """Whether each entry is still in the shard's stream (one round trip).

        :raises BackendUnavailable: if the server does not answer.
        """
        replies = await self._pipeline([("XRANGE", shard.stream, id_, id_) for id_ in ids])
        return [bool(reply) for reply in replies]

    async def _pipeline(self, commands: Sequence[Sequence[ScriptArg]]) -> list[Any]:
        """Plain commands in one pipeline (on a cluster, all in one slot); their replies."""
        with _translating(self.url):
            if self._pipelined is not None:
                replies = await self._pipelined.execute(commands)
            else:
                pipe = self.client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        return [_raise_if_error(reply, self.url) for reply in replies]

    async def hmget(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        result: list[bytes | None] = await self.call("HMGET", key, *fields)
        return result

    async def ensure_shard_count(self, namespace: str, shard_count: int | None) -> int:
        """Record the namespace's shard count on first use; return the recorded one.

        ``None`` adopts the recorded count, or records 16 for a new namespace. A namespace in
        use is only read, so a client's ACL user needs no write access to it.

        :raises ShardCountMismatch: when ``shard_count`` differs from the recorded count.
        :raises ConfigError: when the count is not recorded yet and this user may not record it.
        """
        key = meta_key(namespace)
        wanted = 16 if shard_count is None else shard_count
        if wanted < 1:
            raise ConfigError(f"shard count must be at least 1, not {wanted}")
        stored = await self.call("HGET", key, "shards")
        if stored is None:
            try:
                await self.call("HSETNX", key, "shards", wanted)
            except ConfigError as exc:  # the ACL refused it (see classify_reply)
                raise ConfigError(
                    f"namespace {namespace!r} has no shard count recorded yet, and this Redis"
                    f" user may not record it ({exc.__cause__}); start a worker first, which"
                    " records it"
                ) from exc
            stored = await self.call("HGET", key, "shards")
        recorded = int(stored)
        if shard_count is not None and recorded != shard_count:
            raise ShardCountMismatch(
                namespace=namespace, recorded=recorded, configured=shard_count
            )
        return recorded


def _evalsha(call: ScriptCall) -> tuple[ScriptArg, ...]:
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


#: How long a barrier key lives: it only has to be written, never read.
_BARRIER_PX = 60_000


def _barrier_then_wait(key: str, durability: Durability) -> list[tuple[ScriptArg, ...]]:
    """A write that is always replicated, then a WAIT (WAITAOF) for it: its count covers every
    write the server executed before the barrier, whoever sent it (the replication stream and
    the AOF are ordered)."""
    wait: tuple[ScriptArg, ...] = (
        ("WAITAOF", 1, durability.replicas, durability.wait_ms) if durability.fsync
        else ("WAIT", durability.replicas, durability.wait_ms)
    )
    return [("SET", key, "1", "PX", _BARRIER_PX), wait]


def _describe(client: AnyRedis) -> str:
    """A URL-like name for a caller's client, for error messages (no password)."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node()
        return f"redis-cluster://{node.host}:{node.port}" if node else "redis-cluster"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}"
