"""The hot path's own connections to a standalone server over TCP: pipelined batches of commands,
and pub/sub subscriptions; and the classes of the redis-py connections keyserial opens.

redis-py's asyncio client spends Python time on every pipelined command besides packing and
parsing, and more on every pub/sub message; a worker sends a script call per shard step and gets
a wake-up per stream entry, a client sends a call per entry and gets a reply message per commit
(what this saves: benchmarks/README.md). Here hiredis packs and parses, in C, as it does inside
redis-py; this module only writes each batch at once and hands each reply to whoever waits for
it, in the order the commands were sent, or a message to its handler. Concurrent batches share
one connection, so there is no pool. Everything else (TLS, Unix sockets, clusters, clients the
caller configured) stays with redis-py, on the connection classes at the end of this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias, cast
from urllib.parse import urlsplit

import anyio
import hiredis
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.typing import EncodableT
from redis.utils import HIREDIS_AVAILABLE

log = logging.getLogger("keyserial")

Command = Sequence[Any]
AnyRedis: TypeAlias = "Redis | RedisCluster"
MessageHandler = Callable[[str, bytes], None]


#: Error codes whose replies are classed as redis-py's own connections class them, so that one
#: classification (``_backend.backend``) serves both. Any other error is a ``ResponseError``.
_ERROR_CLASSES: dict[str, type[redis_errors.ResponseError] | type[redis_errors.RedisError]] = {
    "ASK": redis_errors.AskError,
    "CLUSTERDOWN": redis_errors.ClusterDownError,
    "CROSSSLOT": redis_errors.ClusterCrossSlotError,
    "ERR": redis_errors.ResponseError,
    "EXECABORT": redis_errors.ExecAbortError,
    "LOADING": redis_errors.BusyLoadingError,
    "MASTERDOWN": redis_errors.MasterDownError,
    "MOVED": redis_errors.MovedError,
    "NOAUTH": redis_errors.AuthenticationError,
    "NOPERM": redis_errors.NoPermissionError,
    "NOSCRIPT": redis_errors.NoScriptError,
    "OOM": redis_errors.OutOfMemoryError,
    "READONLY": redis_errors.ReadOnlyError,
    "TRYAGAIN": redis_errors.TryAgainError,
    "WRONGPASS": redis_errors.AuthenticationError,
}


#: ``ERR`` replies that redis-py classes by their whole text.
_ERR_CLASSES: dict[str, type[redis_errors.RedisError]] = {
    "max number of clients reached": redis_errors.ConnectionError,
    "invalid password": redis_errors.AuthenticationError,
    "Client sent AUTH, but no password is set": redis_errors.AuthenticationError,
}


def reply_error(message: str) -> redis_errors.RedisError:
    """The exception of an error reply: its code's class, with the code taken off the message
    (as redis-py does), else a ``ResponseError`` with the whole message."""
    code, _, rest = message.partition(" ")
    error_class = _ERROR_CLASSES.get(code)
    if error_class is None:
        return redis_errors.ResponseError(message)
    if code == "ERR":
        error_class = _ERR_CLASSES.get(rest, error_class)
    return error_class(rest, status_code=code)


class _Protocol(asyncio.Protocol):
    """Parses replies with hiredis and resolves the oldest waiting future with each; with an
    ``on_message`` handler, pub/sub messages go to it instead."""

    def __init__(self, on_message: MessageHandler | None = None) -> None:
        # Error replies become redis-py's exception types (NoScriptError, ResponseError, …).
        self._reader = hiredis.Reader(
            protocolError=redis_errors.InvalidResponse, replyError=reply_error
        )
        self._on_message = on_message
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        #: Commands packed and not written yet (see :meth:`send`).
        self._deferred: list[bytes] = []
        #: (Asked once: asking asyncio for the running loop costs a system call.)
        self._loop = asyncio.get_running_loop()
        #: Resolved with the reason once the connection is closed, for good.
        self.closed: asyncio.Future[Exception] = self._loop.create_future()

    def send(
        self, commands: Sequence[Command], *, defer: bool = False
    ) -> list[asyncio.Future[Any]]:
        """Write ``commands`` at once, after any deferred ones; a future per reply. ``defer``:
        write them with the next commands sent in this round of the event loop's callbacks, or
        at the start of the next round if none are: a worker's reply messages, sent right before
        its next pipeline, then cost no system call of their own."""
        packed = [hiredis.pack_command(tuple(command)) for command in commands]
        if self.closed.done():
            raise self.closed.result()
        loop = self._loop
        futures = [loop.create_future() for _ in commands]
        self._waiting.extend(futures)
        if defer:
            if not self._deferred:
                loop.call_soon(self._write_deferred)
            self._deferred += packed
            return futures
        if self._deferred:
            packed, self._deferred = self._deferred + packed, []
        assert self._transport is not None
        self._transport.writelines(packed)
        return futures

    def _write_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        if deferred and self._transport is not None and not self.closed.done():
            self._transport.writelines(deferred)

    def fail(self, error: Exception) -> None:
        """Close: every pending and later command fails with ``error``."""
        if not self.closed.done():
            self.closed.set_result(error)
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self._transport is not None:
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (Not an isinstance check: uvloop's transports, which uvicorn runs on when uvloop is
        # installed, do not derive from asyncio's classes.)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if self._on_message is not None and _is_message(reply):
                self._deliver(reply[1], reply[2])
            elif self._waiting:
                future = self._waiting.popleft()
                if not future.done():  # its caller was cancelled: the reply is dropped, in order
                    future.set_result(reply)
            else:
                self.fail(redis_errors.InvalidResponse(f"a reply nobody asked for: {reply!r}"))
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(redis_errors.ConnectionError(f"connection lost: {exc or 'closed by server'}"))

    def _deliver(self, channel: bytes, data: bytes) -> None:
        assert self._on_message is not None
        try:
            self._on_message(channel.decode(), data)
        except Exception:  # a bug in the handler: the subscription keeps serving
            log.exception("handling a message on %r failed", channel)


#: A message's kind in a subscription: a channel's, or a shard channel's (SSUBSCRIBE).
_MESSAGES = (b"message", b"smessage")


def _is_message(reply: Any) -> bool:
    return isinstance(reply, list) and len(reply) == 3 and reply[0] in _MESSAGES


class PipelinedConnection:
    """Sends batches of commands over one TCP connection, opened on first use and again after
    it fails."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        connect_timeout: float | None = None,
        timeout: float | None = None,
    ) -> None:
        self._address = (host, port)
        self._setup: list[tuple[Any, ...]] = []
        if password is not None:
            self._setup.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            self._setup.append(("SELECT", db))
        self._connect_timeout = connect_timeout
        self.timeout = timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply, or its error reply as a ``ResponseError`` instance.

        Not retried, as redis-py's clients opened from a URL do not retry: a batch that fails
        may or may not have run, and the caller decides (keyserial's callers retry, or report
        ``BackendUnavailable``).

        :raises redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: when the
            server cannot be reached or does not answer within the timeout.
        """
        protocol = await self._connected()
        return await _replies(protocol, protocol.send(commands), self.timeout)

    def send_nowait(self, commands: Sequence[Command]) -> bool:
        """Write ``commands`` on the open connection, ahead of anything sent after them, without
        waiting for their replies (errors are dropped); False, with nothing sent, if no
        connection is open. They go out with the next commands sent in this round of the event
        loop's callbacks, or at the start of the next round."""
        protocol = self._protocol
        if protocol is None or protocol.closed.done():
            return False
        for future in protocol.send(commands, defer=True):
            future.add_done_callback(_drop)
        return True

    async def open(self, on_message: MessageHandler | None = None) -> _Protocol:
        """A new connection, authenticated and on the configured database."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: _Protocol(on_message), *self._address
                )
        except (OSError, TimeoutError) as exc:
            raise redis_errors.ConnectionError(
                f"cannot connect to {self._address[0]}:{self._address[1]}: {exc}"
            ) from exc
        if not self._setup:
            return protocol
        try:
            replies = await _replies(protocol, protocol.send(self._setup), self.timeout)
        except BaseException:  # (a caller's time limit too: the connection is not left open)
            protocol.fail(redis_errors.ConnectionError("connection setup did not finish"))
            raise
        for reply in replies:
            if isinstance(reply, Exception):  # AuthenticationError, a bad db number
                protocol.fail(reply)
                raise reply
        return protocol

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.fail(redis_errors.ConnectionError("connection closed"))

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.closed.done():
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            protocol = self._protocol
            if protocol is None or protocol.closed.done():
                protocol = self._protocol = await self.open()
        return protocol


def _drop(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log it as never retrieved


async def _replies(
    protocol: _Protocol, futures: list[asyncio.Future[Any]], timeout: float | None
) -> list[Any]:
    try:
        async with asyncio.timeout(timeout):
            return [await future for future in futures]
    except TimeoutError:
        # A reply that takes this long means a dead connection (nothing keyserial sends
        # blocks): drop it, and with it every batch still waiting on it.
        error = redis_errors.TimeoutError(f"no reply within {timeout}s")
        protocol.fail(error)
        _retrieve(futures)
        raise error from None
    except BaseException:
        _retrieve(futures)
        raise


def _retrieve(futures: list[asyncio.Future[Any]]) -> None:
    """A lost connection fails every future of a batch: the first error is raised, the others
    are the same news. Retrieve them, or asyncio logs each as never retrieved; those still
    pending (their caller was cancelled at an earlier reply) once they fail."""
    for future in futures:
        if not future.done():
            future.add_done_callback(_drop)
        elif not future.cancelled():
            future.exception()


class Subscriber:
    """A subscription to ``channels`` on a :class:`PipelinedConnection`'s server: each message
    goes straight from the parser to ``on_message`` (no task or queue per message).
    ``sharded``: they are shard channels (SSUBSCRIBE), all served by that server."""

    def __init__(
        self,
        connection: PipelinedConnection,
        channels: Sequence[str],
        on_message: MessageHandler,
        *,
        sharded: bool = False,
    ) -> None:
        self._connection = connection
        self._channels = list(channels)
        self._on_message = on_message
        self._command = "SSUBSCRIBE" if sharded else "SUBSCRIBE"
        self._protocol: _Protocol | None = None

    async def subscribe(self, within: float) -> None:
        """Connect and subscribe; returns once the server has confirmed every channel.

        :raises redis.exceptions.ConnectionError: if the server cannot be reached.
        :raises redis.exceptions.TimeoutError: if it has not confirmed within ``within``
            seconds (the connection is then closed).
        """
        self.close()
        try:
            async with asyncio.timeout(within):
                protocol = self._protocol = await self._connection.open(self._on_message)
                # One command per channel: one confirmation each. (A shard channel that
                # moves to another node later is unsubscribed by the server, in a push that
                # no one asked for: the connection is then dropped, and subscribed anew.)
                confirmations = protocol.send(
                    [(self._command, channel) for channel in self._channels]
                )
                replies = await _replies(protocol, confirmations, None)
        except TimeoutError:
            self.close()
            raise redis_errors.TimeoutError(f"no subscription within {within:g}s") from None
        for reply in replies:
            if isinstance(reply, Exception):
                protocol.fail(reply)
                raise reply

    async def ping(self, timeout: float) -> None:
        """Check that the subscription's connection still answers (a connection dropped
        silently, by a NAT or a load balancer, does not close: it only goes quiet). An error
        reply is an answer too: a server running a slow script (-BUSY) is still there, and so
        is the subscription.

        :raises redis.exceptions.RedisError: if it does not answer within ``timeout`` (the
            connection is then closed).
        """
        assert self._protocol is not None, "subscribe() first"
        protocol = self._protocol
        await _replies(protocol, protocol.send([("PING",)]), timeout)

    async def wait_closed(self) -> Exception:
        """Wait until the subscription's connection is closed; the reason."""
        assert self._protocol is not None, "subscribe() first"
        # Shielded: a caller that stops waiting (a health check's timer) must not cancel the
        # future itself, which every later wait and the close share.
        return await asyncio.shield(self._protocol.closed)

    async def until_lost(self, interval: float) -> Exception:
        """Wait until the subscription's connection closes, or until it fails a health check
        (a PING every ``interval`` seconds, answered within as long): why it is lost."""
        while True:
            with anyio.move_on_after(interval):
                return await self.wait_closed()
            try:
                await self.ping(interval)
            except redis_errors.TimeoutError:
                return redis_errors.TimeoutError(f"no answer to a PING within {interval:g}s")
            except redis_errors.RedisError as exc:
                return exc

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.fail(redis_errors.ConnectionError("subscription closed"))

    async def aclose(self) -> None:
        self.close()


# -- redis-py's connections --------------------------------------------------------------------

#: Timeouts for the command connections keyserial opens from a URL (a ``?socket_timeout=`` in
#: the URL wins). No command keyserial sends blocks, so a reply that takes longer means a dead
#: connection; without a timeout, a half-open socket after a server restart could hang forever.
#: Pub/sub connections get no read timeout: they are idle between messages by design.
URL_TIMEOUTS: dict[str, Any] = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}


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
    connection already does (its asyncio one packs in Python, several times slower). It also
    marks a client whose script batches, commands and subscriptions can take the hot path's own
    connection (:func:`pipelined_connection`). Anything hiredis cannot pack (a bool) goes to
    redis-py's packer and its error."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        command: tuple[Any, ...] = args
        if isinstance(args[0], str):  # "CLIENT SETNAME" is two words, as redis-py splits it
            command = (*args[0].encode().split(), *args[1:])
        try:
            return [hiredis.pack_command(command)]
        except TypeError:
            return super().pack_command(*args)


def own_connections(url: str) -> bool:
    """Whether keyserial's own connections serve ``url``'s hot path: plain TCP, with hiredis
    (TLS and Unix sockets keep redis-py's own connection classes)."""
    return HIREDIS_AVAILABLE and urlsplit(url).scheme == "redis"


def client_options(url: str) -> dict[str, Any]:
    """Options for a client opened from ``url``: timeouts, and the C packer where keyserial's
    own connection serves it (:func:`own_connections`)."""
    options = dict(URL_TIMEOUTS)
    if own_connections(url):
        options["connection_class"] = HiredisPackedConnection
    return options


def use_close_safe_connections(cluster: RedisCluster, url: str) -> None:
    """Make ``cluster``'s nodes open :class:`CloseSafeConnection` s. (RedisCluster takes no
    connection class; its nodes take one from the connection options they are created with.)
    TLS keeps redis-py's own class."""
    if urlsplit(url).scheme != "redis":
        return
    cluster.nodes_manager.connection_kwargs["connection_class"] = CloseSafeConnection
    for node in cluster.nodes_manager.startup_nodes.values():
        node.connection_class = CloseSafeConnection


def pipelined_connection(client: AnyRedis) -> PipelinedConnection | None:
    """The hot path's own connection, where redis-py's would be a plain TCP one with the C
    packer (see :func:`client_options`)."""
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


def describe(client: AnyRedis) -> str:
    """A URL-like name for a caller's client, for error messages (no password)."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node()
        return f"redis-cluster://{node.host}:{node.port}" if node else "redis-cluster"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}"
