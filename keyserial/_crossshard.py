"""Multi-key ops across shards: grants taken in ascending shard order, one decision record.

An op whose keys sit on several shards is appended to its *home* shard, the lowest of them.
The home owner holds the op's local keys (a barrier in their chains) and coordinates one
*attempt*, named by its epoch (unique to this owner, and over once another owner's fence
replaces it):

1. for each other shard, in ascending order, it appends a grant request (op ``keyserial.grant``
   for that shard's keys) and waits for the grant: the participant holds those keys (a barrier,
   so only they wait; its other keys keep flowing), commits every earlier write to them, and
   publishes their committed states;
2. it runs the op on all the states, then ``decide``: set-if-absent of the attempt's decision
   record in the home shard, atomically with the home keys' writes and the op's result (fenced);
   the decision goes to the participants and the outcome to the caller from the same script;
3. each participant applies the decision's writes for its keys through its own fenced commit,
   stores a result for the grant request (so a replay of it is a no-op) and releases the keys.

Why it cannot deadlock: an op waiting for a grant at shard ``j`` holds keys only on shards below
``j``; inside one shard, keys are granted in stream order, so an earlier entry never waits for a
later one. A cycle of waits would need some op to wait on a lower shard than one it holds: never.

Why it is atomic: a participant holds keys until it learns the decision. It looks it up in the
home shard now and then (``resolve``); if the attempt is undecided and the home shard's epoch
has moved on, no commit can ever come (``decide`` is fenced by that epoch), so it writes an abort
with set-if-absent on the same record: a commit and an abort can never both win. The home
shard's next owner finds the op's result if the decision committed (and never reruns it), or
else runs it again as a new attempt under its own epoch. A participant that dies while holding
keys is replayed by its successor: the grant request runs again and learns the decision. A
zombie coordinator or participant is fenced by its shard's epoch in every write it makes.

When this worker owns every shard of the op and the server is standalone, no messages are
needed: the home owner holds the other shards' keys in process (a hold in their chains, in the
same ascending order, so the argument above is unchanged) and commits every shard's writes, the
result and the reply in one script fenced by all their epochs (``commit_across``). Atomic by
itself, it needs no decision record. If a participant shard changes hands meanwhile, that
script writes nothing and the op goes through grant requests. A sync op whose keys are all
idle needs no task for this: :meth:`CrossShard.start_now` holds its keys, runs it and queues
the script while its entry is dispatched. (On a cluster the shards' keys sit in different
slots, which one script cannot touch.)

Records (in the results hash, so they expire with the results): home ``<op>#<epoch>#d`` (the
decision); participant ``<op>#<epoch>`` (the grant request's own result) and ``<op>#<epoch>#g``
(the grant, for a coordinator on another worker that missed the message). Between shards of one
worker, grants, decisions and wake-ups are handed over in process once their writes commit.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import anyio

from . import _backend
from ._backend import Backend, Script, ScriptCall
from ._backoff import Backoff
from ._codec import WIRE_VERSION, Envelope, encode_error, encode_reply, pack_entry
from ._execution import Hold, Run, StateCache
from ._json import dumps
from ._layout import ShardKeys
from ._pipeline import Replies
from ._refusals import BacklogRefused, OwnedElsewhere, Refused
from ._routing import route
from ._settings import Settings
from .errors import BackendUnavailable, LeaseLost, MalformedOperation

log = logging.getLogger("keyserial.worker")

#: The op name of a grant request; served by every worker, never by an app.
GRANT_OP = "keyserial.grant"
_APPLIED = '{"ok":"applied"}'
_RELEASED = '{"ok":"released"}'


def _fences(holds: Sequence[tuple[OwnedShard, Hold]]) -> dict[str, int]:
    """A fencing token from each holding shard's owner, for the keys it holds."""
    fences: dict[str, int] = {}
    for owner, hold in holds:
        fences.update(dict.fromkeys(hold.keys, owner.next_fence()))
    return fences


def attempt_id(op_id: str, attempt: int) -> str:
    """The op id of an attempt's grant requests (``#`` is reserved in op ids for this)."""
    return f"{op_id}#{attempt}"


class OwnedShard(Protocol):
    """A shard this worker owns: its epoch, keys and state cache."""

    shard: int
    epoch: int
    keys: ShardKeys
    cache: StateCache

    def next_fence(self) -> int:
        """A fencing token for an op on the shard's keys, larger than any before."""


class LocalShard(OwnedShard, Protocol):
    """Another shard this worker owns, as a cross-shard op coordinated here sees it."""

    def wake(self) -> None:
        """New entries were appended to the shard."""

    def hold(
        self, keys: tuple[str, ...]
    ) -> AbstractAsyncContextManager[dict[str, str | None] | None]:
        """Hold ``keys``; yields their committed states, or None if the shard stopped first."""

    def try_hold(self, keys: tuple[str, ...]) -> Hold | None:
        """Hold ``keys`` at once if they are idle (committed, cached, nothing queued), or None."""

    def release(self, hold: Hold) -> None:
        """End a hold :meth:`try_hold` took."""


@dataclass(slots=True)
class _Letter:
    """Waits for one kind of message: a grant from one shard, or an attempt's decision."""

    event: anyio.Event
    message: dict[str, Any] | None = None


class Mailbox:
    """A worker's channel for coordination messages: grants to the ops it coordinates and
    decisions to the grants it holds. A message nobody waits for is dropped; every waiter also
    polls Redis, so a lost message costs latency, never correctness."""

    def __init__(self, channel: str, local_runner: Callable[[int], LocalShard | None]) -> None:
        self.channel = channel
        #: This worker's runner of a shard, or None if the worker does not own the shard.
        self.local_runner = local_runner
        self._waiting: dict[tuple[Any, ...], list[_Letter]] = defaultdict(list)

    @contextmanager
    def expect(self, *topic: Any) -> Iterator[_Letter]:
        """Register interest before causing the message, so it cannot arrive unseen."""
        letter = _Letter(anyio.Event())
        self._waiting[topic].append(letter)
        try:
            yield letter
        finally:
            letters = self._waiting[topic]
            letters.remove(letter)
            if not letters:
                del self._waiting[topic]

    def deliver(self, data: bytes | dict[str, Any]) -> None:
        """Hand a message (as received, or already decoded when it comes from this worker
        itself, which skips the round trip through Redis) to whoever waits for it."""
        try:
            message = json.loads(data) if isinstance(data, bytes) else data
            if message["t"] == "g":
                topic: tuple[Any, ...] = ("g", message["op"], message["a"], message["s"])
            else:
                topic = ("d", message["op"], message["a"])
        except (ValueError, KeyError, TypeError):
            log.error("ignoring a malformed coordination message: %r", str(data)[:200])
            return
        for letter in self._waiting.get(topic, ()):
            letter.message = message
            letter.event.set()


class Host(LocalShard, Protocol):
    """What a shard runner offers the coordination of its cross-shard ops."""

    dirty: set[str]

    def spawn(self, task: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``task`` in the runner's task group; nothing if the runner has stopped."""

    def runs_inline(self, envelope: Envelope) -> bool:
        """Whether the op exists, takes a list of keys, and is not ``async``."""

    def evaluate_now(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        """:meth:`evaluate` for an op that :meth:`runs_inline`."""

    def commit_later(
        self, call: ScriptCall[Any], replies: Replies, on_done: Callable[[Any], None]
    ) -> None:
        """Queue a fenced script in the next pipeline; ``on_done`` gets its reply or error."""

    async def flush(self, keys: Iterable[str]) -> None:
        """Return once every write to ``keys`` made so far has committed."""

    async def fenced(
        self, script: Script, keys: Sequence[str], args: Sequence[Any], *,
        replies: Replies | None = None,
    ) -> Any:
        """Run a script that checks this owner's epoch (raises ``LeaseLost`` when fenced);
        ``replies`` go out once it has succeeded (see :class:`Pipeliner`)."""

    async def pipelined(self, call: ScriptCall[Any]) -> Any:
        """Run a script in the worker's next shared pipeline (not fenced)."""

    def refusal(self, run: Run) -> str | None:
        """The error outcome of an op that cannot run at all (unknown op, wrong kind), or
        None; ``run.keep`` says whether it is stored."""

    async def evaluate(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        """Run the op on ``states`` (``fences``: its other shards' keys' tokens): its outcome,
        and every key's new state (None if it failed)."""

    def settle(self, run: Run, outcome: str, *, store: bool, replies: list[str]) -> None:
        """Report a finished op; ``store``: the next commit stores its outcome (False: it is
        in Redis already, or must not be kept)."""


class CrossShard:
    """Coordinates the cross-shard ops homed on one shard, and grants its keys to others'."""

    def __init__(
        self,
        host: Host,
        backend: Backend,
        mailbox: Mailbox,
        settings: Settings,
        shard_count: int,
    ) -> None:
        self._host = host
        self._backend = backend
        self._mailbox = mailbox
        self._settings = settings
        self._shard_count = shard_count
        #: How often a waiter looks in Redis for a message it may have missed (and a
        #: participant checks that its coordinator still owns the home shard).
        self._poll = min(settings.idle_poll, settings.lease_ttl / 8)

    def local_keys(self, envelope: Envelope) -> tuple[str, ...] | None:
        """For a grant request or an op with keys on other shards, its keys on this shard (the
        ones its barrier holds here); None for any other op."""
        if envelope.name == GRANT_OP:
            return envelope.keys
        if not envelope.multi:
            return None
        here = self._host.shard
        shards = route(envelope, self._shard_count)
        if all(shard == here for shard in shards):
            return None
        return tuple(key for key, shard in zip(envelope.keys, shards, strict=True) if shard == here)

    async def run(self, run: Run) -> None:
        """Run a grant request or coordinate an op, once its barrier holds the local keys."""
        if run.envelope.name == GRANT_OP:
            await self._grant(run)
        else:
            await self._coordinate(run)

    # -- the home shard: coordinating ----------------------------------------------------------

    def start_now(self, run: Run) -> bool:
        """Start an op whose shards this worker owns and whose keys are all idle, with no task:
        hold its keys, run it, and queue its ``commit_across`` in the next pipeline; the
        script's reply ends it (:meth:`_committed`). Under load most transfers go this way: the
        waiting and the task of :meth:`_commit_in_process` cost more than the op. False, with
        nothing done, if the op has to queue: some key busy, uncommitted or not cached, some
        shard not this worker's, an ``async`` op, or a cluster."""
        host, envelope = self._host, run.envelope
        if self._backend.is_cluster or envelope.name == GRANT_OP or not host.runs_inline(envelope):
            return False
        local, by_shard = self._split(envelope)
        owners: list[LocalShard] = [host]
        for shard in sorted(by_shard):
            other = self._mailbox.local_runner(shard)
            if other is None:
                return False
            owners.append(other)
        holds: list[tuple[LocalShard, Hold]] = []
        for owner in owners:
            hold = owner.try_hold(tuple(local if owner is host else by_shard[owner.shard]))
            if hold is None:
                for taken, held in holds:
                    taken.release(held)
                return False
            holds.append((owner, hold))
        states = {key: owner.cache[key] for owner, hold in holds for key in hold.keys}
        fences = _fences(holds[1:])
        outcome, new_states = host.evaluate_now(envelope, states, fences)
        writes = self._writes(envelope, states, new_states)
        replies = list(run.replies)
        call = self._across_call(envelope.op_id, outcome, owners, writes)
        gated = {reply: [(envelope.op_id, outcome)] for reply in replies}
        host.commit_later(
            call, gated,
            partial(self._committed, run, holds, writes, outcome, len(replies), call),
        )
        return True

    def _committed(
        self,
        run: Run,
        holds: list[tuple[LocalShard, Hold]],
        writes: dict[int, list[tuple[str, str]]],
        outcome: str,
        replied: int,
        call: ScriptCall[Any],
        result: Any,
    ) -> None:
        """The reply of :meth:`start_now`'s commit. If the server refused it (a shard changed
        hands), nothing was written: the op takes the usual path, its home keys still held so
        that no later op on them overtakes it. If the reply was lost, the commit may or may not
        have landed: the same (idempotent) call is sent until the server says which."""
        host = self._host
        if isinstance(result, BackendUnavailable):
            host.spawn(partial(self._confirm, run, holds, writes, outcome, call))
            return
        if isinstance(result, Exception):
            log.info("shard %d: op %s did not commit (%s); running it again",
                     host.shard, run.envelope.op_id, result)
            for owner, hold in holds[1:]:
                owner.release(hold)
            home_hold = holds[0][1]
            # (If the home runner has stopped, its successor runs the op again.)
            host.spawn(partial(self._coordinate_holding, run, home_hold))
            return
        self._landed(run, [owner for owner, _ in holds], writes, outcome, replied)
        for owner, hold in holds:
            owner.release(hold)

    async def _confirm(
        self,
        run: Run,
        holds: list[tuple[LocalShard, Hold]],
        writes: dict[int, list[tuple[str, str]]],
        outcome: str,
        call: ScriptCall[Any],
    ) -> None:
        """Send a commit whose reply was lost again, until it lands or is refused (retried
        while the server is unreachable; ``LeaseLost`` ends the runner, holds and all)."""
        try:
            result: Any = await self._host.fenced(call.script, call.keys, call.args)
        except Refused as exc:
            result = exc
        # Every caller is told again: the first call may have told them already, and a second
        # reply to the same op is ignored.
        self._committed(run, holds, writes, outcome, 0, call, result)

    def _landed(
        self,
        run: Run,
        owners: Sequence[OwnedShard],
        writes: Mapping[int, list[tuple[str, str]]],
        outcome: str,
        replied: int,
    ) -> None:
        """``commit_across`` wrote the op: every owner caches its new states, and the op is
        settled (``replied``: how many of its callers the script's reply told)."""
        for owner in owners:
            for key, state in writes.get(owner.shard, []):
                owner.cache[key] = state or None
        # Callers that resubmitted the op while it ran have not been told yet.
        self._host.settle(run, outcome, store=False, replies=run.replies[replied:])

    async def _coordinate_holding(self, run: Run, hold: Hold) -> None:
        try:
            await self._coordinate(run)
        finally:
            self._host.release(hold)

    def _split(self, envelope: Envelope) -> tuple[list[str], dict[int, list[str]]]:
        """The op's keys on this shard, and on each other shard."""
        by_shard: dict[int, list[str]] = defaultdict(list)
        for key, shard in zip(envelope.keys, route(envelope, self._shard_count), strict=True):
            by_shard[shard].append(key)
        local = by_shard.pop(self._host.shard)
        for key in itertools.chain.from_iterable(by_shard.values()):
            self._host.cache.pop(key, None)  # the fetch looked it up here: it is not ours
        return local, by_shard

    def _across_call(
        self,
        op_id: str,
        outcome: str,
        owners: Sequence[OwnedShard],
        writes: Mapping[int, list[tuple[str, str]]],
    ) -> ScriptCall[Any]:
        """``commit_across`` of an op's writes, fenced by every shard's epoch (home first)."""
        keys = [self._host.keys.results, self._host.keys.results_old]
        args: list[Any] = [op_id, outcome, "[]"]  # replies: see Pipeliner.run
        for owner in owners:
            keys += [owner.keys.epoch, owner.keys.state]
            args += [owner.epoch, dumps(writes.get(owner.shard, []))]
        return ScriptCall(_backend.COMMIT_ACROSS, keys, args)

    async def _coordinate(self, run: Run) -> None:
        host, envelope = self._host, run.envelope
        problem = host.refusal(run)
        if problem is not None:
            host.settle(run, problem, store=run.keep, replies=list(run.replies))
            return
        local, by_shard = self._split(envelope)
        await host.flush(local)  # the home keys' earlier writes commit before this op's can
        if not self._backend.is_cluster and await self._commit_in_process(run, local, by_shard):
            return
        # The attempt is this owner's epoch: unique to it, and over once the fence moves on.
        attempt = host.epoch
        states = {key: host.cache[key] for key in local}
        fences: dict[str, int] = {}
        participants: list[str] = []
        for shard, keys in sorted(by_shard.items()):  # ascending: no wait cycle can form
            grant = await self._request_grant(envelope.op_id, attempt, shard, keys)
            states.update({key: state for key, state in grant["st"]})
            if isinstance(grant.get("f"), int):  # (a grant from an older worker has none)
                fences.update(dict.fromkeys(keys, grant["f"]))
            participants.append(grant["c"])
        outcome, new_states = await host.evaluate(envelope, states, fences)
        writes = self._writes(envelope, states, new_states)
        home_writes = writes.pop(host.shard, [])
        decision = {"w": {str(shard): w for shard, w in writes.items()}}
        notice = {"t": "d", "op": envelope.op_id, "a": attempt, "d": decision}
        replies = list(run.replies)
        here = self._mailbox.channel
        notices = [(channel, dumps(notice)) for channel in dict.fromkeys(participants)
                   if channel != here]
        notices += [(reply, encode_reply([(envelope.op_id, outcome)])) for reply in replies]
        k = host.keys
        durable = self._settings.durability is not None
        won = await host.fenced(
            _backend.DECIDE,
            [k.epoch, k.state, k.results, k.results_old],
            [host.epoch, envelope.op_id, attempt, dumps(decision), dumps(home_writes), outcome,
             "[]" if durable else dumps(notices)],
        )
        if int(won[0]) != 1:  # only a participant that saw the epoch end writes an abort
            raise LeaseLost(host.shard, f"op {envelope.op_id} was aborted: {won[1]!r}")
        for key, state in home_writes:
            host.cache[key] = state or None
        await self._replicated(k)
        if durable:
            await self._publish(notices)
        if here in participants:  # shards of this worker hear it now, not through Redis
            self._mailbox.deliver(notice)
        # Callers that resubmitted the op while it ran have not been told yet.
        host.settle(run, outcome, store=False, replies=run.replies[len(replies):])

    async def _commit_in_process(
        self, run: Run, local: list[str], by_shard: dict[int, list[str]]
    ) -> bool:
        """Run an op whose other shards this worker owns too: hold their keys in process, then
        commit every shard at once (``commit_across``, one script: standalone servers only).
        False, with nothing written, if some shard is not (or no longer) this worker's: the
        grant protocol runs instead."""
        host, envelope = self._host, run.envelope
        others: list[LocalShard] = []
        for shard in sorted(by_shard):  # ascending: no wait cycle can form
            other = self._mailbox.local_runner(shard)
            if other is None:
                return False
            others.append(other)
        states = {key: host.cache[key] for key in local}
        fences: dict[str, int] = {}
        replies = list(run.replies)
        async with AsyncExitStack() as stack:
            for other in others:
                held = await stack.enter_async_context(other.hold(tuple(by_shard[other.shard])))
                if held is None:
                    log.info("shard %d: shard %d stopped during op %s; asking it for a grant",
                             host.shard, other.shard, envelope.op_id)
                    return False
                states.update(held)
                fences.update(dict.fromkeys(held, other.next_fence()))
            outcome, new_states = await host.evaluate(envelope, states, fences)
            writes = self._writes(envelope, states, new_states)
            owned: list[OwnedShard] = [host, *others]
            call = self._across_call(envelope.op_id, outcome, owned, writes)
            try:
                await host.fenced(
                    call.script, call.keys, call.args,
                    replies={reply: [(envelope.op_id, outcome)] for reply in replies},
                )
            except OwnedElsewhere as exc:
                moved = others[exc.index - 2].shard
                log.info("shard %d: shard %d changed hands during op %s; asking it for a grant",
                         host.shard, moved, envelope.op_id)
                return False
            self._landed(run, owned, writes, outcome, len(replies))
        return True

    def _writes(
        self,
        envelope: Envelope,
        states: Mapping[str, str | None],
        new_states: Mapping[str, str | None] | None,
    ) -> dict[int, list[tuple[str, str]]]:
        """The keys an op changed, by shard ('' for a deleted state)."""
        writes: dict[int, list[tuple[str, str]]] = defaultdict(list)
        if new_states is None:
            return writes
        for key, shard in zip(envelope.keys, route(envelope, self._shard_count), strict=True):
            state = new_states[key]
            if state != states[key]:
                writes[shard].append((key, state or ""))
        return writes

    async def _request_grant(
        self, op_id: str, attempt: int, shard: int, keys: list[str]
    ) -> dict[str, Any]:
        """Append a grant request to ``shard`` and wait for the grant.

        :raises LeaseLost: if the attempt was aborted meanwhile (this owner's epoch is over).
        """
        request = dumps({
            "id": attempt_id(op_id, attempt), "keys": keys, "op": GRANT_OP,
            "kwargs": {"home": self._host.shard, "op": op_id, "attempt": attempt,
                       "channel": self._mailbox.channel},
        })
        there = ShardKeys(self._settings.namespace, shard)
        home = self._host.keys
        grant_field = attempt_id(op_id, attempt) + "#g"
        decision_field = attempt_id(op_id, attempt) + "#d"
        with self._mailbox.expect("g", op_id, attempt, shard) as letter:
            entry = await self._append(there, request)
            while True:
                with anyio.move_on_after(self._poll):
                    await letter.event.wait()
                if letter.message is not None:
                    return letter.message
                try:
                    # (Looked for before the grant: a request leaves the stream only after its
                    # grant was recorded, so gone with no grant means a failover lost it.)
                    present = await self._backend.entries_present(there, [entry])
                    (raw,) = await self._backend.stored(there, [grant_field])
                    if raw is not None:
                        await self._replicated(there)
                        grant: dict[str, Any] = json.loads(raw)
                        return grant
                    if (await self._backend.stored(home, [decision_field]))[0] is not None:
                        raise LeaseLost(self._host.shard, f"op {op_id} was aborted")
                    if not present[0]:
                        log.warning("shard %d: the grant request of op %s to shard %d is gone"
                                    " (a failover?); appending it again", self._host.shard,
                                    op_id, shard)
                        entry = await self._append(there, request)
                except BackendUnavailable as exc:
                    log.warning("shard %d: waiting for a grant: %s", self._host.shard, exc)

    async def _append(self, there: ShardKeys, request: str) -> bytes:
        """Append a grant request, waiting out a full backlog or an unreachable server; its
        entry id. A shard this worker owns is woken in process (if it changes hands meanwhile,
        its new owner finds the request at its next poll)."""
        local = self._mailbox.local_runner(there.shard)
        call: ScriptCall[Any] = ScriptCall(
            _backend.SUBMIT, [there.stream],
            [self._settings.max_backlog, WIRE_VERSION, pack_entry([request]),
             "" if local else there.wake_channel],
        )
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                entry: bytes = await self._host.pipelined(call)
                if local is not None:
                    local.wake()
                return entry
            except BacklogRefused:
                log.warning("shard %d: shard %d's backlog is full; retrying a grant request",
                            self._host.shard, there.shard)
            except BackendUnavailable as exc:
                log.warning("shard %d: appending a grant request to shard %d: %s",
                            self._host.shard, there.shard, exc)
            await backoff.sleep()

    async def _replicated(self, keys: ShardKeys) -> None:
        """Wait until every write the shard's node has made is as durable as the settings ask
        (``durable_replicas``, ``durable_fsync``; at once when they ask nothing). A grant or a
        decision leaves its shard only then: states derived from a commit a failover could still
        lose must not reach another shard, where they would outlive it."""
        durability = self._settings.durability
        backoff = Backoff(0.05, 1.0)
        while durability is not None:
            try:
                if await self._backend.confirm(keys.barrier, durability):
                    return
                log.warning("shard %d: shard %d's writes not confirmed yet; waiting",
                            self._host.shard, keys.shard)
            except BackendUnavailable as exc:
                log.warning("shard %d: confirming shard %d's writes: %s", self._host.shard,
                            keys.shard, exc)
            await backoff.sleep()

    async def _publish(self, messages: Sequence[tuple[str, str]]) -> None:
        """PUBLISH what a script publishes itself without durability. A message lost here is
        found by its receiver's poll of the records."""
        for channel, message in messages:
            try:
                await self._backend.publish(channel, message)
            except BackendUnavailable as exc:
                log.warning("shard %d: a coordination message not sent: %s",
                            self._host.shard, exc)
                return

    # -- a participant shard: granting ---------------------------------------------------------

    async def _grant(self, run: Run) -> None:
        host, envelope = self._host, run.envelope
        request = envelope.kwargs
        home, op_id, attempt, channel = (
            request.get("home"), request.get("op"), request.get("attempt"), request.get("channel")
        )
        if not (isinstance(home, int) and 0 <= home < host.shard and isinstance(op_id, str)
                and isinstance(attempt, int) and isinstance(channel, str)):
            outcome = encode_error(MalformedOperation.wire_type, f"bad grant request {request!r}")
            host.settle(run, outcome, store=True, replies=list(run.replies))
            return
        await host.flush(envelope.keys)  # the granted states are committed states
        with self._mailbox.expect("d", op_id, attempt) as letter:
            grant = {
                "t": "g", "op": op_id, "a": attempt, "s": host.shard,
                "st": [(key, host.cache[key]) for key in envelope.keys],
                "f": host.next_fence(),  # the granted keys' fencing token, for the op
                "c": self._mailbox.channel,
            }
            durable = self._settings.durability is not None
            if channel == self._mailbox.channel:
                # The coordinator is this worker: hand the grant over in process. (No record
                # is needed, an in-process message cannot be lost; and a grant writes nothing,
                # so this worker's zombie could not change anything by granting.)
                await self._replicated(host.keys)
                self._mailbox.deliver(grant)
            else:
                k = host.keys
                await host.fenced(
                    _backend.GRANT, [k.epoch, k.results],
                    [host.epoch, attempt_id(op_id, attempt) + "#g", dumps(grant),
                     "" if durable else channel],
                )
                await self._replicated(k)
                if durable:
                    await self._publish([(channel, dumps(grant))])
            decision = await self._await_decision(letter, home, op_id, attempt)
        if "abort" in decision:
            host.settle(run, _RELEASED, store=True, replies=[])
            return
        mine = set(envelope.keys)
        for key, state in decision.get("w", {}).get(str(host.shard), []):
            if key in mine:
                host.cache[key] = state or None
                host.dirty.add(key)
        host.settle(run, _APPLIED, store=True, replies=[])

    async def _await_decision(
        self, letter: _Letter, home: int, op_id: str, attempt: int
    ) -> dict[str, Any]:
        """The attempt's decision: from the coordinator's notice, or read (or, if the
        coordinator stopped, written as an abort) in the home shard."""
        there = ShardKeys(self._settings.namespace, home)
        while True:
            with anyio.move_on_after(self._poll):
                await letter.event.wait()
            if letter.message is not None:
                decision: dict[str, Any] = letter.message["d"]
                return decision
            try:
                raw = await self._backend.run(
                    _backend.RESOLVE, [there.epoch, there.results, there.results_old],
                    [op_id, attempt],
                )
            except BackendUnavailable as exc:
                log.warning("shard %d: waiting for a decision: %s", self._host.shard, exc)
                continue
            if raw is not None:
                await self._replicated(there)
                decision = json.loads(raw)
                return decision
