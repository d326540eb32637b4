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
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .. import ledger
from .._backend.backend import Backend
from .._backend.durability import stored_confirmed
from .._ops import RESERVED_PREFIX, Call
from .._settings import Settings
from .._wire.codec import decode_outcome, decode_reply, encode_envelope, replied_op_ids
from .._wire.json_text import encodes
from .._wire.layout import ShardKeys, reply_channel
from .._wire.routing import home_shard, shard_for
from .._wire.signing import ReplyVerifier
from ..errors import (
    BackendUnavailable,
    ConfigError,
    KeyserialError,
    PayloadTooLarge,
    ResultNotFound,
    SubmitTimeout,
)
from .appender import Appender
from .outcomes import ReplyLookups, StoredOutcomes, settle_signed
from .pending import TIMED_OUT, Pending, closed_while_waiting, value_or_raise
from .sweep import Sweep

R = TypeVar("R")
log = logging.getLogger("keyserial.client")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # another async library (trio), or no event loop at all
        return None


class Client:
    """A connection to one keyserial namespace. Create it with :func:`keyserial.connect`."""

    def __init__(self, backend: Backend, settings: Settings, shard_count: int) -> None:
        self.settings = settings
        self.shard_count = shard_count
        random_id = uuid.uuid4().hex
        self.client_id = f"{settings.service}.{random_id}" if settings.service else random_id
        self._pid = os.getpid()
        self._op_ids = _OpIds(self.client_id)
        self._backend = backend
        #: The client's key pair for signed replies; its public half ends the reply channel.
        self._verifier = ReplyVerifier(reply_channel(settings.namespace, self.client_id))
        self._reply = self._verifier.channel
        #: The submits awaited, by op id.
        self._waiting: dict[str, list[Pending]] = defaultdict(list)
        self._task_group: TaskGroup | None = None
        #: The event loop the client was opened on: its connection and tasks live there.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shards = [ShardKeys(settings.namespace, shard) for shard in range(shard_count)]
        self._appender = Appender(backend, settings, self._shards)
        outcomes = StoredOutcomes(backend, settings, self._waiting)
        self._lookups = ReplyLookups(backend, outcomes, self._shards, self._waiting, self._verifier)
        self._sweep = Sweep(
            backend, settings, self._waiting, self._settle, outcomes, self._appender.requeue
        )

    async def __aenter__(self) -> Client:
        if self._loop is not None:  # (its tasks, connection and cancel scope are in use)
            raise KeyserialError(
                "this keyserial client was opened already; a client is entered once, by"
                " `async with keyserial.connect(...)`: open another one instead"
            )
        self._loop = asyncio.get_running_loop()
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
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the background tasks and close the connection. Submits still waiting (in
        other tasks) fail at once, each saying whether its op may still apply: none waits for
        a reply that can no longer come. (The body's error, if any, stays the body's: it is not
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

    def shard_of(self, key: str) -> int:
        return shard_for(key, self.shard_count)

    def new_op_id(self) -> str:
        """A fresh op id, unique across clients and unguessable, to pass as ``op_id=``: the
        caller then knows the op's id before it awaits, so after a cancel it can fetch the
        outcome (``ks.result(op_id, key=...)``) or resubmit under the same id (it never runs
        twice).

        :raises KeyserialError: in a process forked from the one that opened the client, whose
            ids it would repeat.
        """
        if self._pid != os.getpid():
            raise KeyserialError(
                f"this keyserial client was opened in process {self._pid}, before a fork: its op"
                " ids would repeat the parent's; open a client in this process"
            )
        return next(self._op_ids)

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        """The client's loop, if the caller runs on it (a client used from another loop would
        append ops whose replies never reach the caller)."""
        if self._task_group is None:
            raise KeyserialError("the client is closed; use `async with keyserial.connect(...)`")
        loop = _running_loop()
        if loop is None or loop is not self._loop:
            raise KeyserialError(
                "this keyserial client was opened on another event loop (or thread); a client"
                " serves only the loop it was opened on: open one per loop, or use"
                " keyserial.connect_sync() from threads"
            )
        return loop

    async def submit(
        self, key: str, call: Call[R], *, timeout: float | None = None, op_id: str | None = None
    ) -> R:
        """Run ``call`` on ``key``'s shard, after every op already appended for the key.

        Returns the op's return value once its effects are committed. Resubmitting an ``op_id``
        returns the stored outcome instead of running the op again.

        :raises OperationFailed: (or a subclass such as ``InsufficientFunds``) if the op failed.
        ``timeout`` is in seconds; ``None`` means the ``submit_timeout`` setting (30 s by default)
        and ``math.inf`` waits without limit. If the caller is cancelled (``anyio.move_on_after``,
        a web framework, ``asyncio.wait_for``) before the op was sent, it is withdrawn and never
        appended; once sent it may still apply: pass ``op_id=ks.new_op_id()`` to be able to fetch
        its outcome or resubmit it.

        :raises SubmitTimeout: if no reply came within ``timeout`` seconds; the op may still apply.
        :raises PayloadTooLarge: if the encoded op is over ``max_payload_bytes``; nothing is sent.
        :raises BacklogFull: if the shard's stream holds ``max_backlog`` entries.
        :raises BackendUnavailable: if Redis cannot be reached.
        :raises TypeError, ValueError: if an argument cannot be carried as JSON (a set, NaN);
            ``ValueError`` for a malformed ``op_id`` or a reserved op name too.
        """
        _check_key(key)
        return await self._submit(key, self.shard_of(key), call, timeout, op_id)

    def _home(self, keys: Sequence[str]) -> int:
        """The shard a multi-key op is appended to: the lowest of its keys' shards."""
        if not isinstance(keys, (list, tuple)) or not keys:
            # (Not a set: the op sees its keys in the order given.)
            raise TypeError(f"keys must be a list of non-empty strings, not {keys!r}")
        for key in keys:
            _check_key(key)
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be distinct: {list(keys)!r}")
        return home_shard(keys, self.shard_count)

    async def submit_many(
        self,
        keys: Sequence[str],
        call: Call[R],
        *,
        timeout: float | None = None,
        op_id: str | None = None,
    ) -> R:
        """Run a multi-key op (``@keyserial.multi_op``) on ``keys``, atomically and isolated:
        it sees and writes all their states as if alone, after every op already appended for
        any of them.

        Keys on one shard cost what a single-key op costs. Keys on several shards are
        coordinated by the lowest one (the op's home, where its result is stored): it takes the
        other shards' keys in ascending shard order, so two such ops can never deadlock.

        Raises as :meth:`submit` does.
        """
        home = self._home(keys)
        return await self._submit(tuple(keys), home, call, timeout, op_id)

    async def transfer(
        self,
        source: str,
        target: str,
        amount: int,
        *,
        timeout: float | None = None,
        op_id: str | None = None,
    ) -> dict[str, int]:
        """Move ``amount`` from ledger key ``source`` to ``target``, atomically; returns both
        new balances by key.

        :raises InsufficientFunds: if ``source`` holds less (neither balance changes).
        """
        return await self.submit_many(
            [source, target], ledger.transfer(amount), timeout=timeout, op_id=op_id
        )

    async def _submit(
        self,
        keys: str | tuple[str, ...],
        shard: int,
        call: Call[R],
        timeout: float | None,
        op_id: str | None,
    ) -> R:
        if (
            not isinstance(call, Call)
            or not isinstance(call.name, str)
            or not call.name
            or not isinstance(call.args, tuple)
            or not isinstance(call.kwargs, Mapping)
        ):
            raise TypeError(
                f"expected a keyserial Call (op(...) or keyserial.call(...)), not {call!r}"
            )
        if call.name.startswith(RESERVED_PREFIX):
            raise ValueError(f"op {call.name!r} is keyserial's own; it cannot be submitted")
        loop = self._check_loop()
        timeout = self._timeout(timeout)
        if op_id is not None:
            _check_op_id(op_id, submitted=True)
        fresh = op_id is None
        op_id = op_id or self.new_op_id()
        envelope = encode_envelope(op_id, keys, call, self._reply)
        size = len(envelope) if envelope.isascii() else len(envelope.encode())  # bytes
        if size > self.settings.max_payload_bytes:
            key = keys if isinstance(keys, str) else keys[0]
            raise PayloadTooLarge(key=key, size=size, limit=self.settings.max_payload_bytes)
        pending = Pending(op_id, keys, shard, envelope, loop.create_future(), fresh=fresh)
        self._waiting[op_id].append(pending)
        self._appender.add(pending)
        # A timer, not a cancel scope: a deadline on every submit then costs next to nothing.
        timer = loop.call_later(timeout, pending.expire) if timeout < math.inf else None
        try:
            await pending.done
        except BaseException:  # cancelled: withdrawn if not sent yet; else it may still apply
            self._appender.withdraw(pending)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._forget(pending)
        if pending.outcome is TIMED_OUT:
            raise await self._timed_out(pending, timeout)
        value: R = self._unwrap(pending)
        return value

    async def read(self, key: str) -> Any:
        """The key's last committed state (``None`` if it has none), without queueing an op.

        It may trail ops that are appended but not yet committed; ``submit`` an op for a read
        that is ordered after them.
        """
        self._check_loop()
        _check_key(key)
        raw = await self._backend.state(self._shards[self.shard_of(key)], key)
        return None if raw is None else json.loads(raw)

    async def result(self, op_id: str, *, key: str | Sequence[str]) -> Any:
        """The stored outcome of op ``op_id`` on ``key`` (for a multi-key op: its list of keys):
        its value, or its error raised.

        :raises ResultNotFound: if the op has not been applied yet, or its result expired.
        :raises OperationFailed: if the op failed.
        """
        self._check_loop()
        # ('#' is not refused here: a foreign client's op may have stored an outcome so.)
        _check_op_id(op_id, submitted=False)
        if isinstance(key, str):
            _check_key(key)
        shard = self.shard_of(key) if isinstance(key, str) else self._home(key)
        all_keys = (key,) if isinstance(key, str) else tuple(key)
        keys = ShardKeys(self.settings.namespace, shard)
        (raw,), confirmed = await stored_confirmed(
            self._backend, self.settings.durability, keys, [op_id]
        )
        if raw is not None and not confirmed:
            raise BackendUnavailable(
                self._backend.url,
                f"the result of op {op_id!r} is stored, but its durability"
                f" (durable_replicas={self.settings.durable_replicas},"
                f" durable_fsync={self.settings.durable_fsync}) was not confirmed in time"
                " (try again)",
                op_id=op_id,
                keys=all_keys,
            )
        if raw is None:
            raise ResultNotFound(key=all_keys[0], op_id=op_id)
        return value_or_raise(decode_outcome(raw), keys=all_keys, op_id=op_id)

    # -- internals -----------------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float:
        """``timeout``, checked before anything is sent, or the ``submit_timeout`` setting."""
        if timeout is None:
            return self.settings.submit_timeout
        if not isinstance(timeout, (int, float)) or type(timeout) is bool:
            raise TypeError(f"timeout must be a number of seconds, not {timeout!r}")
        if not timeout > 0:  # (NaN too: it would never expire)
            raise ValueError(f"timeout must be positive seconds or math.inf, not {timeout!r}")
        return timeout

    async def _timed_out(self, pending: Pending, timeout: float) -> SubmitTimeout:
        """The timeout error, naming the op's shards that no worker holds (the usual reason an
        op waits that long: no worker serves its namespace, or none runs at all)."""
        withdrawn = self._appender.withdraw(pending)
        shards = sorted({self.shard_of(key) for key in pending.all_keys})
        vacant: list[int] = []
        with anyio.move_on_after(min(1.0, timeout)):
            for shard in shards:
                try:
                    if not await self._backend.lease_held(self._shards[shard]):
                        vacant.append(shard)
                except KeyserialError:  # the timeout is the error to report
                    break
        log.debug("op %s timed out (withdrawn unsent: %s)", pending.op_id, withdrawn)
        return SubmitTimeout(
            key=pending.key,
            op_id=pending.op_id,
            timeout=timeout,
            keys=pending.all_keys,
            namespace=self.settings.namespace,
            vacant=vacant,
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

    async def _listen_for_replies(self, *, task_status: TaskStatus[None]) -> None:
        try:
            await self._backend.listen(
                [self._reply],
                lambda _, data: self._deliver(data),
                health_interval=self.settings.health_interval,
                task_status=task_status,
            )
        except ConfigError as exc:  # (the ACL: a client user per service has its own channels)
            raise ConfigError(
                f"cannot subscribe to this client's reply channel {self._reply!r}: {exc}. A"
                " client user of a service may use only its own reply channels: connect with"
                " service= (KEYSERIAL_SERVICE) set to the name its ACL rules use"
            ) from None

    def _deliver(self, data: bytes) -> None:
        """A reply message signed by a worker settles the submits it answers; any other names
        ops to look up. Its outcomes are taken as they are only where the settings trust
        replies (see _outcomes)."""
        try:
            if not self.settings.verify_replies:
                for op_id, outcome in decode_reply(data):
                    self._settle(op_id, outcome)
                return
            signed = self._verifier.verified(data, self._lookups.wants_signer)
            if signed is None:
                replied = replied_op_ids(data)
            else:
                replied = settle_signed(decode_reply(signed), self._waiting)
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed reply message: %r", data[:200])
            return
        self._lookups.announced(replied)


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty string, not {key!r}")
    if not encodes(key):
        raise ValueError(f"key {key!r} holds an unpaired surrogate: it cannot be sent")


def _check_op_id(op_id: object, *, submitted: bool) -> None:
    """A submitted op id may not hold '#', which names keyserial's coordination records."""
    if (
        not isinstance(op_id, str)
        or not op_id
        or not encodes(op_id)
        or (submitted and "#" in op_id)
    ):
        wanted = "a non-empty string without '#'" if submitted else "a non-empty string"
        raise ValueError(f"op_id must be {wanted}, not {op_id!r}")


class _OpIds:
    """Op ids: the client's id, a counter (unique) and 64 random bits (unguessable). With the
    counter alone, anyone who saw one id could append ops under the client's next ids ahead of
    it, and its submits would be answered with their outcomes. The random bits are drawn 256 ids
    at a time: one system call for all of them."""

    _BATCH = 256

    def __init__(self, client_id: str) -> None:
        self._client_id = client_id
        self._count = itertools.count()
        self._random: list[str] = []

    def __iter__(self) -> _OpIds:
        return self

    def __next__(self) -> str:
        if not self._random:
            drawn = os.urandom(8 * self._BATCH).hex()
            self._random = [drawn[at : at + 16] for at in range(0, len(drawn), 16)]
        return f"{self._client_id}-{next(self._count):x}{self._random.pop()}"
