"""The home shard's side of a cross-shard op: take the other shards' keys, run the op, commit.

Either way the home's step commits it. When this worker owns every shard of the op and the
server is standalone, it holds the other shards' keys in process, and the home's step writes
them too, fenced by their epochs. Otherwise it asks each other shard for a grant, in ascending
shard order, and the home's step writes a decision record that the participants apply (see
docs/multi-key.md for why neither way can deadlock or half-apply).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from ..._backend.durability import held_confirmed
from ..._ops import Op
from ..._scripts.refusals import Replayed
from ..._wire.codec import (
    binding,
)
from ..._wire.json_text import dumps
from ..._wire.layout import ShardKeys, decision_field, owner_channel, part_id, shard_name
from ..._wire.messages import Decision, DecisionNotice, GrantRequest, KeyGrant
from ...errors import BackendUnavailable, LeaseLost
from ..chains import Hold, Split
from ..commits import AcrossCommit, OtherWrites, Record
from ..execution import Evaluated, Run
from ..writes import WriteChainBroken
from .coordination import RunnerServices
from .mailbox import LocalShard, Waiter

log = logging.getLogger("keyserial.worker")

#: A shard's writes: [(key, JSON state or '' to delete)].
Writes = list[tuple[str, str]]


class Coordinator:
    """Coordinates the cross-shard ops homed on one shard."""

    def __init__(self, services: RunnerServices) -> None:
        self._services = services

    # -- in process: every shard of the op is this worker's ----------------------------------

    def start_now(self, run: Run, split: Split) -> bool:
        """Start an op whose shards this worker owns and whose keys are all idle, with no task:
        hold its keys, run it, and commit it with the home's next step
        (:meth:`_commit_with_step`), which lets the keys go. Under load most transfers go this
        way. Else, if the op's keys here are idle, it asks the other shards for grants with no
        task either (:meth:`_ask_now`). An op that cannot run is refused now, with nothing
        held. False, with nothing done, if the op has to queue: some key busy, uncommitted or
        not cached, or an op that is not ``inline``."""
        services, envelope = self._services, run.envelope
        home = services.home
        definition = home.executor.inline_definition(envelope)
        if definition is None:
            return home.executor.refuse_now(run)
        by_shard = split.elsewhere
        others = None
        if services.backend.one_script_reaches_every_shard:
            others = self._local_owners(by_shard)
        if others is None:  # (some shard is another worker's, or a cluster's)
            return self._ask_now(run, definition, split)
        holds = _try_hold_all(
            [(home, split.here), *[(other, by_shard[other.shard]) for other in others]]
        )
        if holds is None:
            return False
        states = {key: owner.cached_state(key) for owner, hold in holds for key in hold.keys}
        fences = _fences([(owner, hold.keys) for owner, hold in holds[1:]])
        evaluated = home.executor.evaluate_now(envelope, states, fences, definition)

        def landed(_: bool) -> None:
            for owner, hold in holds:
                owner.release(hold)

        self._commit_with_step(run, split, others, states, evaluated, landed)
        return True

    @asynccontextmanager
    async def _held_in_process(self, run: Run, split: Split) -> AsyncIterator[_Held | None]:
        """The op's keys on the other shards, held until the end of the block, once each is
        idle: :meth:`start_now`'s way for an op that had to queue. None, with nothing held, if
        some shard is not (or no longer) this worker's, or the server is a cluster: the grant
        protocol runs instead."""
        services = self._services
        home, by_shard = services.home, split.elsewhere
        others = None
        if services.backend.one_script_reaches_every_shard:
            others = self._local_owners(by_shard)
        if others is None:
            yield None
            return
        states = {key: home.states[key] for key in split.here}
        async with AsyncExitStack() as stack:
            for other in others:
                held = await stack.enter_async_context(other.hold(tuple(by_shard[other.shard])))
                if held is None:
                    log.info(
                        "shard %d: shard %d stopped during op %s; asking it for a grant",
                        home.shard,
                        other.shard,
                        run.envelope.op_id,
                    )
                    break
                states.update(held)
            else:
                fences = _fences((other, by_shard[other.shard]) for other in others)
                yield _Held(run, split, others, states, fences)
                return
        yield None

    def _local_owners(self, by_shard: Mapping[int, list[str]]) -> list[LocalShard] | None:
        """This worker's runners of an op's other shards, in ascending shard order (so that no
        wait cycle can form); None if some shard is not this worker's."""
        others: list[LocalShard] = []
        for shard in sorted(by_shard):
            other = self._services.mailbox.local_shard(shard)
            if other is None:
                return None
            others.append(other)
        return others

    def _commit_with_step(
        self,
        run: Run,
        split: Split,
        others: list[LocalShard],
        states: Mapping[str, str | None],
        evaluated: Evaluated,
        landed: Callable[[bool], None],
    ) -> None:
        """Commit an op evaluated on ``states`` of the home and ``others`` with the home's next
        step: its home writes and result as any op's, its writes to ``others`` fenced by their
        owners' epochs. ``landed`` hears whether the step committed, once each owner caches
        what it wrote (a step that never came back breaks the others' write chains: whether
        it landed is not known)."""
        services, envelope = self._services, run.envelope
        home = services.home
        outcome, new_states, _ = evaluated
        writes = _writes_by_shard(split, home.shard, states, new_states)
        for key, state in writes.pop(home.shard, []):
            home.states.write(key, state or None)
        services.finish(
            run, outcome, store=True, replies=list(run.replies), binding=binding(envelope)
        )

        def settle(committed: bool | None) -> None:
            if committed is None:
                _outcome_unknown(others, envelope.op_id)
            elif committed:
                for owner in others:
                    for key, state in writes.get(owner.shard, []):
                        owner.committed(key, state or None)
            landed(bool(committed))

        services.commit_across(
            AcrossCommit(
                [OtherWrites(o.keys, o.epoch, writes.get(o.shard, [])) for o in others],
                [owner.write_chain for owner in others],
                settle,
            )
        )

    # -- with a task, once the op's barrier holds its home keys --------------------------------

    async def coordinate(self, run: Run, split: Split) -> None:
        await self._coordinating(self._coordinate(run, split))

    async def _coordinate(self, run: Run, split: Split) -> None:
        """Take the op's keys on the other shards (held in process, or granted), run the op,
        and commit it with the home's step. (An op that cannot run never queues:
        :meth:`start_now` refused it.)"""
        async with self._held_in_process(run, split) as held:
            if held is not None:
                await self._run_and_commit(held)
                return
        attempt = self._attempt(run, split)
        await self._ask_the_rest(attempt)
        await self._run_and_commit(attempt)

    async def _run_and_commit(self, taken: _Held | _Attempt) -> None:
        """Run the op on the states ``taken``, and commit it with the home's next step: with
        the held shards' writes, or with the attempt's decision."""
        evaluated = await self._services.home.executor.evaluate(
            taken.run.envelope, taken.states, taken.fences
        )
        if isinstance(taken, _Attempt):
            await self._decide(taken, evaluated)
            return
        landed = asyncio.get_running_loop().create_future()
        self._commit_with_step(
            taken.run, taken.split, taken.others, taken.states, evaluated, landed.set_result
        )
        # (If the step writes nothing, the runner ends, and cancels this.)
        await landed

    def _attempt(self, run: Run, split: Split) -> _Attempt:
        """An attempt at an op that asks the other shards for grants. The attempt is this
        owner's epoch: unique to it, and over once the fence moves on."""
        home = self._services.home
        states = {key: home.states[key] for key in split.here}
        # (Ascending: no wait cycle can form.)
        return _Attempt(run, split, home.epoch, states, sorted(split.elsewhere.items()))

    async def _ask_the_rest(self, attempt: _Attempt) -> None:
        """Ask the shards not asked yet for their grants, one after another."""
        op_id = attempt.run.envelope.op_id
        while (ask := attempt.next_ask()) is not None:
            shard, keys = ask
            attempt.granted(await self._request_grant(op_id, attempt.attempt, shard, keys), keys)

    async def _decide(self, attempt: _Attempt, evaluated: Evaluated) -> None:
        """Commit the attempt's decision (:meth:`decision_record`), then tell everyone."""
        record, notice = self.decision_record(attempt, evaluated)
        await self._services.commit_record(record)
        self.decided(attempt, record, notice)

    def decision_record(
        self, attempt: _Attempt, evaluated: Evaluated
    ) -> tuple[Record, DecisionNotice]:
        """Take the op's outcome and the home keys' writes into the home shard's next step,
        with the attempt's decision record. (The step's fence makes the decision this owner's;
        a different decision there already, an abort, refuses the whole step.)"""
        services, home, run = self._services, self._services.home, attempt.run
        envelope = run.envelope
        outcome, new_states, _ = evaluated
        writes = _writes_by_shard(attempt.split, home.shard, attempt.states, new_states)
        for key, state in writes.pop(home.shard, []):
            home.states.write(key, state or None)
        decision = Decision(
            dict(writes), lent={shard: fence for shard, (_, fence) in attempt.lent.items()}
        )
        notice = DecisionNotice(envelope.op_id, attempt.attempt, decision, home.shard)
        mailbox = services.mailbox
        notices = [
            (channel, dumps(notice.to_wire()))
            for channel in dict.fromkeys(attempt.participants)
            if not mailbox.is_mine(channel)
        ]
        # (In the same step as the record: nothing awaited in between.)
        services.finish(
            run, outcome, store=True, replies=list(run.replies), binding=binding(envelope)
        )
        if attempt.lent:
            services.commit_across(self._lent_writes(attempt, writes))
        field = decision_field(envelope.op_id, attempt.attempt)
        return Record(field, dumps(notice.decision.to_wire()), notices), notice

    def _lent_writes(self, attempt: _Attempt, writes: Mapping[int, Writes]) -> AcrossCommit:
        """The writes to the shards that lent their keys, for the home's step that commits the
        decision: each fenced by the epoch its owner granted under, so a shard that changed
        hands since refuses the whole step (``ELSEWHERE``), and the home shard is given up.
        What the step did is the decision record's to tell: nothing to settle here."""
        layout = self._services.layout
        return AcrossCommit(
            [
                OtherWrites(layout.keys(shard), epoch, writes.get(shard, []))
                for shard, (epoch, _) in sorted(attempt.lent.items())
            ],
            [],
            lambda _: None,
        )

    def decided(self, attempt: _Attempt, record: Record, notice: DecisionNotice) -> None:
        """The decision is committed: this worker's participant shards hear it now."""
        home, mailbox = self._services.home, self._services.mailbox
        log.debug(
            "shard %d (epoch %d): decided %s#%d: %s",
            home.shard,
            home.epoch,
            notice.op_id,
            notice.attempt,
            record.value,
        )
        if any(map(mailbox.is_mine, attempt.participants)):
            mailbox.deliver(notice)

    # -- with no task: the op's keys here are idle ---------------------------------------------

    def _ask_now(self, run: Run, definition: Op[..., Any], split: Split) -> bool:
        """Hold the op's keys here at once, if they are idle, and ask the other shards for
        grants with no task (:class:`_Asking`). False, with nothing done, if they are not."""
        home = self._services.home
        hold = home.try_hold(split.here, committed=False)
        if hold is None:
            return False
        _Asking(self, self._attempt(run, split), definition, hold).ask()
        return True

    def continue_in_task(
        self, attempt: _Attempt, hold: Hold, waiting: _Waiting | None = None
    ) -> None:
        """Go on with an attempt :class:`_Asking` began, in a task: from the grant it waits for
        (``waiting``: its request sent), or from asking the next shard again. Its keys
        here are let go at the end."""
        services = self._services

        async def rest() -> None:
            try:
                await self._coordinating(self._rest(attempt, waiting))
            finally:
                services.home.release(hold)

        if not services.spawn(rest) and waiting is not None:
            waiting.waiter.forget()  # (the runner has stopped: nothing it does commits)

    async def _rest(self, attempt: _Attempt, waiting: _Waiting | None) -> None:
        if waiting is not None:
            op_id, keys = attempt.run.envelope.op_id, waiting.request.keys
            with waiting.waiter:
                grant = await self._granted(waiting, op_id, attempt.attempt)
            attempt.granted(grant, keys)
        await self._ask_the_rest(attempt)
        await self._run_and_commit(attempt)

    async def _coordinating(self, coordinating: Coroutine[Any, Any, None]) -> None:
        try:
            await coordinating
        except Replayed as exc:
            # The op id has an outcome that this run did not write: nothing was written, and
            # the next owner answers the op from its record.
            self._services.home.write_chain.broken = True
            raise WriteChainBroken(f"shard {self._services.home.shard}: {exc}") from None

    # -- grants --------------------------------------------------------------------------------

    async def _request_grant(
        self, op_id: str, attempt: int, shard: int, keys: list[str]
    ) -> KeyGrant:
        """Ask ``shard``'s owner for a grant and wait for it.

        :raises LeaseLost: if the attempt was aborted meanwhile (this owner's epoch is over).
        """
        request = self.grant_request(op_id, attempt, shard, keys)
        home = self._services.home.shard
        with self._services.mailbox.expect_grant(op_id, home, attempt, shard) as waiter:
            await self._ask(request, look_up=False)
            return await self._granted(_Waiting(waiter, request), op_id, attempt)

    def grant_request(self, op_id: str, attempt: int, shard: int, keys: list[str]) -> _Request:
        """An attempt's grant request to ``shard``."""
        services = self._services
        request = GrantRequest(
            services.home.shard,
            op_id,
            attempt,
            shard_name(shard, services.layout.generation),
            tuple(keys),
            services.mailbox.channel_for(shard),  # (in its slot: that shard's script publishes)
            int(time.time() * 1000),
        )
        return _Request(shard, request, keys)

    def send_now(self, request: _Request) -> bool:
        """Send ``request`` to its shard's owner with no wait: in process if this worker owns
        the shard, else on the owner's channel, signed for it (with whatever else this worker
        owes it this round). False, with nothing sent, if the owner is not known yet."""
        services = self._services
        mailbox = services.mailbox
        if (local := mailbox.local_shard(request.shard)) is not None:
            local.take_request(request.request)
            return True
        owner = mailbox.expected_owner(request.request.target)
        if owner is None:
            return False
        item = dumps(request.request.to_wire())
        services.pipeliner.publish(mailbox.request_channel(request.shard, owner), item)
        return True

    async def _ask(self, request: _Request, *, look_up: bool) -> None:
        """Send ``request`` to its shard's owner, reading the shard's lease first if ``look_up``
        or if the owner is not known yet (a shard nobody owns gets nothing: its coordinator's
        poll asks again)."""
        if not look_up and self.send_now(request):
            return
        services = self._services
        there = services.layout.keys(request.shard)
        try:
            (holder,) = await services.backend.lease_holders([there])
        except BackendUnavailable as exc:
            log.warning(
                "shard %d: looking up the owner of shard %d: %s",
                services.home.shard,
                request.shard,
                exc,
            )
            return
        owner = (
            None if holder is None else owner_channel(services.settings.namespace, holder.decode())
        )
        services.mailbox.owner_is(request.request.target, owner)
        self.send_now(request)

    async def _granted(self, waiting: _Waiting, op_id: str, attempt: int) -> KeyGrant:
        """The grant of a request sent: handed over, or read in its record at a wake-up or a
        poll; the request sent again, to the owner the shard's lease names then, at each poll
        that finds no grant recorded.

        :raises LeaseLost: if the attempt was aborted meanwhile (this owner's epoch is over).
        """
        services = self._services
        home = services.home
        waiter, request = waiting.waiter, waiting.request
        there = services.layout.keys(request.shard)
        granted_at = part_id(op_id, home.shard, attempt)
        decided_at = decision_field(op_id, attempt)
        while True:
            if isinstance(message := await waiter.within(services.poll), KeyGrant):
                log.debug(
                    "shard %d (epoch %d): shard %d granted %s#%d, handed over in process or signed",
                    home.shard,
                    home.epoch,
                    request.shard,
                    op_id,
                    attempt,
                )
                return self.of_keys(message, request.keys)
            try:
                # A wake-up (or the poll): the grant is taken from its record alone.
                if (grant := await self._recorded_grant(there, granted_at)) is not None:
                    return self.of_keys(grant, request.keys)
                if (await services.backend.stored(home.keys, [decided_at]))[0] is not None:
                    raise LeaseLost(home.shard, f"op {op_id} was aborted")
            except BackendUnavailable as exc:
                log.warning("shard %d: waiting for a grant: %s", home.shard, exc)
                continue
            log.info(
                "shard %d: no grant of shard %d for %s#%d yet; asking its owner again",
                home.shard,
                request.shard,
                op_id,
                attempt,
            )
            request = request.again()  # (made now: a participant refuses an old one)
            await self._ask(request, look_up=True)

    def of_keys(self, grant: KeyGrant, keys: list[str]) -> KeyGrant:
        """``grant``, if it grants exactly the keys asked for. Else another request took the
        attempt's part on that shard (only a worker's could: never this attempt's), and this
        attempt can get no grant of its own there: the home shard is given up, and the op runs
        again under the next owner's attempt."""
        if sorted(key for key, _ in grant.states) == sorted(keys):
            return grant
        home = self._services.home
        home.write_chain.broken = True
        raise WriteChainBroken(
            f"shard {home.shard}: the grant of shard {grant.shard} to {grant.op_id}#"
            f"{grant.attempt} holds keys {[key for key, _ in grant.states]}, not {keys}: another"
            " request took the attempt's part"
        )

    async def _recorded_grant(self, there: ShardKeys, held: str) -> KeyGrant | None:
        """The grant the participant shard holds its keys under (recorded by its owner's
        fenced step), or None. A grant no WAIT confirms, as one read on a master that a
        failover has left behind, is not taken."""
        services = self._services
        raw, confirmed = await held_confirmed(
            services.backend, services.settings.durability, there, held
        )
        if raw is None or not confirmed:
            return None
        log.debug(
            "shard %d: grant %s of shard %d read in its held hash",
            services.home.shard,
            held,
            there.shard,
        )
        return KeyGrant.from_wire(json.loads(raw))


def _outcome_unknown(owners: Sequence[LocalShard], op_id: str) -> None:
    """A step that writes other shards for a cross-shard op went out, or may have, and its
    runner stops before it learns whether it landed: those shards cannot tell whether their
    cached states are Redis's. Each gives its shard up (its write chain is broken: no later
    write of it goes out), and the next owner, with a new epoch that fences the step out if it
    is still on its way, starts from what Redis has."""
    for owner in owners:
        if not owner.write_chain.broken:
            log.warning(
                "shard %d: the commit of op %s across shards may or may not have"
                " landed; giving the shard up",
                owner.shard,
                op_id,
            )
        owner.write_chain.broken = True
        owner.entries_waiting()  # (its next step, refused, ends it now, not at its next write)


def _try_hold_all(
    wanted: Sequence[tuple[LocalShard, Sequence[str]]],
) -> list[tuple[LocalShard, Hold]] | None:
    """Each owner's hold on its keys, if every one of them is idle now; else None, with nothing
    held."""
    holds: list[tuple[LocalShard, Hold]] = []
    for owner, keys in wanted:
        hold = owner.try_hold(tuple(keys))
        if hold is None:
            for taken, held in holds:
                taken.release(held)
            return None
        holds.append((owner, hold))
    return holds


def _fences(held: Iterable[tuple[LocalShard, Sequence[str]]]) -> dict[str, int]:
    """A fencing token from each holding shard's owner, for the keys it holds."""
    fences: dict[str, int] = {}
    for owner, keys in held:
        fences.update(dict.fromkeys(keys, owner.next_fence()))
    return fences


def _writes_by_shard(
    split: Split,
    home: int,
    states: Mapping[str, str | None],
    new_states: Mapping[str, str | None] | None,
) -> dict[int, Writes]:
    """The keys an op changed, by shard ('' for a deleted state)."""
    writes: dict[int, Writes] = {}
    if new_states is None:
        return writes
    for shard, keys in ((home, split.here), *split.elsewhere.items()):
        changed = [(key, new_states[key] or "") for key in keys if new_states[key] != states[key]]
        if changed:
            writes[shard] = changed
    return writes


@dataclass(frozen=True, slots=True)
class _Held:
    """A cross-shard op's keys on the other shards, held in process: this worker owns them."""

    run: Run
    split: Split
    #: The other shards' runners, in ascending shard order.
    others: list[LocalShard]
    #: The states of the op's keys, here and on the others.
    states: dict[str, str | None]
    fences: dict[str, int]


@dataclass(slots=True)
class _Attempt:
    """One attempt at a cross-shard op that asks other shards for grants: what it has
    gathered so far."""

    run: Run
    split: Split
    #: The home shard's epoch when it began.
    attempt: int
    #: The states of its keys: here, then those granted.
    states: dict[str, str | None]
    #: (shard, keys) to ask, in ascending shard order.
    asks: list[tuple[int, list[str]]]
    fences: dict[str, int] = field(default_factory=dict)
    #: The channel of each granting shard's owner, where the decision notice goes.
    participants: list[str] = field(default_factory=list)
    #: shard -> (epoch, fence) of each lent grant: the home's step writes those shards' keys.
    lent: dict[int, tuple[int, int]] = field(default_factory=dict)

    def next_ask(self) -> tuple[int, list[str]] | None:
        """The next shard to ask, and its keys; None once every shard has granted."""
        granted = len(self.participants)
        return self.asks[granted] if granted < len(self.asks) else None

    def granted(self, grant: KeyGrant, keys: list[str]) -> None:
        self.states.update(grant.states)
        if grant.fence is not None:  # (a grant from an older worker has none)
            self.fences.update(dict.fromkeys(keys, grant.fence))
            if grant.epoch is not None:
                self.lent[grant.shard] = (grant.epoch, grant.fence)
        self.participants.append(grant.channel)


@dataclass(frozen=True, slots=True)
class _Request:
    """A grant request to one shard."""

    shard: int
    request: GrantRequest
    keys: list[str]

    def again(self) -> _Request:
        """The request, made again now (its ``at``: one made longer than ``result_ttl`` ago
        is refused, since what became of its attempt may be forgotten by then)."""
        now = int(time.time() * 1000)
        return _Request(self.shard, replace(self.request, at=now), self.keys)


@dataclass(frozen=True, slots=True)
class _Waiting:
    """A grant request appended, and the wait for its grant."""

    waiter: Waiter
    request: _Request


class _Asking:
    """An attempt :meth:`Coordinator.start_now` began with no task, its keys here held: it asks
    each other shard in turn (the grant's hand-over calls it back), then runs the op and commits
    the decision with the home's next step, which calls it back to let the keys go. Whatever
    does not come as expected (an owner not known yet, a wake-up with no grant in hand, a poll
    with none yet) hands the rest to a task, as the task path would go on
    (:meth:`Coordinator.continue_in_task`)."""

    __slots__ = ("_attempt", "_coordinator", "_definition", "_hold", "_request", "_waiter")

    def __init__(
        self, coordinator: Coordinator, attempt: _Attempt, definition: Op[..., Any], hold: Hold
    ) -> None:
        self._coordinator = coordinator
        self._attempt = attempt
        self._definition = definition
        self._hold = hold
        self._request: _Request | None = None
        self._waiter: Waiter | None = None

    def ask(self) -> None:
        """Ask the next shard, or run the op once every shard has granted."""
        attempt, coordinator = self._attempt, self._coordinator
        ask = attempt.next_ask()
        if ask is None:
            self._decide()
            return
        shard, keys = ask
        services = coordinator._services
        op_id = attempt.run.envelope.op_id
        request = coordinator.grant_request(op_id, attempt.attempt, shard, keys)
        waiter = services.mailbox.expect_grant(op_id, services.home.shard, attempt.attempt, shard)
        # (A hand-over comes from a message handler or this worker's participant, and the
        # poll from a timer: each goes on in the step loop's task.)
        waiter.on_wake = lambda: services.in_step_loop(lambda: self._woken(waiter))
        self._request, self._waiter = request, waiter
        if not coordinator.send_now(request):  # (its owner is looked up in a task)
            self._to_task(None)
            return
        services.mailbox.call_within(services.poll, lambda: self._polled(waiter))

    def _woken(self, waiter: Waiter) -> None:
        if waiter is not self._waiter or waiter.on_wake is None:
            return  # (another ask's, or ended)
        message = waiter.message
        if not isinstance(message, KeyGrant):
            self._to_task(waiter)  # (a wake-up: the task reads the record)
            return
        assert self._request is not None, "asking"
        try:
            grant = self._coordinator.of_keys(message, self._request.keys)
        except WriteChainBroken as exc:
            self._fail(exc)
            return
        waiter.stop()
        self._attempt.granted(grant, self._request.keys)
        self.ask()

    def _polled(self, waiter: Waiter) -> None:
        if waiter is not self._waiter or waiter.on_wake is None:
            return
        services = self._coordinator._services
        if services.home.ended:  # (nothing it takes in commits any more)
            waiter.stop()
        else:
            services.in_step_loop(lambda: self._poll(waiter))

    def _poll(self, waiter: Waiter) -> None:
        if waiter is not self._waiter or waiter.on_wake is None:
            return
        self._to_task(waiter)

    def _to_task(self, waiter: Waiter | None) -> None:
        """Go on in a task: from the grant ``waiter`` waits for, or (None) from asking the
        current shard again."""
        current = self._waiter
        assert current is not None and self._request is not None, "asking"
        current.on_wake = None
        waiting = None
        if waiter is None:
            current.forget()
        else:
            current.woken()  # (the task reads the record first)
            waiting = _Waiting(current, self._request)
        self._coordinator.continue_in_task(self._attempt, self._hold, waiting)

    def _decide(self) -> None:
        coordinator, attempt = self._coordinator, self._attempt
        executor = coordinator._services.home.executor
        evaluated = executor.evaluate_now(
            attempt.run.envelope, attempt.states, attempt.fences, self._definition
        )
        record, notice = coordinator.decision_record(attempt, evaluated)

        def committed(record: Record) -> None:
            if record.error is not None:
                self._fail(record.error)
                return
            coordinator.decided(attempt, record, notice)
            coordinator._services.home.release(self._hold)

        record.on_committed = committed
        coordinator._services.record_with_step(record)

    def _fail(self, error: Exception) -> None:
        """End the runner with ``error``."""
        if (waiter := self._waiter) is not None and waiter.on_wake is not None:
            waiter.stop()
        self._coordinator._services.fail(error)
