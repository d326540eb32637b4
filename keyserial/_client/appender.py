"""The client's appends: submits that arrive while an append is in flight are coalesced
(``_backend.batching``: one append in flight per Redis node). Ops bound for one shard are packed
into one stream entry (bounded in ops and bytes), and a node's entries go out in one pipeline of
``submit`` calls: a stalled node holds up the ops of its own shards only, and each shard's entries
land in submit order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .._backend.backend import Backend
from .._backend.batching import NodeBatcher
from .._backend.durability import run_confirmed
from .._scripts.refusals import BacklogRefused, Refused, ShardSealed
from .._scripts.submit import Pushed, SubmitArgs
from .._settings import Settings
from .._wire.codec import WIRE_VERSION, pack_entry
from .._wire.layout import ShardKeys
from ..errors import BackendUnavailable, BacklogFull, KeyserialError
from .pending import Pending

log = logging.getLogger("keyserial.client")

#: Seconds before an append the server refused for now (BUSY, LOADING) is sent again.
_REFUSED_RETRY = 0.1
#: Ops packed into one stream entry at most, and its size in bytes at most.
_ENTRY_OPS = 256
_ENTRY_BYTES = 256 * 1024


class Appender:
    """Appends the submits queued with :meth:`add`; :meth:`run` in a task of the client's."""

    def __init__(
        self, backend: Backend, settings: Settings, reroute: Callable[[list[Pending]], None]
    ) -> None:
        self._backend = backend
        self._settings = settings
        #: Takes the ops of entries refused because a reshard sealed their shard.
        self._reroute = reroute
        self._batcher: NodeBatcher[Pending] = NodeBatcher(backend, self._append)
        self._task_group: TaskGroup | None = None
        #: Set when the client closes: nothing more is sent.
        self._stopped = False
        #: Batches taken for sending once stopped: never sent.
        self._unsent: list[Pending] = []

    def add(self, pending: Pending) -> None:
        self._batcher.add(pending.shard.stream, pending)

    def withdraw(self, pending: Pending) -> bool:
        """Take a submit out of the queue if it has not been sent (True if so)."""
        return self._batcher.withdraw(pending)

    def requeue(self, pendings: list[Pending]) -> None:
        """Append these ops again with the next batch (those settled meanwhile stay out)."""
        for pending in pendings:
            self.add(pending)

    def stop(self) -> None:
        """Send nothing more (the client is closing; :meth:`run` is cancelled next)."""
        self._stopped = True

    def take_unsent(self) -> set[Pending]:
        """Empty the queue, once stopped: the submits never sent."""
        unsent, self._unsent = {*self._unsent, *self._batcher.take_unsent()}, []
        return unsent

    async def run(self) -> None:
        """Append whatever has queued up while the previous append to the same node was in
        flight, until cancelled."""
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            await self._batcher.serve()

    async def _append(self, queued: list[Pending]) -> None:
        """Append ``queued`` (ops of shards on one node) in one pipeline."""
        if self._stopped:
            self._unsent += queued
            return
        # A submit whose caller was cancelled (or that timed out) before the append is sent
        # stays out: a cancel scope whose deadline had passed when its caller submitted
        # cancels the caller's future before this task runs.
        batch = [pending for pending in queued if not pending.done.done()]
        if not batch:
            return
        entries = list(_pack(batch))
        # An enqueue's answer is the append itself: with durable_replicas, replicas confirm it
        # first (an awaited submit's client appends again an entry a failover lost).
        durability = self._settings.durability
        if not any([pending.appended_only for pending in batch]):
            durability = None
        calls = self._backend.append_calls(
            [(shard, self._entry(shard, group)) for shard, group in entries]
        )
        try:
            if durability is None:
                replies, confirmed = await self._backend.run_many(calls), True
            else:  # (a WAIT behind the appends, on their connection: they live on one node)
                replies, confirmed = await run_confirmed(self._backend, calls, durability)
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
        self._after_append(entries, replies, confirmed)

    def _after_append(
        self,
        entries: list[tuple[ShardKeys, list[Pending]]],
        replies: list[Any],
        confirmed: bool = True,
    ) -> None:
        """Note each appended op's entry (an enqueue's only if replicas ``confirmed`` it, as
        ``durable_replicas`` asks); fail the ops of entries the server refused, and queue again
        those refused for now."""
        refused: list[Pending] = []
        sealed: list[Pending] = []
        for (shard, group), reply in zip(entries, replies, strict=True):
            if isinstance(reply, Pushed):
                self._appended(group, reply, confirmed)
            elif isinstance(reply, BackendUnavailable):
                refused += group  # "not now" (BUSY, LOADING): nothing was appended
            elif isinstance(reply, ShardSealed):
                sealed += group  # resharded: nothing was appended
            elif isinstance(reply, Exception):
                error = self._append_error(shard, reply)
                for pending in group:
                    pending.settle(error)
        if refused and self._task_group is not None and not self._stopped:
            self._task_group.start_soon(self._append_again, refused)
        if sealed and not self._stopped:
            self._reroute(sealed)

    async def _append_again(self, refused: list[Pending]) -> None:
        """Queue again, a moment later, ops whose append the server refused for now; each
        waits until it is appended or its caller's timeout."""
        await anyio.sleep(_REFUSED_RETRY)
        self.requeue(refused)

    def _entry(self, keys: ShardKeys, group: list[Pending]) -> SubmitArgs:
        packed = pack_entry([pending.envelope for pending in group])
        # (A list, made in one call: a generator here would be resumed once per op.)
        fresh = all([pending.fresh for pending in group])
        wake = keys.wake(self._backend.sharded_pubsub)
        return SubmitArgs(
            self._settings.max_backlog, WIRE_VERSION, packed, wake, fresh, group[0].due
        )

    def _appended(self, group: list[Pending], entry: Pushed, confirmed: bool) -> None:
        for pending in group:
            if pending.appended_only and not confirmed:
                pending.settle(self._unconfirmed(pending))
            else:
                pending.appended(entry)

    def _unconfirmed(self, pending: Pending) -> BackendUnavailable:
        """What an enqueue whose append its replicas did not confirm in time fails with: it
        may have been appended (and a failover may lose it)."""
        settings = self._settings
        return BackendUnavailable(
            self._backend.url,
            f"op {pending.op_id!r} was appended, but its durability (durable_replicas="
            f"{settings.durable_replicas}, durable_fsync={settings.durable_fsync}) was not"
            " confirmed in time: enqueue it again under the same op_id (it never runs twice)",
            op_id=pending.op_id,
            keys=pending.all_keys,
        )

    def _append_error(self, keys: ShardKeys, reply: Exception) -> KeyserialError:
        """The error of an append the server answered with an error: nothing was appended."""
        if isinstance(reply, BacklogRefused):
            return BacklogFull(shard=keys.shard, limit=self._settings.max_backlog)
        if isinstance(reply, KeyserialError) and not isinstance(reply, Refused):
            return reply  # the credentials or the ACL refused it
        return KeyserialError(f"Redis refused the append to shard {keys.shard}: {reply}")


def _pack(batch: list[Pending]) -> Iterator[tuple[ShardKeys, list[Pending]]]:
    """Group a batch by shard (and due time), in submit order, into entries of bounded size."""
    # (By the shard's hash tag, which names it as its keys do: a string's hash is kept, where
    # the dataclass's is computed in Python at every lookup.)
    by_shard: dict[str, tuple[ShardKeys, list[Pending]]] = {}
    for pending in batch:
        shard = pending.shard
        packing = shard.tag if not pending.due else f"{shard.tag} {pending.due}"
        if (found := by_shard.get(packing)) is None:
            by_shard[packing] = (shard, [pending])
        else:
            found[1].append(pending)
    for shard, group in by_shard.values():
        entry: list[Pending] = []
        size = 0
        for pending in group:
            if entry and (len(entry) >= _ENTRY_OPS or size + len(pending.envelope) > _ENTRY_BYTES):
                yield shard, entry
                entry, size = [], 0
            entry.append(pending)
            size += len(pending.envelope)
        yield shard, entry
