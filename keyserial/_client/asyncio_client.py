"""The client: ``submit`` ops, read state, fetch results by op id.

Submits are queued for the appender (``_client.appender``), which coalesces those that arrive while
an append is in flight. Replies arrive on one pub/sub channel per client, read by one task; a sweep
(``_client.sweep``) fetches stored results for any reply that was lost (a reconnect, a server
restart), so no waiter depends on pub/sub alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import uuid
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .._backend.backend import Backend
from .._backend.durability import stored_confirmed
from .._backoff import Backoff
from .._settings import Settings
from .._telemetry import Carrier, submitting, tracer
from .._wire.call import Call
from .._wire.codec import decode_outcome, decode_reply, encode_envelope, replied_op_ids
from .._wire.layout import Layout, ShardKeys, reply_channel
from .._wire.resharding import LayoutRecord
from .._wire.routing import shard_for
from .._wire.signing import ReplyVerifier
from ..errors import (
    BackendUnavailable,
    ConfigError,
    KeyserialError,
    PayloadTooLarge,
    ResultNotFound,
    SubmitTimeout,
)
from .api import Client, Keys
from .appender import Appender
from .outcomes import ReplyLookups, StoredOutcomes, own_outcome, settle_signed
from .pending import TIMED_OUT, Deadlines, Pending, When, closed_while_waiting, value_or_raise
from .routes import Routes
from .sweep import Sweep

R = TypeVar("R")
log = logging.getLogger("keyserial.client")


class AsyncioClient(Client):
    """The client on the asyncio loop it was opened on (see :class:`keyserial.Client`)."""

    def __init__(self, backend: Backend, settings: Settings, record: LayoutRecord) -> None:
        random_id = uuid.uuid4().hex
        client_id = f"{settings.service}.{random_id}" if settings.service else random_id
        super().__init__(settings, record.routing, client_id)
        self._op_ids = _OpIds(self.client_id)
        self._backend = backend
        #: The client's key pair for signed replies; its public half ends the reply channel.
        self._verifier = ReplyVerifier(reply_channel(settings.namespace, self.client_id))
        self._reply = self._verifier.channel
        #: With sharded pub/sub (a cluster), a reply channel per shard: an op's reply travels
        #: on its home shard's, on the node that serves that shard.
        self._sharded = backend.sharded_pubsub
        self._routes = Routes(backend, record, self._route_to)
        #: The submits awaited, by op id.
        self._waiting: dict[str, list[Pending]] = defaultdict(list)
        self._task_group: TaskGroup | None = None
        #: The event loop the client was opened on: its connection and tasks live there.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The submits' timeouts (on the client's loop: set once it is opened).
        self._deadlines: Deadlines
        self._appender = Appender(backend, settings, self._reroute)
        outcomes = StoredOutcomes(backend, settings, self._waiting)
        self._lookups = ReplyLookups(backend, outcomes, settings, self._waiting, self._verifier)
        self._sweep = Sweep(
            backend, settings, self._waiting, self._settle, outcomes, self._appender.requeue
        )

    async def __aenter__(self) -> AsyncioClient:
        if self._loop is not None:  # (its tasks, connection and cancel scope are in use)
            raise KeyserialError(
                "this keyserial client was opened already; a client is entered once, by"
                " `async with keyserial.connect(...)`: open another one instead"
            )
        self._loop = asyncio.get_running_loop()
        self._deadlines = Deadlines(self._loop)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        try:
            await self._task_group.start(self._listen_for_replies)
        except BaseException:
            await self.aclose()
            raise
        self._task_group.start_soon(self._appender.run)
        self._task_group.start_soon(self._lookups.run)
        self._task_group.start_soon(self._sweep.run)
        self._task_group.start_soon(self._follow_layout)
        return self

    async def aclose(self) -> None:
        """See :meth:`Client.aclose`. (The body's error, if any, stays the body's: it is not
        wrapped in an exception group.)"""
        task_group, self._task_group = self._task_group, None
        self._appender.stop()
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        self._settle_waiting_on_close()
        await self._backend.aclose()

    def _settle_waiting_on_close(self) -> None:
        unsent = self._appender.take_unsent()
        for waiters in list(self._waiting.values()):
            for pending in waiters:
                pending.settle(closed_while_waiting(pending, sent=pending not in unsent))

    def new_op_id(self) -> str:
        """See :meth:`Client.new_op_id`."""
        return next(self._op_ids)

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        """The client's loop, if the caller runs on it (a client used from another loop would
        append ops whose replies never reach the caller)."""
        if self._task_group is None:
            raise KeyserialError("the client is closed; use `async with keyserial.connect(...)`")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another async library (trio), or no event loop at all
            loop = None
        if loop is None or loop is not self._loop:
            raise KeyserialError(
                "this keyserial client was opened on another event loop (or thread); a client"
                " serves only the loop it was opened on: open one per loop, or use"
                " keyserial.connect_sync() from threads"
            )
        return loop

    @property
    def layout(self) -> Layout:
        return self._routes.routing

    async def _send(
        self, keys: Keys, call: Call[R], timeout: float, op_id: str | None, when: When | None
    ) -> R:
        pending = await self._settled(keys, call, timeout, op_id, when, appended_only=False)
        value: R = self._unwrap(pending)
        return value

    async def _enqueue(
        self, keys: Keys, call: Call[Any], timeout: float, op_id: str | None, when: When | None
    ) -> str:
        pending = await self._settled(keys, call, timeout, op_id, when, appended_only=True)
        if isinstance(pending.outcome, BaseException):
            raise pending.outcome
        return pending.op_id  # (appended; or answered already, which it could only be if so)

    def _settled(
        self,
        keys: Keys,
        call: Call[Any],
        timeout: float,
        op_id: str | None,
        when: When | None,
        *,
        appended_only: bool,
    ) -> Coroutine[Any, Any, Pending]:
        """Queue the op for the appender and wait until its pending submit is settled: with
        its outcome, or (``appended_only``) as soon as it is appended. (Not a coroutine itself:
        it hands back the one to await, which spares each submit a coroutine's two calls.)

        :raises SubmitTimeout: if it is not settled within ``timeout`` seconds (once due, for
            a delayed op awaited).
        """
        fresh = op_id is None
        op_id = op_id or next(self._op_ids)
        traced = tracer()
        if traced is None:  # (the common case: no span, and no context manager either)
            return self._traced(keys, call, timeout, op_id, fresh, None, appended_only, when)
        return self._in_span(traced, keys, call, timeout, op_id, fresh, appended_only, when)

    async def _in_span(
        self,
        traced: Any,
        keys: Keys,
        call: Call[Any],
        timeout: float,
        op_id: str,
        fresh: bool,
        appended_only: bool,
        when: When | None,
    ) -> Pending:
        with submitting(traced, call.name, keys, op_id) as trace:
            return await self._traced(keys, call, timeout, op_id, fresh, trace, appended_only, when)

    async def _traced(
        self,
        keys: Keys,
        call: Call[Any],
        timeout: float,
        op_id: str,
        fresh: bool,
        trace: Carrier | None,
        appended_only: bool,
        when: When | None = None,
    ) -> Pending:
        """:meth:`_settled` in the submit's span (``trace``: its context, sent with the op)."""
        loop = self._check_loop()
        home = self._routes.home(keys)
        envelope = encode_envelope(op_id, keys, call, self._reply_for(home), trace)
        size = len(envelope) if envelope.isascii() else len(envelope.encode())  # bytes
        if size > self.settings.max_payload_bytes:
            key = keys if isinstance(keys, str) else keys[0]
            raise PayloadTooLarge(key=key, size=size, limit=self.settings.max_payload_bytes)
        pending = Pending(
            op_id,
            keys,
            home,
            envelope,
            loop.create_future(),
            fresh=fresh,
            appended_only=appended_only,
        )
        if when is not None:
            pending.due = when.due
            if not appended_only:  # (its reply, and its timeout, wait for its due time)
                pending.since += when.seconds
                timeout += when.seconds
        self._waiting[op_id].append(pending)
        self._appender.add(pending)
        # A deadline, not a cancel scope: one on every submit then costs next to nothing.
        deadline = self._deadlines.add(pending, timeout) if timeout < math.inf else None
        try:
            await pending.done
        except BaseException:  # cancelled: withdrawn if not sent yet; else it may still apply
            self._appender.withdraw(pending)
            raise
        finally:
            if deadline is not None:
                self._deadlines.discard(pending, deadline)
            self._forget(pending)
        if pending.outcome is TIMED_OUT:
            raise await self._timed_out(pending, timeout)
        return pending

    async def _state(self, key: str) -> Any:
        """The key's state in the live layout. While the client knows of a move under way, the
        new layout's first (its ops run only after the flip, so what it holds is newest): if
        it holds none, the move may not have flipped yet, so the record is read again first."""
        self._check_loop()
        raw = await self._state_in(self._routes.routing, key)
        if raw is None and self._routes.moving:
            await self._routes.learn()
            if self._routes.moving:
                raw = await self._state_in(self._routes.live, key)
        return None if raw is None else json.loads(raw)

    async def _state_in(self, layout: Layout, key: str) -> bytes | None:
        return await self._backend.state(
            self._routes.keys(layout)[shard_for(key, layout.shards)], key
        )

    async def _stored_result(
        self, op_id: str, keys: tuple[str, ...], bound_to: str | None = None
    ) -> Any:
        self._check_loop()
        raw, confirmed = None, True
        for shard in self._routes.where_stored(keys):
            (raw,), confirmed = await stored_confirmed(
                self._backend, self.settings.durability, shard, [op_id]
            )
            if raw is not None:
                break
        if raw is not None and not confirmed:
            raise BackendUnavailable(
                self._backend.url,
                f"the result of op {op_id!r} is stored, but its durability"
                f" (durable_replicas={self.settings.durable_replicas},"
                f" durable_fsync={self.settings.durable_fsync}) was not confirmed in time"
                " (try again)",
                op_id=op_id,
                keys=keys,
            )
        if raw is None:
            raise ResultNotFound(key=keys[0], op_id=op_id)
        outcome = decode_outcome(raw)
        if bound_to is not None:
            outcome = own_outcome(op_id, outcome, lambda: bound_to)
        return value_or_raise(outcome, keys=keys, op_id=op_id)

    # -- internals -----------------------------------------------------------------------------

    async def _timed_out(self, pending: Pending, timeout: float) -> SubmitTimeout:
        """The timeout error, naming the op's shards that no worker holds and its keys that an
        operator paused (the usual reasons an op waits that long: no worker serves its
        namespace, or none runs at all; or ``keyserial keys pause``, which holds a key's ops
        until it is resumed)."""
        withdrawn = self._appender.withdraw(pending)
        by_shard: dict[ShardKeys, list[str]] = {}
        for key in pending.all_keys:
            by_shard.setdefault(self._routes.home(key), []).append(key)
        vacant: list[int] = []
        paused: list[str] = []
        with anyio.move_on_after(min(1.0, timeout)):
            for shard, keys in sorted(by_shard.items()):
                try:
                    held, held_keys = await self._backend.held_and_paused(shard, keys)
                except KeyserialError:  # the timeout is the error to report
                    break
                if not held:
                    vacant.append(shard.shard)
                paused += held_keys
        log.debug("op %s timed out (withdrawn unsent: %s)", pending.op_id, withdrawn)
        return SubmitTimeout(
            key=pending.key,
            op_id=pending.op_id,
            timeout=timeout,
            keys=pending.all_keys,
            namespace=self.settings.namespace,
            vacant=vacant,
            server=self._backend.url,
            paused=[key for key in pending.all_keys if key in paused],
        )

    def _forget(self, pending: Pending) -> None:
        waiters = self._waiting.get(pending.op_id)
        if waiters is not None:
            waiters.remove(pending)
            if not waiters:
                del self._waiting[pending.op_id]

    def _unwrap(self, pending: Pending) -> Any:
        outcome = pending.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return value_or_raise(outcome, keys=pending.all_keys, op_id=pending.op_id)

    def _settle(self, op_id: str, outcome: dict[str, Any] | BaseException) -> None:
        for pending in self._waiting.get(op_id, ()):
            pending.settle(outcome)

    def _reply_for(self, shard: ShardKeys) -> str:
        """The reply channel of an op whose home is ``shard``."""
        return shard.in_shard(self._reply) if self._sharded else self._reply

    def _replies_of(self, layouts: Sequence[Layout]) -> list[str]:
        """The reply channels of ops homed in ``layouts``."""
        if not self._sharded:
            return [self._reply]
        return [
            self._reply_for(shard)
            for layout in {layout.generation: layout for layout in layouts}.values()
            for shard in self._routes.keys(layout)
        ]

    # -- reshards ------------------------------------------------------------------------------

    def _route_to(self, layout: Layout) -> None:
        """The client routes new ops to ``layout`` from now on: on a cluster, listen for
        replies on its shards' channels too."""
        if self._sharded and self._task_group is not None:
            self._task_group.start_soon(
                partial(self._listen_for_replies, self._replies_of([layout]))
            )

    def _reroute(self, refused: list[Pending]) -> None:
        """A reshard sealed the shards these ops were appended to, and nothing was appended:
        learn the layout again and append them where they route now."""
        if self._task_group is not None:
            self._task_group.start_soon(self._append_rerouted, refused)

    async def _append_rerouted(self, refused: list[Pending]) -> None:
        pause = Backoff(0.05, 1.0)
        while refused:
            try:
                await self._routes.learn()
            except (BackendUnavailable, ConfigError) as exc:
                log.warning("reading the namespace's layout: %s (retrying)", exc)
            moved, refused = [], [pending for pending in refused if not pending.done.done()]
            for pending in list(refused):
                home = self._routes.home(pending.all_keys)
                if home != pending.shard:  # (else the move is not recorded where we read)
                    pending.rehome(home, self._reply_for(home))
                    moved.append(pending)
                    refused.remove(pending)
            self._appender.requeue(moved)
            if refused:
                await pause.sleep()

    async def _follow_layout(self) -> None:
        """Read the layout record every ``idle_poll``: a client that appends nothing learns
        of a reshard too (its reads then go where the states are)."""
        while True:
            await anyio.sleep(self.settings.idle_poll)
            try:
                await self._routes.learn()
            except (KeyserialError, ConfigError) as exc:
                log.debug("reading the namespace's layout: %s", exc)

    async def _listen_for_replies(
        self,
        channels: Sequence[str] | None = None,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        if channels is None:
            channels = self._replies_of([self._routes.live, self._routes.routing])
        try:
            await self._backend.listen(
                channels,
                self._deliver,
                health_interval=self.settings.health_interval,
                on_resubscribed=self._sweep.now,
                task_status=task_status,
            )
        except ConfigError as exc:  # (the ACL: a client user per service has its own channels)
            raise ConfigError(
                f"cannot subscribe to this client's reply channel {self._reply!r}: {exc}. A"
                " client user of a service may use only its own reply channels: connect with"
                " service= (KEYSERIAL_SERVICE) set to the name its ACL rules use"
            ) from None

    def _deliver(self, channel: str, data: bytes) -> None:
        """A reply message signed by a worker settles the submits it answers; any other names
        ops to look up. Its outcomes are taken as they are only where the settings trust
        replies (see _outcomes)."""
        try:
            if not self.settings.verify_replies:
                for op_id, outcome in decode_reply(data):
                    self._settle(op_id, outcome)
                return
            signed = self._verifier.verified(data, self._lookups.signers.met, channel)
            if signed is None:
                replied = replied_op_ids(data)
            else:
                replied = settle_signed(decode_reply(signed), self._waiting)
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed reply message: %r", data[:200])
            return
        self._lookups.announced(replied)


class _OpIds:
    """Op ids: the client's id, a counter (unique) and 64 random bits (unguessable). With the
    counter alone, anyone who saw one id could append ops under the client's next ids ahead of
    it, and its submits would be answered with their outcomes. The random bits are drawn 256 ids
    at a time: one system call for all of them. In a process forked from the one that opened the
    client, they would repeat the parent's: there they are refused."""

    _BATCH = 256

    def __init__(self, client_id: str) -> None:
        self._client_id = client_id
        self._pid = os.getpid()
        self._count = itertools.count()
        self._random: list[str] = []

    def __iter__(self) -> _OpIds:
        return self

    def __next__(self) -> str:
        if self._pid != os.getpid():
            raise KeyserialError(
                f"this keyserial client was opened in process {self._pid}, before a fork: its op"
                " ids would repeat the parent's; open a client in this process"
            )
        if not self._random:
            drawn = os.urandom(8 * self._BATCH).hex()
            self._random = [drawn[at : at + 16] for at in range(0, len(drawn), 16)]
        return f"{self._client_id}-{next(self._count):x}{self._random.pop()}"
