"""The client: ``submit`` ops, read state, fetch results by op id.

Submits that arrive while an append is in flight are coalesced: ops bound for one shard are packed
into one stream entry, and all entries go out in one pipeline. Replies arrive on one pub/sub
channel per client, read by one task; a sweep fetches stored results for any reply that was lost
(a reconnect, a server restart), so no waiter depends on pub/sub alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from . import _durability, ledger
from ._backend import Backend
from ._codec import WIRE_VERSION, decode_outcome, decode_reply, encode_envelope, pack_entry
from ._layout import ShardKeys, reply_channel
from ._ops import RESERVED_PREFIX, Call
from ._refusals import BacklogRefused, Refused
from ._routing import shard_for
from ._scripts import ScriptCall
from ._settings import Settings
from ._submit_scripts import SubmitArgs, submit
from .errors import (
    BackendUnavailable,
    BacklogFull,
    KeyserialError,
    OperationFailed,
    PayloadTooLarge,
    ResultNotFound,
    SubmitTimeout,
)

R = TypeVar("R")
log = logging.getLogger("keyserial.client")

#: Seconds before an append the server refused for now (BUSY, LOADING) is sent again.
_REFUSED_RETRY = 0.1
#: Ops packed into one stream entry at most, and its size in bytes at most.
_ENTRY_OPS = 256
_ENTRY_BYTES = 256 * 1024


#: What a pending submit is settled with when its timeout fires first.
_TIMED_OUT: dict[str, Any] = {}


class _Pending:
    """One awaited submit."""

    __slots__ = (
        "done", "entry", "envelope", "fresh", "keys", "op_id", "outcome", "shard", "since"
    )

    def __init__(
        self,
        op_id: str,
        keys: str | tuple[str, ...],
        shard: int,
        envelope: str,
        done: asyncio.Future[None],
        *,
        fresh: bool,
    ) -> None:
        self.op_id = op_id
        #: The op id was generated for this submit: no entry carried it before.
        self.fresh = fresh
        self.keys = keys
        self.shard = shard
        self.envelope = envelope
        # A bare future of the client's own loop: an anyio Event costs several times as much to
        # make, once per submit, and the client's transport is bound to that loop anyway.
        self.done = done
        self.outcome: dict[str, Any] | BaseException | None = None
        self.since = time.monotonic()
        #: The stream entry that carries the op, once appended (the sweep checks it is there).
        self.entry: bytes | None = None

    @property
    def key(self) -> str:
        """The op's key; for a multi-key op, its first."""
        return self.keys if isinstance(self.keys, str) else self.keys[0]

    @property
    def all_keys(self) -> tuple[str, ...]:
        return (self.keys,) if isinstance(self.keys, str) else self.keys

    def settle(self, outcome: dict[str, Any] | BaseException) -> None:
        if not self.done.done():  # (also done once its waiter is cancelled)
            self.outcome = outcome
            self.done.set_result(None)

    def expire(self) -> None:
        self.settle(_TIMED_OUT)


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
        self.client_id = uuid.uuid4().hex
        # Op ids: the client's random id plus a counter (unique, and cheaper than a uuid4 each).
        self._op_ids = itertools.count()
        self._backend = backend
        self._reply = reply_channel(settings.namespace, self.client_id)
        self._queue: list[_Pending] = []
        self._queued = anyio.Event()
        #: Redis nodes with an append in flight (see ``_append_loop``).
        self._appending: set[str] = set()
        self._waiting: dict[str, list[_Pending]] = defaultdict(list)
        self._task_group: TaskGroup | None = None
        #: The event loop the client was opened on: its connection and tasks live there.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shards = [ShardKeys(settings.namespace, shard) for shard in range(shard_count)]
        #: Each shard's stream, named once rather than for every op appended.
        self._streams = [keys.stream for keys in self._shards]

    async def __aenter__(self) -> Client:
        self._loop = asyncio.get_running_loop()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        try:
            await self._task_group.start(self._listen_for_replies)
        except BaseException:
            await self.aclose()
            raise
        self._task_group.start_soon(self._append_loop)
        self._task_group.start_soon(self._sweep_loop)
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
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        self._settle_waiting_on_close()
        await self._backend.aclose()

    def _settle_waiting_on_close(self) -> None:
        unsent, self._queue = set(self._queue), []
        for waiters in list(self._waiting.values()):
            for pending in waiters:
                pending.settle(_closed_while_waiting(pending, sent=pending not in unsent))

    def shard_of(self, key: str) -> int:
        return shard_for(key, self.shard_count)

    def new_op_id(self) -> str:
        """A fresh op id, unique across clients, to pass as ``op_id=``: the caller then knows
        the op's id before it awaits, so after a cancel it can fetch the outcome
        (``ks.result(op_id, key=...)``) or resubmit under the same id (it never runs twice)."""
        return f"{self.client_id}-{next(self._op_ids)}"

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
        :raises BacklogFull: if the shard holds ``max_backlog`` unprocessed entries.
        :raises BackendUnavailable: if Redis cannot be reached.
        :raises TypeError: if an argument is not JSON-serializable.
        """
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty string, not {key!r}")
        return await self._submit(key, self.shard_of(key), call, timeout, op_id)

    def _home(self, keys: Sequence[str]) -> int:
        """The shard a multi-key op is appended to: the lowest of its keys' shards."""
        if isinstance(keys, str) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise TypeError(f"keys must be a list of non-empty strings, not {keys!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be distinct: {list(keys)!r}")
        return min(self.shard_of(key) for key in keys)

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
        return await self._submit(tuple(keys), self._home(keys), call, timeout, op_id)

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
        if not isinstance(call, Call):
            raise TypeError(
                f"expected a keyserial Call (op(...) or keyserial.call(...)), not {call!r}"
            )
        if call.name.startswith(RESERVED_PREFIX):
            raise ValueError(f"op {call.name!r} is keyserial's own; it cannot be submitted")
        loop = self._check_loop()
        if op_id is not None and (not isinstance(op_id, str) or not op_id or "#" in op_id):
            raise ValueError(f"op_id must be a non-empty string without '#', not {op_id!r}")
        fresh = op_id is None
        op_id = op_id or self.new_op_id()
        envelope = encode_envelope(op_id, keys, call, self._reply)
        size = len(envelope) if envelope.isascii() else len(envelope.encode())  # bytes
        if size > self.settings.max_payload_bytes:
            key = keys if isinstance(keys, str) else keys[0]
            raise PayloadTooLarge(key=key, size=size, limit=self.settings.max_payload_bytes)
        # A caller whose deadline has already passed (``move_on_after(0)``) sends nothing.
        await anyio.lowlevel.checkpoint_if_cancelled()
        pending = _Pending(op_id, keys, shard, envelope, loop.create_future(), fresh=fresh)
        self._waiting[op_id].append(pending)
        self._queue.append(pending)
        self._queued.set()
        if timeout is None:
            timeout = self.settings.submit_timeout
        # A timer, not a cancel scope: a deadline on every submit then costs next to nothing.
        timer = loop.call_later(timeout, pending.expire) if timeout < math.inf else None
        try:
            await pending.done
        except BaseException:  # cancelled: withdrawn if not sent yet; else it may still apply
            self._withdraw(pending)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._forget(pending)
        if pending.outcome is _TIMED_OUT:
            raise await self._timed_out(pending, timeout)
        value: R = self._unwrap(pending)
        return value

    async def read(self, key: str) -> Any:
        """The key's last committed state (``None`` if it has none), without queueing an op.

        It may trail ops that are appended but not yet committed; ``submit`` an op for a read
        that is ordered after them.
        """
        self._check_loop()
        raw = await self._backend.state(self._shards[self.shard_of(key)], key)
        return None if raw is None else json.loads(raw)

    async def result(self, op_id: str, *, key: str | Sequence[str]) -> Any:
        """The stored outcome of op ``op_id`` on ``key`` (for a multi-key op: its list of keys):
        its value, or its error raised.

        :raises ResultNotFound: if the op has not been applied yet, or its result expired.
        :raises OperationFailed: if the op failed.
        """
        self._check_loop()
        shard = self.shard_of(key) if isinstance(key, str) else self._home(key)
        all_keys = (key,) if isinstance(key, str) else tuple(key)
        keys = ShardKeys(self.settings.namespace, shard)
        (raw,) = await self._backend.stored(keys, [op_id])
        if raw is not None and not await self._confirmed(keys):
            raise BackendUnavailable(
                self._backend.url,
                f"the result of op {op_id!r} is stored, but its durability"
                f" (durable_replicas={self.settings.durable_replicas},"
                f" durable_fsync={self.settings.durable_fsync}) was not confirmed in time"
                " (try again)",
                op_id=op_id, keys=all_keys,
            )
        if raw is None:
            raise ResultNotFound(key=all_keys[0], op_id=op_id)
        return _value_or_raise(decode_outcome(raw), keys=all_keys, op_id=op_id)

    # -- internals -----------------------------------------------------------------------------

    async def _confirmed(self, keys: ShardKeys) -> bool:
        """Whether what the shard stores now is as durable as the settings ask (always, when
        they ask nothing more than the master): a stored result is an answer only then, as a
        reply is."""
        durability = self.settings.durability
        return durability is None or await _durability.confirm(
            self._backend, keys.barrier, durability
        )

    def _withdraw(self, pending: _Pending) -> bool:
        """Take a cancelled submit out of the queue if it has not been sent (True if so)."""
        try:
            self._queue.remove(pending)
        except ValueError:
            return False
        return True

    async def _timed_out(self, pending: _Pending, timeout: float) -> SubmitTimeout:
        """The timeout error, naming the op's shards that no worker holds (the usual reason an
        op waits that long: no worker serves its namespace, or none runs at all)."""
        withdrawn = self._withdraw(pending)
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

    def _forget(self, pending: _Pending) -> None:
        waiters = self._waiting.get(pending.op_id)
        if waiters is not None:
            waiters.remove(pending)
            if not waiters:
                del self._waiting[pending.op_id]

    def _unwrap(self, pending: _Pending) -> Any:
        outcome = pending.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return _value_or_raise(outcome, keys=pending.all_keys, op_id=pending.op_id)

    def _settle(self, op_id: str, outcome: dict[str, Any] | BaseException) -> None:
        for pending in self._waiting.get(op_id, ()):
            pending.settle(outcome)

    async def _append_loop(self) -> None:
        """Append whatever has queued up while the previous append was in flight: one append
        in flight per Redis node (each master of a cluster), so a stalled node holds up the
        ops of its own shards only, and each shard's entries land in submit order."""
        while True:
            await self._queued.wait()
            self._queued = anyio.Event()
            batch, self._queue = self._queue, []
            by_node: dict[str, list[_Pending]] = defaultdict(list)
            for pending in batch:
                by_node[self._backend.node_of(self._streams[pending.shard])].append(pending)
            for node, pendings in by_node.items():
                if node in self._appending or self._task_group is None:
                    # Sent once that node's append returns (or never: the client is closing).
                    self._queue.extend(pendings)
                else:
                    self._appending.add(node)
                    self._task_group.start_soon(self._append, node, pendings)

    async def _append(self, node: str, batch: list[_Pending]) -> None:
        """Append ``batch`` (ops of shards on one node) in one pipeline."""
        try:
            entries = list(_pack(batch))
            calls = [self._append_call(shard, group) for shard, group in entries]
            try:
                replies = await self._backend.run_many(calls)
            except BackendUnavailable as exc:
                for pending in batch:
                    pending.settle(
                        BackendUnavailable(
                            self._backend.url, exc, op_id=pending.op_id, keys=pending.all_keys
                        )
                    )
                return
            except Exception as exc:  # anything else fails this batch, not the client
                log.exception("appending %d ops failed", len(batch))
                for pending in batch:
                    pending.settle(KeyserialError(f"appending op {pending.op_id!r} failed: {exc}"))
                return
            self._after_append(entries, replies)
        finally:
            self._appending.discard(node)
            if self._queue:
                self._queued.set()

    def _after_append(
        self, entries: list[tuple[int, list[_Pending]]], replies: list[Any]
    ) -> None:
        """Note each appended op's entry; fail the ops of entries the server refused, and queue
        again those refused for now."""
        refused: list[_Pending] = []
        for (shard, group), reply in zip(entries, replies, strict=True):
            if isinstance(reply, bytes):
                for pending in group:
                    pending.entry = reply
            elif isinstance(reply, BackendUnavailable):
                refused += group  # "not now" (BUSY, LOADING): nothing was appended
            elif isinstance(reply, Exception):
                error = self._append_error(shard, reply)
                for pending in group:
                    pending.settle(error)
        if refused and self._task_group is not None:
            self._task_group.start_soon(self._append_again, refused)

    async def _append_again(self, refused: list[_Pending]) -> None:
        """Queue again, a moment later, ops whose append the server refused for now; each
        waits until it is appended or its caller's timeout."""
        await anyio.sleep(_REFUSED_RETRY)
        self._requeue(refused)

    def _requeue(self, pendings: list[_Pending]) -> None:
        """Append these ops again with the next batch (those still awaited)."""
        self._queue.extend(pending for pending in pendings if not pending.done.done())
        self._queued.set()

    def _append_call(self, shard: int, group: list[_Pending]) -> ScriptCall[bytes]:
        keys = self._shards[shard]
        packed = pack_entry([pending.envelope for pending in group])
        # Fresh only if the entry cannot land twice either (a transport that retries could).
        fresh = self._backend.sends_once and all(pending.fresh for pending in group)
        return submit(keys, SubmitArgs(
            self.settings.max_backlog, WIRE_VERSION, packed, keys.wake_channel, fresh
        ))

    def _append_error(self, shard: int, reply: Exception) -> KeyserialError:
        """The error of an append the server answered with an error: nothing was appended."""
        if isinstance(reply, BacklogRefused):
            return BacklogFull(shard=shard, limit=self.settings.max_backlog)
        if isinstance(reply, KeyserialError) and not isinstance(reply, Refused):
            return reply  # the credentials or the ACL refused it
        return KeyserialError(f"Redis refused the append to shard {shard}: {reply}")

    async def _listen_for_replies(self, *, task_status: TaskStatus[None]) -> None:
        await self._backend.listen(
            [self._reply], lambda _, data: self._deliver(data),
            health_interval=self.settings.health_interval, task_status=task_status,
        )

    def _deliver(self, data: bytes) -> None:
        try:
            replies = decode_reply(data)
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed reply message: %r", data[:200])
            return
        for op_id, outcome in replies:
            self._settle(op_id, outcome)

    async def _sweep_loop(self) -> None:
        """Fetch stored results for ops whose reply is overdue (a lost pub/sub message)."""
        interval = self.settings.idle_poll
        while True:
            await anyio.sleep(interval)
            cutoff = time.monotonic() - interval
            overdue: dict[int, list[str]] = defaultdict(list)
            for op_id, waiters in self._waiting.items():
                if waiters and waiters[0].since < cutoff:
                    overdue[waiters[0].shard].append(op_id)
            failed: dict[int, Exception] = {}
            async with anyio.create_task_group() as group:
                for shard, op_ids in overdue.items():
                    group.start_soon(self._sweep_bounded, shard, op_ids, interval, failed)
            if failed:  # one line per sweep, not one per shard
                shard, error = next(iter(failed.items()))
                log.warning("looking up overdue replies of shards %s: %s",
                            ",".join(map(str, sorted(failed))), error)

    async def _sweep_bounded(
        self, shard: int, op_ids: list[str], interval: float, failed: dict[int, Exception]
    ) -> None:
        """:meth:`_sweep_shard`, given up after a few intervals (tried again at the next
        sweep): a node that stalls, or fails over meanwhile, must not hold up the sweep of the
        other shards, nor this shard's next sweep, which may reach its new master."""
        with anyio.move_on_after(max(3 * interval, 1.0)):
            try:
                await self._sweep_shard(ShardKeys(self.settings.namespace, shard), op_ids)
            except (BackendUnavailable, Refused) as exc:
                failed[shard] = exc

    async def _sweep_shard(self, keys: ShardKeys, op_ids: list[str]) -> None:
        """Settle overdue ops whose outcome is stored. Append again those whose entry is gone
        with no outcome: a failover lost it (the op id makes a second append harmless: an op
        that did commit meanwhile is answered from its stored outcome, never run again)."""
        unsettled = await self._settle_stored(keys, op_ids)
        if unsettled is None:
            return
        unanswered = [
            waiters[0] for op_id in unsettled
            if (waiters := self._waiting.get(op_id)) and waiters[0].entry is not None
        ]
        if not unanswered:
            return
        present = await self._backend.entries_present(keys, [p.entry or b"" for p in unanswered])
        gone = {p.op_id: p for p, there in zip(unanswered, present, strict=True) if not there}
        if not gone:
            return
        # Looked up again: the op may have committed, and its entry left the stream, between
        # the first lookup and the check above (an entry leaves only after its outcome is
        # stored, so gone with no outcome now means lost).
        still = await self._settle_stored(keys, list(gone))
        lost = [gone[op_id] for op_id in still or ()]
        for pending in lost:
            log.warning("op %s: its entry %s is gone with no outcome (a failover?); appending"
                        " it again", pending.op_id, (pending.entry or b"").decode())
            pending.entry, pending.fresh = None, False
        if lost:
            self._requeue(lost)

    async def _settle_stored(self, keys: ShardKeys, op_ids: list[str]) -> list[str] | None:
        """Settle the ops whose outcome the shard stores; the op ids left. None: some outcome
        is stored but not confirmed as durable yet (the next sweep looks again)."""
        found = await self._backend.stored(keys, op_ids)
        if any(raw is not None for raw in found) and not await self._confirmed(keys):
            return None
        left = []
        for op_id, raw in zip(op_ids, found, strict=True):
            if raw is None:
                left.append(op_id)
            else:
                self._settle(op_id, decode_outcome(raw))
        return left


def _pack(batch: list[_Pending]) -> Iterator[tuple[int, list[_Pending]]]:
    """Group a batch by shard, in submit order, into entries of bounded size."""
    by_shard: dict[int, list[_Pending]] = defaultdict(list)
    for pending in batch:
        by_shard[pending.shard].append(pending)
    for shard, group in by_shard.items():
        entry: list[_Pending] = []
        size = 0
        for pending in group:
            if entry and (len(entry) >= _ENTRY_OPS or size + len(pending.envelope) > _ENTRY_BYTES):
                yield shard, entry
                entry, size = [], 0
            entry.append(pending)
            size += len(pending.envelope)
        yield shard, entry


def _closed_while_waiting(pending: _Pending, *, sent: bool) -> KeyserialError:
    op_id = pending.op_id
    if not sent:
        return KeyserialError(
            f"the client was closed before op {op_id!r} was sent; it was never appended"
        )
    keys = pending.all_keys
    where = repr(keys[0]) if len(keys) == 1 else repr(list(keys))
    return KeyserialError(
        f"the client was closed while op {op_id!r} waited for its outcome; it may still apply."
        f" Fetch its outcome on an open client with `await ks.result({op_id!r}, key={where})`,"
        f" or resubmit with op_id={op_id!r} (it never runs twice)."
    )


def _value_or_raise(outcome: dict[str, Any], *, keys: tuple[str, ...], op_id: str) -> Any:
    if "error" in outcome:
        raise OperationFailed.from_wire(outcome["error"], key=keys[0], op_id=op_id, keys=keys)
    return outcome["ok"]
