"""Long-lived subscriptions on redis-py's connections (TLS, Unix sockets, clusters, clients the
caller configured), health-checked as keyserial's own (``_backend.resp.Subscriber``) are.

A connection that a NAT or a load balancer dropped without a word does not close: it only goes
quiet, and a subscriber that merely reads would wait forever while every reply it should have
heard waits for the client's sweep. So the subscription PINGs every ``interval`` seconds and
counts a PING unanswered within as long as lost. Both kinds of subscription offer the same
three calls, and ``Backend.listen`` keeps either subscribed with one loop.

This module does not talk to redis-py itself: it reads through a :class:`PubSubPort`, which the
boundary (``_backend.backend``) makes of redis-py's ``PubSub``, raising keyserial's errors only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from ..errors import KeyserialError

log = logging.getLogger("keyserial")

#: Seconds a client's or worker's first subscription may take to be confirmed: failing it fails
#: ``connect()``, so it has a command's time, not the health interval that bounds a resubscribe.
FIRST_SUBSCRIPTION_WITHIN = 10.0
#: Round trips a subscription takes (connect, set up, subscribe): a resubscription has as long
#: as a health check's PING has to be answered for each.
SUBSCRIBE_ROUND_TRIPS = 3
#: The health check's PING carries this: redis-py drops the answers to its own health checks
#: (``redis-py-health-check``, on a client configured with them), but hands this one over.
PING_TOKEN = b"keyserial-health-check"


class Subscription(Protocol):
    """A subscription to some channels that hands each message to its handler."""

    async def subscribe(self, within: float) -> None:
        """Connect (again, on a new connection) and subscribe; returns once confirmed.

        :raises KeyserialError, OSError: if that has not happened within ``within`` seconds.
        """

    async def until_lost(self, interval: float) -> Exception:
        """Deliver messages until the connection closes or fails a health check (a PING every
        ``interval`` seconds, answered within as long); why it is lost."""

    async def aclose(self) -> None:
        """Close the connection, without waiting on a peer that may never answer."""


class PubSubPort(Protocol):
    """A pub/sub connection, as redis-py's ``PubSub`` offers it, with keyserial's errors: a lost
    connection raises ``BackendUnavailable``; an error reply arrives as a message of type
    ``"error"`` whose ``data`` is its exception."""

    async def subscribe(self, channels: Sequence[str], *, sharded: bool = False) -> None:
        """Subscribe on a new connection (the old one may be silent, not closed); ``sharded``:
        to shard channels (SSUBSCRIBE), all of them served by the node connected to."""

    async def get_message(self, timeout: float) -> dict[str, Any] | None:
        """The next message (confirmations and PING answers included), or None."""

    async def ping(self, token: bytes) -> None:
        """Send a PING carrying ``token``; its answer comes as a message of type ``"pong"``."""

    async def aclose(self) -> None:
        """Close, without waiting for the peer to acknowledge it."""


class PubSubSubscription:
    """A :class:`Subscription` on a :class:`PubSubPort` (its confirmations are awaited);
    ``sharded``: to shard channels of the node it connects to."""

    def __init__(
        self,
        pubsub: PubSubPort,
        channels: Sequence[str],
        on_message: Callable[[str, bytes], None],
        *,
        sharded: bool = False,
    ) -> None:
        self._pubsub = pubsub
        self._channels = list(channels)
        self._on_message = on_message
        self._sharded = sharded
        self._confirmed = "ssubscribe" if sharded else "subscribe"

    async def subscribe(self, within: float) -> None:
        """Subscribe on a new connection: the old one may be silent, not closed, and redis-py
        would keep reading from it.

        :raises KeyserialError, OSError: if the server cannot be reached, refuses, or does not
            confirm within ``within`` seconds.
        """
        waiting = set(self._channels)
        with anyio.fail_after(within):  # (a TimeoutError is an OSError)
            await self._pubsub.subscribe(self._channels, sharded=self._sharded)
            while waiting:
                message = await self._pubsub.get_message(timeout=within)
                if message is not None and message["type"] == "error":
                    raise message["data"]
                if message is not None and message["type"] == self._confirmed:
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
            except (KeyserialError, OSError) as exc:
                return exc
            if message is not None and message["type"] == "error":
                if answer_due is None:
                    error: Exception = message["data"]
                    return error
                # An error reply to the PING (a slow script's -BUSY) is an answer: the server
                # and the subscription are still there.
                message = {"type": "pong"}
            if message is not None and message["type"] == "pong":
                answer_due = None
            if message is not None and message["type"] == "sunsubscribe":
                # The server dropped a shard channel: its slot moved to another node.
                return ConnectionResetError(f"shard channel {message['channel']!r} moved")
            self._handle(message)
            now = time.monotonic()
            if answer_due is not None and now >= answer_due:
                return TimeoutError(f"no answer to a PING within {interval:g}s")
            if answer_due is None and now >= next_ping:
                try:
                    await self._pubsub.ping(PING_TOKEN)
                except (KeyserialError, OSError) as exc:
                    return exc
                answer_due = next_ping = now + interval

    async def aclose(self) -> None:
        await self._pubsub.aclose()

    def _handle(self, message: dict[str, Any] | None) -> None:
        if message is None or message["type"] not in ("message", "smessage"):
            return
        channel = _text(message["channel"])
        try:
            self._on_message(channel, message["data"])
        except Exception:  # a bug in the handler: the subscription keeps serving
            log.exception("handling a message on %r failed", channel)


class GroupedSubscription:
    """Several subscriptions as one, each on a connection of its own (on a cluster, one per
    master that serves some of the shard channels, and one for the other channels): made
    anew at each subscribe, since slots move; lost as soon as any part is."""

    def __init__(self, parts: Callable[[bool], Awaitable[list[Subscription]]]) -> None:
        #: Makes the parts; told whether it is again (after a loss: the routing may be stale).
        self._make_parts = parts
        self._parts: list[Subscription] = []
        self._made = False

    async def subscribe(self, within: float) -> None:
        await self.aclose()
        self._parts = await self._make_parts(self._made)
        self._made = True
        for part in self._parts:  # (one after another: a failure is raised as it is)
            await part.subscribe(within)

    async def until_lost(self, interval: float) -> Exception:
        lost: list[Exception] = []

        async def watch(part: Subscription, group: TaskGroup) -> None:
            lost.append(await part.until_lost(interval))
            group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            for part in self._parts:
                group.start_soon(watch, part, group)
        return lost[0]

    async def aclose(self) -> None:
        parts, self._parts = self._parts, []
        for part in parts:
            await part.aclose()


def _text(channel: str | bytes) -> str:
    return channel.decode() if isinstance(channel, bytes) else channel
