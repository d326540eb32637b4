"""Long-lived subscriptions on redis-py's connections (TLS, Unix sockets, clusters, clients the
caller configured), health-checked as keyserial's own (``_resp.Subscriber``) are.

A connection that a NAT or a load balancer dropped without a word does not close: it only goes
quiet, and a subscriber that merely reads would wait forever while every reply it should have
heard waits for the client's sweep. So the subscription PINGs every ``interval`` seconds and
counts a PING unanswered within as long as lost. Both kinds of subscription offer the same
three calls, and ``Backend.listen`` keeps either subscribed with one loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection, ConnectionPool

log = logging.getLogger("keyserial")

#: What a subscription is resubscribed after: a lost connection, or any error reply (a BUSY
#: script, a restart still LOADING), which must not end the task that listens.
RESUBSCRIBE_AFTER = (redis_errors.RedisError, redis_errors.RedisClusterException, OSError)

#: The health check's PING carries this: redis-py drops the answers to its own health checks
#: (``redis-py-health-check``, on a client configured with them), but hands this one over.
_PING_TOKEN = b"keyserial-health-check"
#: Seconds the server has to confirm a subscription (as a command's reply, see ``_backend``).
_CONFIRM_TIMEOUT = 10.0


class Subscription(Protocol):
    """A subscription to some channels that hands each message to its handler."""

    async def subscribe(self) -> None:
        """Connect (again, on a new connection) and subscribe; returns once confirmed."""

    async def until_lost(self, interval: float) -> Exception:
        """Deliver messages until the connection closes or fails a health check (a PING every
        ``interval`` seconds, answered within as long); why it is lost."""

    async def aclose(self) -> None:
        """Close the connection, without waiting on a peer that may never answer."""


def pubsub_on(connection_class: type[AbstractConnection], options: dict[str, Any]) -> PubSub:
    """A pub/sub handle on a client of its own. The connection class is passed on, not only
    the options: a TLS connection's options alone would make a plaintext connection. No read
    timeout: the connection is idle between messages by design (the health check is the
    timeout)."""
    pool = ConnectionPool(connection_class=connection_class, **{**options, "socket_timeout": None})
    return Redis.from_pool(pool).pubsub()


class PubSubSubscription:
    """A :class:`Subscription` on a redis-py ``PubSub`` (made without
    ``ignore_subscribe_messages``: its confirmations are awaited)."""

    def __init__(
        self, pubsub: PubSub, channels: Sequence[str], on_message: Callable[[str, bytes], None]
    ) -> None:
        self._pubsub = pubsub
        self._channels = list(channels)
        self._on_message = on_message

    async def subscribe(self) -> None:
        """Subscribe on a new connection: the old one may be silent, not closed, and redis-py
        would keep reading from it.

        :raises redis.exceptions.RedisError: if the server cannot be reached, refuses, or does
            not confirm within 10 s.
        """
        await self._drop_connection()
        await self._pubsub.subscribe(*self._channels)
        waiting = set(self._channels)
        with anyio.fail_after(_CONFIRM_TIMEOUT):  # (a TimeoutError is an OSError)
            while waiting:
                message = await self._pubsub.get_message(timeout=_CONFIRM_TIMEOUT)
                if message is not None and message["type"] == "subscribe":
                    waiting.discard(_text(message["channel"]))
                else:
                    self._handle(message)

    async def until_lost(self, interval: float) -> Exception:
        next_ping = time.monotonic() + interval
        answer_due: float | None = None  # while a PING is unanswered
        while True:
            wake = next_ping if answer_due is None else answer_due
            try:
                message = await self._pubsub.get_message(
                    timeout=max(wake - time.monotonic(), 0.001)
                )
            except redis_errors.ResponseError as exc:
                if answer_due is None:
                    return exc
                # An error reply to the PING (a slow script's -BUSY) is an answer: the server
                # and the subscription are still there.
                message = {"type": "pong"}
            except RESUBSCRIBE_AFTER as exc:
                return exc
            if message is not None and message["type"] == "pong":
                answer_due = None
            self._handle(message)
            now = time.monotonic()
            if answer_due is not None and now >= answer_due:
                return redis_errors.TimeoutError(f"no answer to a PING within {interval:g}s")
            if answer_due is None and now >= next_ping:
                try:
                    await self._pubsub.ping(_PING_TOKEN)
                except RESUBSCRIBE_AFTER as exc:
                    return exc
                answer_due = next_ping = now + interval

    async def aclose(self) -> None:
        await self._drop_connection()
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _drop_connection(self) -> None:
        """Close the connection without waiting for the peer to acknowledge it (a dropped TLS
        connection would keep a waiting close for as long as its connect timeout, or ever)."""
        connection = self._pubsub.connection
        if connection is not None:
            await connection.disconnect(nowait=True)

    def _handle(self, message: dict[str, Any] | None) -> None:
        if message is None or message["type"] != "message":
            return
        channel = _text(message["channel"])
        try:
            self._on_message(channel, message["data"])
        except Exception:  # a bug in the handler: the subscription keeps serving
            log.exception("handling a message on %r failed", channel)


def _text(channel: str | bytes) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel
