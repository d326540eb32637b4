"""Coalesce script calls from many shard runners into one pipeline per round trip.

A worker serving 16 shards under spread-out load would otherwise pay one round trip (and
the per-call overhead) per shard step; batched, the steps of every ready shard go out
together. Each call is routed by its keys, so this is cluster-safe: on a cluster the pipeline
is split per node.

Replies travel the same way. A call may carry the replies of the ops it commits, published only
if it succeeds (the output gate). When several calls of a batch carry replies, on a backend whose
commands reach the server in the order sent (keyserial's own connection), they go out after the
batch, one message per client channel for the whole batch (not one per shard step: a Redis
command each, and a message for the client to parse). Otherwise, and for a call that carries
the batch's only replies (low load, where the extra hop would cost latency and save nothing),
the script publishes them itself: they go in its ``replies`` argument (``ScriptCall.with_arg``).

With ``durable_replicas`` (see :class:`Durability`), replies go out only once that many replicas
have the batch's writes (a WAIT behind them, on the same connection), never from a script: a
reply is an acknowledgement, and one sent before the replicas have the commit could be lost with
the master. A batch that is not confirmed in time sends no reply, and breaks the
:class:`Lineage` of every shard owner whose writes it carried: the owner caches what those
writes did, which a failover may have lost, so none of its later writes may go out. The owner
gives its shard up; the next one starts from what Redis has, and clients find the results with
their sweep, which confirms them the same way.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._backend import durability as _durability
from .._backend.backend import Backend
from .._backoff import Backoff
from .._scripts.calls import REPLIES, ScriptCall
from .._settings import Durability
from .._wire.codec import encode_reply
from .._wire.json_text import dumps
from .._wire.signing import ReplySigner
from ..errors import BackendUnavailable

log = logging.getLogger("keyserial.worker")


R = TypeVar("R")

#: Outcomes to reply once a call has committed them: channel -> [(op id, outcome JSON)].
Replies = Mapping[str, Sequence[tuple[str, str]]]


def _ignore(calls: int) -> None:
    """The ``on_batch`` hook of a pipeliner without metrics."""


@dataclass(slots=True, eq=False)
class Lineage:
    """The writes of one shard owner, each built on those before it (the owner caches what they
    wrote). Broken once its cache may not be what Redis has: a pipeline that carried a write
    that commits states or results is not confirmed as durable (a failover may have lost that
    write while the cache keeps it), a pushed entry is not in the stream as pushed, or a commit
    across shards went out and its coordinator stopped before learning whether it landed. No
    later call of the lineage goes out (each fails with :class:`LineageBroken`)."""

    broken: bool = False


class LineageBroken(Exception):
    """A write not sent: its owner's :class:`Lineage` is broken (the owner must give its shard
    up, cleanly: the unfinished ops are not to blame)."""


class _Batch:
    """Calls that go out in one pipeline; one event wakes all their callers."""

    __slots__ = (
        "builds",
        "callbacks",
        "calls",
        "confirmed",
        "done",
        "lineages",
        "replies",
        "results",
    )

    def __init__(self) -> None:
        self.calls: list[ScriptCall[Any]] = []
        self.replies: list[Replies | None] = []
        #: Called with the call's reply (or its error) once the batch is back; None: awaited.
        self.callbacks: list[Callable[[Any], None] | None] = []
        #: The lineages each call's writes belong to (none: it builds on no cached state).
        self.lineages: list[Sequence[Lineage]] = []
        #: Whether each call commits what its lineages build on (breaks them unconfirmed).
        self.builds: list[bool] = []
        self.done = anyio.Event()
        self.results: list[Any] = []
        #: Whether the replicas the durability asks for have the batch's writes.
        self.confirmed = False


class Pipeliner:
    """Runs :class:`ScriptCall` s in pipelines: one :class:`_NodePipeliner` per Redis server
    (each master of a cluster), so a stalled node delays the shards it serves and no others.
    Start :meth:`serve` in a task group."""

    def __init__(
        self,
        backend: Backend,
        durability: Durability | None = None,
        signer: ReplySigner | None = None,
        on_batch: Callable[[int], None] = _ignore,
    ) -> None:
        self._backend = backend
        self._durability = durability
        #: Signs the reply messages of the calls it runs (none: they go out unsigned).
        self.signer = signer
        #: Told how many calls each pipeline sends (the worker's metrics).
        self._on_batch = on_batch
        self._by_node: dict[str, _NodePipeliner] = {}
        self._task_group: TaskGroup | None = None

    async def serve(self) -> None:
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            for pipeliner in self._by_node.values():
                task_group.start_soon(pipeliner.serve)
            await anyio.sleep_forever()

    async def run(
        self,
        call: ScriptCall[R],
        replies: Replies | None = None,
        lineages: Sequence[Lineage] = (),
        *,
        builds: bool = True,
    ) -> R:
        """See :meth:`_NodePipeliner.run`."""
        result, _ = await self._of(call).run(call, replies, lineages, builds=builds)
        return result

    async def run_durably(self, call: ScriptCall[R], lineages: Sequence[Lineage] = ()) -> R:
        """Like :meth:`run`, for an idempotent call whose reply must outlive a failover before
        anything acts on it (a cross-shard grant or decision): it is sent again, each time to
        the node that serves its keys now, until a pipeline that carries it is confirmed by its
        own WAIT (on the connection that ran it). Without durability, the first reply."""
        backoff = Backoff(0.05, 1.0)
        while True:
            result, confirmed = await self._of(call).run(call, None, lineages, builds=True)
            if confirmed:
                return result
            assert self._durability is not None  # (without it every pipeline is confirmed)
            log.warning(
                "%s not confirmed (%s); sending it again",
                call.script.name,
                _describe(self._durability),
            )
            await backoff.sleep()

    def submit(
        self,
        call: ScriptCall[Any],
        replies: Replies | None,
        on_done: Callable[[Any], None],
        lineages: Sequence[Lineage] = (),
    ) -> None:
        """See :meth:`_NodePipeliner.submit`."""
        self._of(call).submit(call, replies, on_done, lineages, builds=True)

    def _of(self, call: ScriptCall[Any]) -> _NodePipeliner:
        """The pipeliner of the node that serves the call's keys (as the client knows now)."""
        node = self._backend.node_of(call.keys[0])
        pipeliner = self._by_node.get(node)
        if pipeliner is None:
            pipeliner = self._by_node[node] = _NodePipeliner(
                self._backend, self._durability, self.signer, self._on_batch
            )
            if self._task_group is not None:
                self._task_group.start_soon(pipeliner.serve)
        return pipeliner


class _NodePipeliner:
    """Runs :class:`ScriptCall` s in pipelines, one in flight at a time; calls that arrive while
    it is in flight go out together in the next. (Two in flight measured slower: smaller batches,
    more CPU per op.)"""

    def __init__(
        self,
        backend: Backend,
        durability: Durability | None = None,
        signer: ReplySigner | None = None,
        on_batch: Callable[[int], None] = _ignore,
    ) -> None:
        self._backend = backend
        self._durability = durability
        self._signer = signer
        self._next = _Batch()
        self._queued = anyio.Event()
        #: Told how many calls each pipeline sends (the worker's metrics).
        self._on_batch = on_batch

    async def run(
        self,
        call: ScriptCall[R],
        replies: Replies | None = None,
        lineages: Sequence[Lineage] = (),
        *,
        builds: bool,
    ) -> tuple[R, bool]:
        """The script's reply, as the call decodes it, and whether its pipeline's writes are
        as durable as the settings ask (always, when they ask nothing). ``replies`` are
        published once the call has succeeded (never after a refusal: a fenced step committed
        nothing): by the script itself, given them as JSON ``[[channel, message], ...]`` in its
        ``replies`` argument, or with the batch. ``lineages``: the owners whose cached writes
        the call builds on (see :class:`Lineage`); ``builds``: it commits states or results,
        so it breaks them if its pipeline is not confirmed.

        :raises Refused: the script's refusal (``Fenced``, …).
        :raises LineageBroken: if one of ``lineages`` is broken (the call was not sent).
        :raises BackendUnavailable: if the server does not answer.
        """
        batch = self._next
        index = len(batch.calls)
        self._add(call, replies, None, lineages, builds)
        await batch.done.wait()
        result = batch.results[index]
        if isinstance(result, Exception):
            raise result
        reply: R = result
        return reply, batch.confirmed

    def submit(
        self,
        call: ScriptCall[Any],
        replies: Replies | None,
        on_done: Callable[[Any], None],
        lineages: Sequence[Lineage] = (),
        *,
        builds: bool,
    ) -> None:
        """Like :meth:`run`, without a task to await it: ``on_done`` gets the script's reply,
        or the error :meth:`run` would raise, once the batch is back (before the awaiting
        callers of that batch wake)."""
        self._add(call, replies, on_done, lineages, builds)

    def _add(
        self,
        call: ScriptCall[Any],
        replies: Replies | None,
        on_done: Callable[[Any], None] | None,
        lineages: Sequence[Lineage],
        builds: bool,
    ) -> None:
        if replies and not self._backend.in_order and self._durability is None:
            assert call.script.publishes, f"{call.script.name} cannot publish replies itself"
            call, replies = _inline(call, replies, self._signer), None
        batch = self._next
        batch.calls.append(call)
        batch.replies.append(replies or None)
        batch.callbacks.append(on_done)
        batch.lineages.append(lineages)
        batch.builds.append(builds)
        self._queued.set()

    async def serve(self) -> None:
        while True:
            await self._queued.wait()
            self._queued = anyio.Event()
            batch, self._next = self._next, _Batch()
            self._on_batch(len(batch.calls))
            carrying = [i for i, replies in enumerate(batch.replies) if replies]
            if (
                len(carrying) == 1
                and batch.calls[carrying[0]].script.publishes
                and self._durability is None
            ):
                i = carrying[0]
                replies = batch.replies[i]
                assert replies is not None
                batch.calls[i], batch.replies[i] = (
                    _inline(batch.calls[i], replies, self._signer),
                    None,
                )
            await self._send(batch)
            # Written before the runners wake, so before anything they send next on the one
            # connection (a later commit's replies cannot overtake these), and not waited for.
            messages = self._messages(batch) if batch.confirmed else []
            if messages and not self._backend.publish_nowait(messages):
                if self._backend.in_order:
                    # The connection closed since the batch returned. A reply is at most once
                    # anyway: the result is stored, and clients look up overdue ones.
                    log.warning("connection lost: %d reply messages not sent", len(messages))
                else:
                    await self._publish(messages)
            for on_done, result in zip(batch.callbacks, batch.results, strict=True):
                if on_done is not None:
                    on_done(result)
            batch.done.set()

    async def _send(self, batch: _Batch) -> None:
        """Send the batch's calls, but those of a broken lineage: each gets its reply (or
        error) in ``batch.results``, and ``batch.confirmed`` says whether the replicas the
        durability asks for have their writes. If they do not, every lineage in the batch
        breaks (before anyone wakes, so before any later write of theirs is queued)."""
        sent = [
            index
            for index, lineages in enumerate(batch.lineages)
            if not any(lineage.broken for lineage in lineages)
        ]
        if len(sent) == len(batch.calls) and self._durability is None:
            batch.results, batch.confirmed = await self._run_or_fail(batch.calls)
            return
        batch.results = [
            LineageBroken("an earlier write of this owner may not be in Redis as its cache has it")
            for _ in batch.calls
        ]
        if not sent:
            return
        results, batch.confirmed = await self._run_or_fail([batch.calls[i] for i in sent])
        for index, result in zip(sent, results, strict=True):
            batch.results[index] = result
        if not batch.confirmed and self._durability is not None:
            self._break(batch, sent, results)

    async def _run_or_fail(self, calls: Sequence[ScriptCall[Any]]) -> tuple[list[Any], bool]:
        """:meth:`_run`, or the error that kept it from running, as every call's result."""
        try:
            return await self._run(calls)
        except BackendUnavailable as exc:
            return [exc] * len(calls), False
        except Exception as exc:
            # A defect, not an outage (a call that cannot be sent at all): it fails the calls
            # of this batch, whose runners stop, never the worker's other shards.
            log.error("a pipeline of %d calls failed", len(calls), exc_info=exc)
            return [exc] * len(calls), False

    def _break(self, batch: _Batch, sent: list[int], results: list[Any]) -> None:
        """An unconfirmed batch: the lineages of the calls that committed what they build on
        break. (A call that failed wrote nothing; one whose server did not answer is sent
        again by its runner, the same call, until the runner knows what became of it.)"""
        assert self._durability is not None
        committed = [
            index
            for index, result in zip(sent, results, strict=True)
            if batch.builds[index] and batch.lineages[index] and not isinstance(result, Exception)
        ]
        if not committed:
            return
        log.warning(
            "%d writes not confirmed (%s) in %d ms: not replied to, and their shards"
            " are given up to be taken over again",
            len(committed),
            _describe(self._durability),
            self._durability.wait_ms,
        )
        for index in committed:
            for lineage in batch.lineages[index]:
                lineage.broken = True

    async def _run(self, calls: Sequence[ScriptCall[Any]]) -> tuple[list[Any], bool]:
        """The calls' replies, and whether the replicas the durability asks for have them."""
        if self._durability is None:
            return await self._backend.run_many(calls), True
        return await _durability.run_confirmed(self._backend, calls, self._durability)

    async def _publish(self, messages: list[tuple[str, str]]) -> None:
        """PUBLISH on a backend without keyserial's own connection (with durability only:
        otherwise the scripts publish)."""
        try:
            for channel, message in messages:
                await self._backend.publish(channel, message)
        except BackendUnavailable as exc:
            log.warning("%d reply messages not sent: %s", len(messages), exc)

    def _messages(self, batch: _Batch) -> list[tuple[str, str]]:
        """One reply message per channel, for the calls that succeeded."""
        merged: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)
        for replies, result in zip(batch.replies, batch.results, strict=True):
            if replies and not isinstance(result, Exception):
                for channel, outcomes in replies.items():
                    merged[channel].extend(outcomes)
        return reply_messages(merged, self._signer)


def _inline(call: ScriptCall[R], replies: Replies, signer: ReplySigner | None) -> ScriptCall[R]:
    """``call`` with its replies in its arguments, for the script to publish."""
    return call.with_arg(REPLIES, dumps(reply_messages(replies, signer)))


def reply_messages(replies: Replies, signer: ReplySigner | None) -> list[tuple[str, str]]:
    """``(channel, reply message)`` for each channel, signed by ``signer`` if there is one."""
    if signer is None:
        return [(channel, encode_reply(outcomes)) for channel, outcomes in replies.items()]
    return [
        (channel, signer.sign(channel, encode_reply(outcomes)))
        for channel, outcomes in replies.items()
    ]


def _describe(durability: Durability) -> str:
    wanted = f"{durability.replicas} replicas"
    return f"{wanted}, AOF written" if durability.fsync else wanted
