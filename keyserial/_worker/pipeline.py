"""Coalesce script calls from many shard runners into one pipeline per round trip.

A worker serving 16 shards under spread-out load would otherwise pay one round trip (and
the per-call overhead) per shard step; batched, the steps of every ready shard go out
together. Each call is routed by its keys, so this is cluster-safe: on a cluster the pipeline
is split per node.

Replies travel the same way. A call may carry the replies of the ops it commits, published only
if it succeeds (the output gate), before anything its runner sends next
(``_backend.durability.run_publishing``). Where several calls of a batch carry replies, they go
out after the batch, one message per client channel for the whole batch (not one per shard step:
a Redis command each, and a message for the client to parse), or each script publishes its own
where publishing after the batch would cost a round trip; a call that carries the batch's only
replies (low load, where the extra hop would cost latency and save nothing) publishes them
itself too.

With ``durable_replicas`` (see :class:`Durability`), replies go out only once that many replicas
have the batch's writes (a WAIT behind them, on the same connection), never from a script: a
reply is an acknowledgement, and one sent before the replicas have the commit could be lost with
the master. A batch that is not confirmed in time sends no reply, and breaks the
:class:`WriteChain` of every shard owner whose writes it carried: the owner caches what those
writes did, which a failover may have lost, so none of its later writes may go out. The owner
gives its shard up; the next one starts from what Redis has, and clients find the results with
their sweep, which confirms them the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

import anyio

from .._backend import durability as _durability
from .._backend.backend import Backend
from .._backend.batching import NodeBatcher
from .._backend.commands import publish_command
from .._backoff import Backoff
from .._scripts.calls import ScriptCall
from .._settings import Durability
from .._wire.codec import encode_reply
from .._wire.messages import batch
from .._wire.signing import ReplySigner
from ..errors import BackendUnavailable
from .writes import Replies, WriteChain, WriteChainBroken

log = logging.getLogger("keyserial.worker")


R = TypeVar("R")


_broken = attrgetter("broken")


def _ignore(calls: int) -> None:
    """The ``on_batch`` hook of a pipeliner without metrics."""


@dataclass(slots=True, eq=False)
class _Call:
    """A script call queued for the next pipeline of its node, until its reply."""

    call: ScriptCall[Any]
    #: What to publish once it has succeeded (None: nothing).
    replies: Replies | None
    #: Coordination messages (cross-shard records'), published with ``replies``: signed and
    #: batched per channel here.
    messages: Sequence[tuple[str, str]]
    #: The write chains its writes belong to (none: it builds on no cached state).
    write_chains: Sequence[WriteChain]
    #: Whether it commits what its write chains build on (breaks them unconfirmed).
    builds: bool
    #: Resolved once the batch is back, for the caller that awaits it.
    done: asyncio.Future[None]
    result: Any = None
    #: Whether the replicas the durability asks for have its batch's writes.
    confirmed: bool = False


class Pipeliner:
    """Runs :class:`ScriptCall` s in pipelines, one in flight per Redis server (each master of
    a cluster): calls that arrive while it is in flight go out together in the next (see
    ``_backend.batching``). Start :meth:`serve` in a task group."""

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
        self._batcher: NodeBatcher[_Call] = NodeBatcher(backend, self._send_batch)
        #: The event loop the calls are awaited on (asked once: asking asyncio costs a system
        #: call, on a path every step takes).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Coordination messages that wait for no commit (grant requests), for the next round.
        self._outbox: list[tuple[str, str]] = []
        self._outbox_filled = anyio.Event()

    async def serve(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._send_outbox)
            await self._batcher.serve()

    def publish(self, channel: str, message: str) -> None:
        """Publish a coordination message that waits for no commit (a grant request), with the
        others queued meanwhile: what this worker owes each channel goes in one message, signed
        once for it (see :func:`coordination_messages`)."""
        if not self._outbox:
            self._outbox_filled.set()
        self._outbox.append((channel, message))

    async def _send_outbox(self) -> None:
        while True:
            await self._outbox_filled.wait()
            self._outbox_filled = anyio.Event()
            outbox, self._outbox = self._outbox, []
            commands = [
                publish_command(channel, message)
                for channel, message in coordination_messages(outbox, self.signer)
            ]
            try:  # (what queues meanwhile goes in the next batch)
                await self._backend.pipeline(commands)
            except BackendUnavailable as exc:  # (a message lost costs its waiter a poll)
                log.warning("%d coordination messages not published: %s", len(commands), exc)

    async def run(
        self,
        call: ScriptCall[R],
        replies: Replies | None = None,
        write_chains: Sequence[WriteChain] = (),
        *,
        builds: bool = True,
        messages: Sequence[tuple[str, str]] = (),
    ) -> R:
        """The script's reply, as the call decodes it. ``replies`` (and ``messages``, built
        already) are published once the call has succeeded (never after a refusal: a fenced
        step committed nothing): by the script itself, given them as JSON
        ``[[channel, message], ...]`` in its ``replies`` argument, or with the batch.
        ``write_chains``: the owners whose cached writes the call builds on (see
        :class:`WriteChain`); ``builds``: it commits states or results, so it breaks them if its
        pipeline is not confirmed.

        :raises Refused: the script's refusal (``Fenced``, …).
        :raises WriteChainBroken: if one of ``write_chains`` is broken (the call was not sent).
        :raises BackendUnavailable: if the server does not answer.
        """
        result, _ = await self._run(call, replies, write_chains, builds=builds, messages=messages)
        return result

    async def run_durably(self, call: ScriptCall[R], write_chains: Sequence[WriteChain] = ()) -> R:
        """Like :meth:`run`, for an idempotent call whose reply must outlive a failover before
        anything acts on it (a cross-shard grant or decision): it is sent again, each time to
        the node that serves its keys now, until a pipeline that carries it is confirmed by its
        own WAIT (on the connection that ran it). Without durability, the first reply."""
        backoff = Backoff(0.05, 1.0)
        while True:
            result, confirmed = await self._run(call, None, write_chains, builds=True)
            if confirmed:
                return result
            assert self._durability is not None  # (without it every pipeline is confirmed)
            log.warning(
                "%s not confirmed (%s); sending it again",
                call.script.name,
                _describe(self._durability),
            )
            await backoff.sleep()

    async def _run(
        self,
        call: ScriptCall[R],
        replies: Replies | None,
        write_chains: Sequence[WriteChain],
        *,
        builds: bool,
        messages: Sequence[tuple[str, str]] = (),
    ) -> tuple[R, bool]:
        """:meth:`run`'s reply, and whether its pipeline's writes are as durable as the
        settings ask (always, when they ask nothing)."""
        # (A bare asyncio future, not an event: a fraction of the cost, on a path every step
        # takes; the worker runs on asyncio, whose protocols its connections are.)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        done = loop.create_future()
        queued = _Call(call, replies, messages, write_chains, builds, done)
        self._add(queued)
        await done
        if isinstance(queued.result, Exception):
            raise queued.result
        reply: R = queued.result
        return reply, queued.confirmed

    def _add(self, queued: _Call) -> None:
        self._batcher.add(queued.call.keys[0], queued)

    async def _send_batch(self, batch: list[_Call]) -> None:
        """Send one node's batch, publish the replies of what committed (before the runners
        wake, so before anything they send next: a later commit's replies cannot overtake
        these), and tell each caller."""
        self._on_batch(len(batch))
        confirmed = await self._send(batch)
        for queued in batch:
            queued.confirmed = confirmed
            if not queued.done.done():  # (done: its caller left)
                queued.done.set_result(None)

    async def _send(self, batch: list[_Call]) -> bool:
        """Send the batch's calls, but those of a broken write_chain: each gets its reply (or
        error) as its ``result``; True if the replicas the durability asks for have their
        writes. If they do not, every write chain in the batch breaks (before anyone wakes, so
        before any later write of theirs is queued)."""
        # (map, not a generator: every step's path.)
        sent = [queued for queued in batch if not any(map(_broken, queued.write_chains))]
        if len(sent) < len(batch):
            broken = WriteChainBroken(
                "an earlier write of this owner may not be in Redis as its cache has it"
            )
            for queued in batch:
                queued.result = broken
        if not sent:
            return False
        results, confirmed = await self._run_or_fail(sent)
        for queued, result in zip(sent, results, strict=True):
            queued.result = result
        if not confirmed and self._durability is not None:
            self._break(sent)
        return confirmed

    async def _run_or_fail(self, sent: list[_Call]) -> tuple[list[Any], bool]:
        """The calls' replies, and whether the replicas the durability asks for have them;
        their replies and messages published (``_backend.durability.run_publishing``). Or the
        error that kept them from running, as every call's result."""
        try:
            return await _durability.run_publishing(
                self._backend,
                [queued.call for queued in sent],
                [queued if _publishes(queued) else None for queued in sent],
                self._messages,
                self._durability,
            )
        except BackendUnavailable as exc:
            return [exc] * len(sent), False
        except Exception as exc:
            # A defect, not an outage (a call that cannot be sent at all): it fails the calls
            # of this batch, whose runners stop, never the worker's other shards.
            log.error("a pipeline of %d calls failed", len(sent), exc_info=exc)
            return [exc] * len(sent), False

    def _break(self, sent: list[_Call]) -> None:
        """An unconfirmed batch: the write chains of the calls that committed what they build on
        break. (A call that failed wrote nothing; one whose server did not answer is sent
        again by its runner, the same call, until the runner knows what became of it.)"""
        assert self._durability is not None
        committed = [
            queued
            for queued in sent
            if queued.builds and queued.write_chains and not isinstance(queued.result, Exception)
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
        for queued in committed:
            for write_chain in queued.write_chains:
                write_chain.broken = True

    def _messages(self, calls: Sequence[_Call]) -> list[tuple[str, str]]:
        """One reply message per channel, and one coordination message per channel, for
        ``calls`` (that succeeded)."""
        merged: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)
        built: list[tuple[str, str]] = []
        for queued in calls:
            for channel, outcomes in (queued.replies or {}).items():
                merged[channel].extend(outcomes)
            built += queued.messages
        return reply_messages(merged, self.signer) + coordination_messages(built, self.signer)


def _publishes(queued: _Call) -> bool:
    """Whether ``queued`` has something to publish once it has succeeded."""
    return bool(queued.replies or queued.messages)


def reply_messages(replies: Replies, signer: ReplySigner | None) -> list[tuple[str, str]]:
    """``(channel, reply message)`` for each channel, signed by ``signer`` if there is one."""
    if signer is None:
        return [(channel, encode_reply(outcomes)) for channel, outcomes in replies.items()]
    return [
        (channel, signer.sign(channel, encode_reply(outcomes)))
        for channel, outcomes in replies.items()
    ]


def coordination_messages(
    messages: Sequence[tuple[str, str]], signer: ReplySigner | None
) -> list[tuple[str, str]]:
    """``(channel, message)``: the items for each channel in one message (``_wire.messages.
    batch``), signed for that channel's worker by ``signer`` if there is one. A worker that
    owes another several grants and decision notices in one pipeline sends it one message:
    one PUBLISH, one signature, one message to read."""
    by_channel: defaultdict[str, list[str]] = defaultdict(list)
    for channel, message in messages:
        by_channel[channel].append(message)
    merged = [(channel, batch(items)) for channel, items in by_channel.items()]
    if signer is None:
        return merged
    return [(channel, signer.sign(channel, message)) for channel, message in merged]


def _describe(durability: Durability) -> str:
    wanted = f"{durability.replicas} replicas"
    return f"{wanted}, AOF written" if durability.fsync else wanted
