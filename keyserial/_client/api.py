"""The client's API, the same on every event loop: argument checks and routing, then the calls
that talk to Redis (``_client.asyncio_client`` on asyncio, ``_client.foreign`` forwarding to it from
trio)."""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

from .. import ledger
from .._ops import RESERVED_PREFIX
from .._settings import Settings
from .._wire.call import Call
from .._wire.codec import call_binding
from .._wire.json_text import encodes
from .._wire.layout import Layout
from .._wire.routing import shard_for
from .metrics import CLIENT_METRICS
from .pending import When

R = TypeVar("R")

#: What a submit names: one key, or the keys of a multi-key op.
Keys = str | tuple[str, ...]


class Client(abc.ABC):
    """A connection to one keyserial namespace. Create it with :func:`keyserial.connect`."""

    def __init__(self, settings: Settings, layout: Layout, client_id: str) -> None:
        self.settings = settings
        self._layout = layout
        self.client_id = client_id

    @property
    def layout(self) -> Layout:
        """The namespace's layout this client routes new ops by (its shard count, and their
        names): during a reshard, the one the namespace moves to."""
        return self._layout

    @property
    def shard_count(self) -> int:
        return self.layout.shards

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop the background tasks and close the connection. Submits still waiting (in
        other tasks) fail at once, each saying whether its op may still apply: none waits for
        a reply that can no longer come."""

    def shard_of(self, key: str) -> int:
        return shard_for(key, self.shard_count)

    @abc.abstractmethod
    def new_op_id(self) -> str:
        """A fresh op id, unique across clients and unguessable, to pass as ``op_id=``: the
        caller then knows the op's id before it awaits, so after a cancel it can fetch the
        outcome (``ks.result(op_id, key=...)``) or resubmit under the same id (it never runs
        twice).

        :raises KeyserialError: in a process forked from the one that opened the client, whose
            ids it would repeat.
        """

    async def submit(
        self,
        key: str,
        call: Call[R],
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> R:
        """Run ``call`` on ``key``'s shard, after every op already appended for the key.

        Returns the op's return value once its effects are committed. Resubmitting an ``op_id``
        returns the stored outcome instead of running the op again.

        ``delay`` (seconds) or ``at`` (a datetime; a naive one is local time) runs it later: it
        waits in Redis, in the shard's timers, and takes its place in the key's order at its
        due time, by Redis's clock, never before, behind every op appended before then. The
        ``timeout`` then counts from the due time.

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
        check_key(key)
        return await self._checked_submit(key, call, timeout, op_id, when_due(delay, at))

    async def enqueue(
        self,
        key: str,
        call: Call[Any],
        *,
        op_id: str | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> str:
        """Append ``call`` for ``key`` as :meth:`submit` does, and return its op id as soon as
        it is appended, without waiting for it to run: fetch its outcome later with
        ``ks.result(op_id, key=key)`` (``ResultNotFound`` until it has run). ``delay`` or
        ``at``: as :meth:`submit` takes them.

        ``timeout`` bounds the wait for the append (default: ``submit_timeout``). Sending it
        again under the returned (or a given) ``op_id`` never runs it twice.

        :raises SubmitTimeout: if it was not appended within ``timeout``; it may still apply.
        Raises as :meth:`submit` does before anything is sent (``PayloadTooLarge``,
        ``TypeError``, ``ValueError``), and ``BacklogFull`` or ``BackendUnavailable`` when the
        append fails (then it may have been appended: enqueue it again under the same op id).
        """
        check_key(key)
        when = when_due(delay, at)
        seconds = self._checked(call, timeout, op_id)
        return await self._enqueue(key, call, seconds, op_id, when)

    async def submit_many(
        self,
        keys: Sequence[str],
        call: Call[R],
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> R:
        """Run a multi-key op (``@keyserial.multi_op``) on ``keys``, atomically and isolated:
        it sees and writes all their states as if alone, after every op already appended for
        any of them.

        Keys on one shard cost what a single-key op costs. Keys on several shards are
        coordinated by the lowest one (the op's home, where its result is stored): it takes the
        other shards' keys in ascending shard order, so two such ops can never deadlock.

        ``delay`` or ``at``: as :meth:`submit` takes them (the op waits on its home shard).
        Raises as :meth:`submit` does.
        """
        check_keys(keys)
        return await self._checked_submit(tuple(keys), call, timeout, op_id, when_due(delay, at))

    async def transfer(
        self,
        source: str,
        target: str,
        amount: int,
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> dict[str, int]:
        """Move ``amount`` from ledger key ``source`` to ``target``, atomically; returns both
        new balances by key. ``delay`` or ``at``: as :meth:`submit` takes them.

        :raises InsufficientFunds: if ``source`` holds less (neither balance changes).
        """
        return await self.submit_many(
            [source, target],
            ledger.transfer(amount),
            timeout=timeout,
            op_id=op_id,
            delay=delay,
            at=at,
        )

    async def read(self, key: str) -> Any:
        """The key's last committed state (``None`` if it has none), without queueing an op.

        It may trail ops that are appended but not yet committed; ``submit`` an op for a read
        that is ordered after them.
        """
        check_key(key)
        return await self._state(key)

    async def result(
        self, op_id: str, *, key: str | Sequence[str], op: Call[Any] | None = None
    ) -> Any:
        """The stored outcome of op ``op_id`` on ``key`` (for a multi-key op: its list of keys):
        its value, or its error raised. ``op``: the call submitted under ``op_id``. Given, an
        outcome that another op stored under that id (an id taken ahead by another client) is
        not returned: this raises the ``MalformedOperation`` a submit of ``op`` would get. An
        id chosen by hand can be taken ahead; a generated one cannot be guessed.

        :raises ResultNotFound: if the op has not been applied yet, or its result expired.
        :raises OperationFailed: if the op failed (or, ``op`` given, the id is another op's).
        """
        # ('#' is not refused here: a foreign client's op may have stored an outcome so.)
        check_op_id(op_id, submitted=False)
        if isinstance(key, str):
            check_key(key)
        else:
            check_keys(key)
        bound_to = None
        if op is not None:
            check_call(op)
            bound_to = call_binding(op_id, key, op)
        all_keys = (key,) if isinstance(key, str) else tuple(key)
        return await self._stored_result(op_id, all_keys, bound_to)

    # -- what each kind of client does with checked arguments ---------------------------------

    @abc.abstractmethod
    async def _send(
        self, keys: Keys, call: Call[R], timeout: float, op_id: str | None, when: When | None
    ) -> R:
        """Append the op to its home shard (due ``when``; None: now) and wait for its outcome
        (``timeout``: seconds after it is due, or ``math.inf``)."""

    @abc.abstractmethod
    async def _enqueue(
        self, keys: Keys, call: Call[Any], timeout: float, op_id: str | None, when: When | None
    ) -> str:
        """Append the op to its home shard (due ``when``); its op id once appended."""

    @abc.abstractmethod
    async def _state(self, key: str) -> Any:
        """The committed state of ``key``."""

    @abc.abstractmethod
    async def _stored_result(
        self, op_id: str, keys: tuple[str, ...], bound_to: str | None = None
    ) -> Any:
        """The outcome stored for ``op_id``, an op on ``keys`` (``bound_to``: the binding of
        the op it must be, or None to take any op's)."""

    # -- checks --------------------------------------------------------------------------------

    async def _checked_submit(
        self,
        keys: Keys,
        call: Call[R],
        timeout: float | None,
        op_id: str | None,
        when: When | None = None,
    ) -> R:
        seconds = self._checked(call, timeout, op_id)
        namespace = self.settings.namespace
        began, error = CLIENT_METRICS.began(namespace), None
        try:
            return await self._send(keys, call, seconds, op_id, when)
        except BaseException as exc:
            error = exc
            raise
        finally:
            CLIENT_METRICS.ended(namespace, began, error)

    def _checked(self, call: Call[Any], timeout: float | None, op_id: str | None) -> float:
        """Check a submit's call and op id before anything is sent; its timeout in seconds."""
        check_call(call)
        seconds = self._timeout(timeout)
        if op_id is not None:
            check_op_id(op_id, submitted=True)
        return seconds

    def _timeout(self, timeout: float | None) -> float:
        """``timeout``, checked before anything is sent, or the ``submit_timeout`` setting."""
        if timeout is None:
            return self.settings.submit_timeout
        if not isinstance(timeout, (int, float)) or type(timeout) is bool:
            raise TypeError(f"timeout must be a number of seconds, not {timeout!r}")
        if not timeout > 0:  # (NaN too: it would never expire)
            raise ValueError(f"timeout must be positive seconds or math.inf, not {timeout!r}")
        return timeout


#: The longest delay, in ms: the submit script takes a due time of at most 15 digits.
_LONGEST_DELAY_MS = 10**14


def when_due(delay: object, at: object) -> When | None:
    """When an op given ``delay`` (seconds) or ``at`` (a datetime) is due; None for now."""
    if delay is not None and at is not None:
        raise TypeError("give delay or at, not both")
    if at is not None:
        if not isinstance(at, datetime):
            raise TypeError(f"at must be a datetime, not {at!r}")
        due_ms = math.ceil(at.timestamp() * 1000)  # (never early: rounded up; 15 digits at most)
        return When(str(max(due_ms, 0)), max(0.0, due_ms / 1000 - time.time()))
    if delay is None:
        return None
    if not isinstance(delay, (int, float)) or type(delay) is bool:
        raise TypeError(f"delay must be a number of seconds, not {delay!r}")
    if not 0 <= delay < math.inf:  # (NaN too)
        raise ValueError(f"delay must be zero or more finite seconds, not {delay!r}")
    delay_ms = math.ceil(delay * 1000)
    if delay_ms > _LONGEST_DELAY_MS:
        raise ValueError(f"delay is too long: {delay!r} seconds")
    return When(f"+{delay_ms}", float(delay))


def check_call(call: object) -> None:
    if (
        not isinstance(call, Call)
        or not isinstance(call.name, str)
        or not call.name
        or not isinstance(call.args, tuple)
        # (dict first: the usual kwargs, which then skip the Mapping ABC's own check)
        or not isinstance(call.kwargs, (dict, Mapping))
    ):
        raise TypeError(f"expected a keyserial Call (op(...) or keyserial.call(...)), not {call!r}")
    if call.name.startswith(RESERVED_PREFIX):
        raise ValueError(f"op {call.name!r} is keyserial's own; it cannot be submitted")


def check_keys(keys: object) -> None:
    """A multi-key op's keys: a list or tuple (not a set: the op sees its keys in the order
    given) of distinct keys."""
    if not isinstance(keys, (list, tuple)) or not keys:
        raise TypeError(f"keys must be a list of non-empty strings, not {keys!r}")
    for key in keys:
        check_key(key)
    if len(set(keys)) != len(keys):
        raise ValueError(f"keys must be distinct: {list(keys)!r}")


def check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty string, not {key!r}")
    if not key.isascii() and not encodes(key):  # (an ASCII key, the usual one, encodes)
        raise ValueError(f"key {key!r} holds an unpaired surrogate: it cannot be sent")


def check_op_id(op_id: object, *, submitted: bool) -> None:
    """A submitted op id may not hold '#', which names keyserial's coordination records."""
    if (
        not isinstance(op_id, str)
        or not op_id
        or not encodes(op_id)
        or (submitted and "#" in op_id)
    ):
        wanted = "a non-empty string without '#'" if submitted else "a non-empty string"
        raise ValueError(f"op_id must be {wanted}, not {op_id!r}")
