"""A worker's channel for coordination messages: grant requests to the shards it owns, grants to
the ops it coordinates, decisions to the grants it holds.

A grant request is taken only from a message that another worker signed for this channel (or
from this worker itself, in process): it holds keys, and only a worker may ask for that.

Anyone who may publish on the channel could have sent a message that comes through Redis, so an
unsigned one is a hint, never an authority: it only wakes whoever waits for what it names, and
the waiter reads the fenced record in Redis (the recorded grant, the decision record) and acts
on that alone. A message that another worker signed for this channel (as a worker signs a
client's reply, ``_wire.signing``) is as good as its record: the sending worker publishes it
only from the fenced script that wrote the record, or after that script, so it is taken as it
is and saves the waiter the read. A message nobody waits for is dropped, and every waiter also
polls the records, so a lost, forged or replayed message costs a read, never a write. A message
this worker hands itself, in process, is taken as it is too.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

from ..._backend.signers import SignersMet
from ..._wire.layout import Layout
from ..._wire.messages import (
    DecisionNotice,
    GrantRequest,
    KeyGrant,
    MalformedMessage,
    messages_from_wire,
)
from ..._wire.signing import ReplyVerifier, without_signature

if TYPE_CHECKING:
    from ..._wire.layout import ShardKeys
    from ..chains import Hold
    from ..execution import Executor
    from ..keystates import KeyStates
    from ..writes import WriteChain

log = logging.getLogger("keyserial.worker")

#: Messages from signers not known yet kept to be taken again once their keys are read.
_UNVERIFIED_KEPT = 256

#: What a waiter waits for: ("g", op id, home, attempt, shard) or ("d", op id, home, attempt).
Topic = tuple[str, str, int, int] | tuple[str, str, int, int, int]


class LocalShard(Protocol):
    """A shard this worker owns, as a cross-shard op of another of its shards uses it: its
    keys held, read and written through these calls only."""

    shard: int
    epoch: int
    keys: ShardKeys
    #: The owner's writes, for a commit that writes this shard's keys (see ``WriteChain``).
    write_chain: WriteChain

    def cached_state(self, key: str) -> str | None:
        """The committed state of a key held with :meth:`try_hold` (cached: it is idle)."""

    def next_fence(self) -> int:
        """A fencing token of this shard's, for an op that writes keys it holds."""

    def committed(self, key: str, state: str | None) -> None:
        """A commit across shards wrote ``key``'s new state."""

    def entries_waiting(self) -> None:
        """New entries were appended to the shard (its next step fetches them)."""

    def hold(
        self, keys: tuple[str, ...]
    ) -> AbstractAsyncContextManager[dict[str, str | None] | None]:
        """Hold ``keys``; yields their committed states, or None if the shard stopped first."""

    def try_hold(self, keys: tuple[str, ...], *, committed: bool = True) -> Hold | None:
        """Hold ``keys`` at once if they are idle (cached, nothing queued, and, if
        ``committed``, committed), or None."""

    def release(self, hold: Hold) -> None:
        """End a hold :meth:`try_hold` took."""

    def take_request(self, request: GrantRequest) -> None:
        """A grant request for this shard, from a listed worker (or this one): hold its keys
        behind the ops taken in on them, and grant them (see ``ShardRunner.take_request``)."""


class HomeShard(LocalShard, Protocol):
    """The shard a cross-shard op is homed on, as its own coordinator (or participant) uses
    it: its key states and its op execution too."""

    states: KeyStates
    executor: Executor

    async def load_states(self, keys: Sequence[str]) -> None:
        """Cache the committed states of those of ``keys`` not cached."""

    @property
    def ended(self) -> bool:
        """Whether its runner has stopped."""


class Waiter:
    """Waits for one message: a grant from one shard, or an attempt's decision. Registered with
    the mailbox from its creation until the ``with`` block it opens ends.

    On a bare future of the running loop, and one timer for all of a worker's waits (see
    :class:`_Deadlines`): a crossing transfer waits twice, and an event and a timer of its own
    per wait cost more Python calls than the rest of the wait together."""

    __slots__ = ("_deadlines", "_future", "_mailbox", "_topic", "_woken", "message", "on_wake")

    def __init__(self, mailbox: Mailbox, topic: Topic, deadlines: _Deadlines) -> None:
        self._mailbox = mailbox
        self._topic = topic
        self._deadlines = deadlines
        #: What :meth:`within` awaits; None while it does not wait.
        self._future: asyncio.Future[None] | None = None
        #: Woken while not waiting: the next :meth:`within` returns at once.
        self._woken = False
        #: The message, handed over in process by this worker itself, or signed for it by
        #: another worker (never one merely read from Redis).
        self.message: KeyGrant | DecisionNotice | None = None
        #: Called at each wake-up instead, while set (a wait with no task: see
        #: ``crossshard.participant``); else :meth:`within` hears it.
        self.on_wake: Callable[[], None] | None = None

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *_: object) -> None:
        self.forget()

    def wake(self) -> None:
        if self.on_wake is not None:
            self.on_wake()
            return
        future = self._future
        if future is None:
            self._woken = True
        elif not future.done():
            future.set_result(None)

    def forget(self) -> None:
        """Wait no more (as the end of its ``with`` block)."""
        self._mailbox.forget(self._topic, self)

    def stop(self) -> None:
        """Call back no more, and wait no more (a wait with no task that has ended)."""
        self.on_wake = None
        self.forget()

    @property
    def pending(self) -> bool:
        """Whether a wake-up came that no :meth:`within` has spent yet."""
        return self._woken

    def woken(self) -> None:
        """Count a wake-up that came while it was not waiting: the next :meth:`within` reads
        the record at once."""
        self._woken = True

    async def within(self, seconds: float) -> KeyGrant | DecisionNotice | None:
        """The message, if it was handed over by now or within ``seconds``; None: time to
        read its record in Redis (a wake-up came, or the time ran out)."""
        if not self._woken and self.message is None:
            # (Time running out is a wake-up too: either way the record is read next.)
            self._future = future = self._deadlines.future_within(seconds)
            try:
                await future
            finally:
                self._future = None
        self._woken = False  # (a wake-up is spent: the next one must come anew)
        return self.message


class _Deadlines:
    """One timer for every wait of a worker: the waits' futures, each resolved by its wake-up or
    its deadline, whichever comes first. A wait that ends early leaves its deadline behind; the
    timer skips it (its future is done) when that deadline comes."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        #: (deadline, sequence, what it ends): a heap, earliest first.
        self._heap: list[tuple[float, int, asyncio.Future[None] | Callable[[], None]]] = []
        self._made = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def future_within(self, seconds: float) -> asyncio.Future[None]:
        """A future that is resolved in ``seconds`` unless something resolves it before."""
        loop = self._running_loop()
        future = loop.create_future()
        self._add(loop, loop.time() + seconds, future)
        return future

    def call_within(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` in ``seconds`` (it cannot be cancelled: it checks whether it is
        still wanted)."""
        loop = self._running_loop()
        self._add(loop, loop.time() + seconds, callback)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():  # (a worker runs on one loop: looked up once)
            loop = self._loop = asyncio.get_running_loop()
            self._heap.clear()
            self._timer = None
        return loop

    def _add(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        ends: asyncio.Future[None] | Callable[[], None],
    ) -> None:
        self._made += 1
        heapq.heappush(self._heap, (deadline, self._made, ends))
        if self._timer is None or deadline < self._timer_at:
            self._schedule(loop, deadline)

    def _schedule(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(deadline, self._expire)
        self._timer_at = deadline

    def _expire(self) -> None:
        self._timer = None
        loop, heap = self._loop, self._heap
        assert loop is not None, "a timer runs only on the loop that set it"
        now = loop.time()
        due: list[Callable[[], None]] = []
        while heap and heap[0][0] <= now:
            ends = heapq.heappop(heap)[2]
            if isinstance(ends, asyncio.Future):
                if not ends.done():
                    ends.set_result(None)
            else:
                due.append(ends)
        if heap:
            self._schedule(loop, heap[0][0])
        for callback in due:  # (last: one that raises leaves the timer set)
            callback()


class Mailbox:
    """Hands each coordination message to whoever waits for it."""

    def __init__(
        self, channel_prefix: str, local_shard: Callable[[int], LocalShard | None]
    ) -> None:
        #: This worker's key pair for the messages signed for it; the channel names its public
        #: half (``<prefix>.<public key>``), so a sender knows whom to sign for.
        self.verifier = ReplyVerifier(channel_prefix)
        self.channel = self.verifier.channel
        #: The channel of each participant shard's owner (by the shard's name), as its lease
        #: named it when this worker last asked: its grant requests go there.
        self._owners: dict[str, str] = {}
        #: The layout whose shard channels this worker uses (a cluster's), or None.
        self._layout: Layout | None = None
        #: With sharded pub/sub, this worker's channel in each shard's slot (see
        #: :meth:`use_shard_channels`); else none.
        self._shard_channels: list[str] = []
        self._mine = {self.channel}
        #: This worker's runner of a shard, or None if the worker does not own the shard.
        self.local_shard = local_shard
        self._waiting: dict[Topic, list[Waiter]] = defaultdict(list)
        self._deadlines = _Deadlines()
        #: Signers met in messages whose keys are to be read (the worker runs its ``learn``).
        self.signers = SignersMet(
            self.verifier,
            log,
            what="coordination message signers",
            meanwhile="their messages only wake; the records are read",
            learned=self._learned,
        )
        #: Messages from signers met and not read yet, by signer, taken again once their keys
        #: are known: a worker's first request to another would otherwise wait for a poll.
        self._unverified: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
        self._unverified_count = 0

    def use_shard_channels(self, layout: Layout) -> None:
        """Take messages on a shard channel per shard (a cluster with sharded pub/sub): a
        script of shard ``s`` publishes on :meth:`channel_for` ``(s)``, in its own slot."""
        self._shard_channels = [keys.in_shard(self.channel) for keys in layout.all_keys()]
        self._mine = {self.channel, *self._shard_channels}
        self._layout = layout

    def channel_for(self, shard: int) -> str:
        """The channel that a script of ``shard`` publishes on to reach this worker."""
        return self._shard_channels[shard] if self._shard_channels else self.channel

    @property
    def channels(self) -> list[str]:
        """Every channel this worker takes messages on."""
        return [self.channel, *self._shard_channels]

    def is_mine(self, channel: str) -> bool:
        return channel in self._mine

    def owner_is(self, shard_name: str, channel: str | None) -> None:
        """The shard named ``shard_name`` is owned by the worker of ``channel`` (read in its
        lease; None: nobody owns it now)."""
        if channel is None:
            self._owners.pop(shard_name, None)
        else:
            self._owners[shard_name] = channel

    def expected_owner(self, shard_name: str) -> str | None:
        """The channel of the owner of the shard named ``shard_name``, as its lease named it
        when this worker last looked (None: not looked yet, or nobody owned it)."""
        return self._owners.get(shard_name)

    def request_channel(self, shard: int, owner: str) -> str:
        """Where a grant request for ``shard`` reaches the worker of channel ``owner``: that
        channel, or on a cluster with sharded pub/sub its shard channel in ``shard``'s slot."""
        if self._layout is None:
            return owner
        return self._layout.keys(shard).in_shard(owner)

    def expect_grant(self, op_id: str, home: int, attempt: int, shard: int) -> Waiter:
        """Register interest before asking, so the grant cannot arrive unseen (until the
        ``with`` block of the waiter ends)."""
        return self._expect(("g", op_id, home, attempt, shard))

    def expect_decision(self, op_id: str, home: int, attempt: int) -> Waiter:
        return self._expect(("d", op_id, home, attempt))

    def call_within(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` in ``seconds``, on the timer the waits share."""
        self._deadlines.call_within(seconds, callback)

    def _expect(self, topic: Topic) -> Waiter:
        waiter = Waiter(self, topic, self._deadlines)
        self._waiting[topic].append(waiter)
        return waiter

    def forget(self, topic: Topic, waiter: Waiter) -> None:
        """``waiter`` waits no more."""
        waiters = self._waiting[topic]
        waiters.remove(waiter)
        if not waiters:
            del self._waiting[topic]

    def receive(self, channel: str, data: bytes) -> None:
        """A message on one of this worker's channels, through Redis (a grant request, a grant,
        a decision notice, or a batch of them). Signed for this worker by another worker, each
        item is handed over as it is; else a grant or a notice only wakes the waiters of what it
        names (they read the record instead), and a request is dropped (kept to be taken again
        once its signer's key is read, if that signer is not known yet)."""
        signed = self.verifier.verified(
            data, lambda signer: self._met(signer, channel, data), channel
        )
        try:
            text = without_signature(data) if signed is None else signed
            messages = messages_from_wire(json.loads(text))
        except (ValueError, MalformedMessage):
            log.error("ignoring a malformed coordination message: %r", data[:200])
            return
        for message in messages:
            if isinstance(message, GrantRequest):
                if signed is not None:
                    self.take_request(message)
                else:
                    log.info(
                        "ignoring a grant request of %s#%d that no listed worker signed for this"
                        " one (or one whose listing is not read yet: taken once it is)",
                        message.op_id,
                        message.attempt,
                    )
            elif signed is not None:
                self.deliver(message)
            else:
                for waiter in self._waiting.get(_topic(message), ()):
                    waiter.wake()

    def _met(self, signer_id: str, channel: str, data: bytes) -> None:
        """A message signed by a signer not known yet: its key is to be read, and the message
        taken again then (at most ``_UNVERIFIED_KEPT`` wait: a forger's are dropped first)."""
        self.signers.met(signer_id)
        if self._unverified_count >= _UNVERIFIED_KEPT:
            return
        self._unverified[signer_id].append((channel, data))
        self._unverified_count += 1

    def _learned(self, known: list[str], unlisted: list[str]) -> None:
        """The signers' listings were read: take the messages of those ``known`` kept meanwhile
        again, and drop those of the ``unlisted`` (forged ids, or workers not listed yet, whose
        coordinators ask again after a poll)."""
        for signer_id in unlisted:
            self._unverified_count -= len(self._unverified.pop(signer_id, []))
        for signer_id in known:
            kept = self._unverified.pop(signer_id, [])
            self._unverified_count -= len(kept)
            for channel, data in kept:
                self.receive(channel, data)

    def take_request(self, request: GrantRequest) -> None:
        """Hand a grant request to this worker's runner of its shard; dropped if the worker
        does not own it (the coordinator asks the shard's owner again after a poll)."""
        number, _, _ = request.target.partition("@")
        local = self.local_shard(int(number)) if number.isdigit() else None
        if local is None:
            log.info(
                "a grant request of %s#%d for shard %s, which this worker does not own",
                request.op_id,
                request.attempt,
                request.target,
            )
            return
        local.take_request(request)

    def deliver(self, message: KeyGrant | DecisionNotice) -> None:
        """Hand a message over to be taken as it is: from this worker itself, in process, or
        signed for it by another worker."""
        for waiter in self._waiting.get(_topic(message), ()):
            waiter.message = message
            waiter.wake()


def _topic(message: KeyGrant | DecisionNotice) -> Topic:
    if isinstance(message, KeyGrant):
        return ("g", message.op_id, message.home, message.attempt, message.shard)
    return ("d", message.op_id, message.home, message.attempt)
