"""A participant shard's side of a cross-shard op: run a grant request (hold the keys, grant
their committed states to the coordinator), then apply the decision for them. A request comes
from the coordinator's worker in a coordination message (or in process), never from a stream;
the runner checks it by this module's rules (:func:`request_refusal`) and queues its run behind
the ops taken in on its keys (``ShardRunner.take_request``).

The request's barrier holds the keys (only they wait; the shard's other keys keep flowing) from
the grant until the decision is known, so the states the coordinator computed on stay current.
A participant that cannot learn the decision because its coordinator lost the home shard writes
an abort on the attempt's decision record, set-if-absent: a commit and an abort never both win.

On a standalone server the grant is *lent*: it names this owner's epoch, and the home's step
writes the keys itself, fenced by that epoch, so a shard that changed hands since refuses it.
The participant then records no hold, takes no step for the op and writes nothing: it grants
once the keys' states are committed, and takes the decision's writes into its cache. On a
cluster, where a script reaches one shard only, it records a hold in the shard's held hash and
applies the decision with its own step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import Any

from ..._scripts.cross import ResolveArgs, resolve
from ..._scripts.refusals import AttemptAhead
from ..._wire.json_text import dumps, loads
from ..._wire.layout import part_id
from ..._wire.messages import Decision, DecisionNotice, GrantRequest, KeyGrant, MalformedMessage
from ..._wire.routing import shard_for
from ...errors import BackendUnavailable
from ..chains import Hold
from ..commits import Record
from ..execution import Run
from .coordination import RunnerServices
from .mailbox import Waiter

log = logging.getLogger("keyserial.worker")

_APPLIED = '{"ok":"applied"}'
_RELEASED = '{"ok":"released"}'


class Participant:
    """Grants a shard's keys to cross-shard ops homed on lower shards."""

    def __init__(self, services: RunnerServices) -> None:
        self._services = services

    def start_now(self, run: Run) -> bool:
        """Grant a request from another worker's coordinator with no task, if its keys are idle
        now (nothing queued on them, their states cached): hold them, record the grant with the
        next step, and apply the decision when it is handed over (:class:`_Granting`). False,
        with nothing done, where a task has to wait instead: a key busy, a malformed request, or
        a coordinator in this worker (its grant waits for the keys' writes to commit), or a hold
        a takeover found recorded."""
        services, request = self._services, run.request
        if request is None or run.recorded or services.mailbox.is_mine(request.channel):
            return False
        hold = services.home.try_hold(run.envelope.keys, committed=False)
        if hold is None:
            return False
        _Granting(self, run, request, hold).begin()
        return True

    @property
    def lends(self) -> bool:
        """Whether grants are lent (see the module's docstring): on a standalone server."""
        return self._services.backend.one_script_reaches_every_shard

    async def grant(self, run: Run) -> None:
        """Run a grant request once its barrier holds the requested keys (or, ``recorded``, a
        hold a takeover found: its decision is read at once)."""
        services, request = self._services, run.request
        assert request is not None, "a grant request's run"
        with services.mailbox.expect_decision(
            request.op_id, request.home, request.attempt
        ) as waiter:
            await services.home.load_states(run.envelope.keys)  # (the decision writes them)
            if run.recorded:
                waiter.woken()  # (its notice went to the last owner)
            else:
                key_grant = self.key_grant(request, run.envelope.keys)
                if not await self._send(request, key_grant):
                    self.over_already(run)
                    return
                run.grant = key_grant  # (sent: a request that comes again gets it again)
            decision = await self.await_decision(waiter, request)
        self.settle(run, request, decision)

    def over_already(self, run: Run) -> None:
        """End a request whose hold the step skipped: its attempt's part here is over (the
        request came again after it), so nothing is held, applied or stored."""
        self._services.finish(run, _RELEASED, store=False, replies=[])

    def key_grant(self, request: GrantRequest, keys: tuple[str, ...]) -> KeyGrant:
        """The grant of ``keys``, held for ``request``: their states now (committed by the step
        that records the grant, before it), and a fencing token for the op."""
        services = self._services
        home = services.home
        log.debug(
            "shard %d (epoch %d): granting keys %s to %s#%d of shard %d",
            home.shard,
            home.epoch,
            list(keys),
            request.op_id,
            request.attempt,
            request.home,
        )
        return KeyGrant(
            request.op_id,
            request.attempt,
            home.shard,
            [(key, home.states[key]) for key in keys],
            home.executor.next_fence(),  # the granted keys' fencing token, for the op
            services.mailbox.channel_for(request.home),  # (the decision's script's slot)
            request.home,
            home.epoch if self.lends else None,
        )

    def settle(self, run: Run, request: GrantRequest, decision: Decision | None) -> None:
        """Apply the attempt's decision (None: nobody asked) and answer the request."""
        services, envelope = self._services, run.envelope
        home = services.home
        if run.grant is not None and run.grant.epoch is not None:
            self._settle_lent(run, run.grant, decision)
            return
        held = part_id(request.op_id, request.home, request.attempt)
        if decision is None:  # nobody asked: nothing is stored, so the attempt may still begin
            services.finish(run, _RELEASED, store=False, replies=[], releases=held)
            return
        log.debug(
            "shard %d (epoch %d): %s#%d decided: %s",
            home.shard,
            home.epoch,
            request.op_id,
            request.attempt,
            "aborted" if decision.aborted is not None else "committed",
        )
        if decision.aborted is not None:
            services.finish(run, _RELEASED, store=True, replies=[], releases=held)
            return
        mine = set(envelope.keys)
        for key, state in decision.writes_of(home.shard):
            if key in mine:
                home.states.write(key, state or None)
        services.finish(run, _APPLIED, store=True, replies=[], releases=held)

    def _settle_lent(self, run: Run, grant: KeyGrant, decision: Decision | None) -> None:
        """End a lent grant: nothing to write or store (the home's step wrote the keys, or
        nothing did). The decision's writes for this shard are cached as committed only if it
        names this very grant: a decision read for a request sent again after its attempt was
        decided (a captured message replayed) was written under an earlier grant, whose writes
        the cache has taken already, and may have been overwritten since."""
        services = self._services
        home = services.home
        if (
            decision is not None
            and decision.aborted is None
            and decision.lent.get(home.shard) == grant.fence
        ):
            mine = set(run.envelope.keys)
            for key, state in decision.writes_of(home.shard):
                if key in mine:
                    home.committed(key, state or None)
        services.end_request(run)

    def grant_record(self, request: GrantRequest, key_grant: KeyGrant) -> Record:
        """The grant's record: the hold in the shard's held hash, until the step that applies
        or releases it (:meth:`granted` sends the grant once it has committed). A lent grant
        records nothing: its record only waits for the step that commits the keys' earlier
        writes, if any are pending (see :meth:`needs_step`). (A record, not
        ``KeyStates.flush``: the step sets its ``error`` when the replicas did not confirm
        those writes, where a flush returns all the same; and it calls back with no task.)"""
        if key_grant.epoch is not None:
            return Record("", "", [])
        field = part_id(request.op_id, request.home, request.attempt)
        return Record(field, dumps(key_grant.to_wire()), [], hold=True)

    def needs_step(self, key_grant: KeyGrant) -> bool:
        """Whether the grant goes out only after the next step: a hold to record, or (lent)
        some granted key's write or earlier op's outcome still to commit (a grant's state is a
        committed one; see ``KeyStates.answered``)."""
        if key_grant.epoch is None:
            return True
        return not self._services.home.states.all_committed(key for key, _ in key_grant.states)

    def grant_again(self, run: Run, request: GrantRequest) -> None:
        """``request`` came for the attempt's part that ``run`` holds under a lent grant sent
        already (the grant's message lost, the coordinator asked again): send it the same
        grant. (A recorded hold's grant is read from its record by the coordinator's poll
        instead.) If another request took the part first, for other keys, its coordinator sees
        a grant of keys it did not ask for, and gives the attempt up, as it would reading the
        recorded one."""
        if run.grant is not None and run.grant.epoch is not None:
            self.granted(request, run.grant, None)

    def granted(self, request: GrantRequest, key_grant: KeyGrant, record: Record | None) -> None:
        """The grant's record committed (confirmed as durable where the settings ask), or a
        lent grant's keys are committed: send the grant to the coordinator, in process, or
        signed for its worker with whatever else this worker owes that one this round (the
        message is as good as the record, and saves the coordinator reading it back). Not for
        a hold the step skipped: nothing is held."""
        mailbox = self._services.mailbox
        if mailbox.is_mine(request.channel):
            mailbox.deliver(key_grant)
        else:
            value = record.value if record is not None and record.hold else None
            self._services.pipeliner.publish(request.channel, value or dumps(key_grant.to_wire()))

    async def _send(self, request: GrantRequest, key_grant: KeyGrant) -> bool:
        """Record the grant and send it to the coordinator: in process when the coordinator is
        this worker, else published once the step that records it has committed (and the
        replicas have it, where the settings ask). The step commits the granted keys' earlier
        writes first, in the same script, so the granted states are committed states. Recorded
        in process too: the record is what holds the keys for the shard's next owner, if this
        one loses the shard before the decision. False: the step skipped the hold (see
        :meth:`over_already`), and nothing was sent."""
        record = self.grant_record(request, key_grant)
        if self.needs_step(key_grant):
            await self._services.commit_record(record)
        if record.skipped:
            return False
        self.granted(request, key_grant, record)
        return True

    async def await_decision(self, waiter: Waiter, request: GrantRequest) -> Decision | None:
        """The attempt's decision: handed over in process by this worker's coordinator, or read
        (or, if the coordinator stopped, written as an abort) in the home shard. A notice
        through Redis only says when to read: its payload is never applied. None: the attempt
        has not begun (a forged or garbled request), and the keys are to be released."""
        services = self._services
        there = services.layout.keys(request.home)
        while True:
            if isinstance(message := await waiter.within(services.poll), DecisionNotice):
                return message.decision
            try:
                # Durably: a decision read from a master that a failover has left behind (its
                # WAIT fails there) is not applied; it is read again where the shard lives now.
                record = await services.pipeliner.run_durably(
                    resolve(there, ResolveArgs(request.op_id, request.attempt))
                )
            except BackendUnavailable as exc:
                log.warning("shard %d: waiting for a decision: %s", services.home.shard, exc)
                continue
            except AttemptAhead as exc:
                log.warning(
                    "shard %d: releasing keys held for %s: %s",
                    services.home.shard,
                    request.op_id,
                    exc,
                )
                return None
            if record is not None:
                log.debug(
                    "shard %d: the decision of %s#%d read in shard %d",
                    services.home.shard,
                    request.op_id,
                    request.attempt,
                    request.home,
                )
                return Decision.from_wire(record)


class _Granting:
    """A grant request taken in with no task (:meth:`Participant.start_now`), from its hold to
    its answer: its grant recorded with the next step, then the decision applied when the
    coordinator's worker hands it over (signed). A wake-up with no decision in hand, or a poll
    with none yet, hands the rest to a task that reads the records, as :meth:`Participant.grant`
    does."""

    __slots__ = ("_hold", "_participant", "_recorded", "_request", "_run", "_waiter")

    def __init__(self, participant: Participant, run: Run, request: GrantRequest, hold: Hold):
        self._participant = participant
        self._run = run
        self._request = request
        self._hold = hold
        self._recorded = False
        services = participant._services
        self._waiter = services.mailbox.expect_decision(
            request.op_id, request.home, request.attempt
        )
        # (A wake-up comes from a message handler or this worker's coordinator, and the poll
        # from a timer: each goes on in the step loop's task.)
        self._waiter.on_wake = lambda: services.in_step_loop(self._woken)

    def begin(self) -> None:
        participant, request = self._participant, self._request
        services = participant._services
        key_grant = participant.key_grant(request, self._run.envelope.keys)
        record = participant.grant_record(request, key_grant)
        services.mailbox.call_within(services.poll, self._polled)
        if not participant.needs_step(key_grant):
            self._committed(record, key_grant)
            return
        record.on_committed = lambda record: self._committed(record, key_grant)
        services.record_with_step(record)

    def _polled(self) -> None:
        if self._waiter.on_wake is None:
            return  # (ended, or a task has taken over)
        services = self._participant._services
        if not services.home.ended:
            services.in_step_loop(self._poll)
        else:  # (nothing it takes in commits any more)
            self._waiter.stop()

    def _committed(self, record: Record, key_grant: KeyGrant) -> None:
        if record.error is not None:
            self._waiter.stop()
            self._participant._services.fail(record.error)
            return
        if record.skipped:
            self._waiter.stop()
            participant = self._participant
            if not participant._services.home.ended:
                participant.over_already(self._run)
                participant._services.home.release(self._hold)
            return
        self._recorded = True
        self._run.grant = key_grant  # (sent: a request that comes again gets it again)
        self._participant.granted(self._request, key_grant, record)
        waiter = self._waiter
        if isinstance(waiter.message, DecisionNotice) or waiter.pending:  # (woken meanwhile)
            self._woken()

    def _woken(self) -> None:
        if self._waiter.on_wake is None:
            return  # (ended, or a task has taken over)
        if not self._recorded:
            self._waiter.woken()  # (looked at once the grant is recorded)
            return
        message = self._waiter.message
        if isinstance(message, DecisionNotice):
            self._waiter.stop()
            self._end(message.decision)
        else:
            self._end_with_task(self._read_decision())

    def _poll(self) -> None:
        if self._waiter.on_wake is None:
            return  # (ended, or a task has taken over)
        services = self._participant._services
        if self._recorded:
            self._end_with_task(self._read_decision())
        else:  # (its step has not come back yet)
            services.mailbox.call_within(services.poll, self._polled)

    def _end(self, decision: Decision | None) -> None:
        self._waiter.on_wake = None
        participant = self._participant
        home = participant._services.home
        if not home.ended:  # (else nothing it takes in commits: the next owner runs it again)
            participant.settle(self._run, self._request, decision)
            home.release(self._hold)

    def _end_with_task(self, task: Coroutine[Any, Any, None]) -> None:
        """Hand the rest to a task in the runner's task group (none, if it has stopped)."""
        self._waiter.on_wake = None
        if not self._participant._services.spawn(lambda: task):
            task.close()
            self._waiter.forget()

    async def _read_decision(self) -> None:
        with self._waiter:
            self._waiter.woken()
            decision = await self._participant.await_decision(self._waiter, self._request)
        self._end(decision)


def request_refusal(
    request: GrantRequest, shard: int, name: str, shard_count: int, result_ttl_ms: int
) -> str | None:
    """Why the owner of ``shard`` (named ``name`` in its layout generation) does not take
    ``request``, signed for it as it is; None if it does. (Its coordinator asks again after a
    poll: a refusal loses nothing.)"""
    if request.target != name:
        return f"it is for shard {request.target!r}"
    if not 0 <= request.home < shard or "#" in request.op_id:
        return "its home or op id cannot be a coordinator's"
    if any(shard_for(key, shard_count) != shard for key in request.keys):
        return "it names keys of other shards"
    if abs(time.time() * 1000 - request.at) > result_ttl_ms / 2:
        # (A copy: what became of its attempt is kept at least result_ttl, by the server's
        # clock; half of it is left for the clocks of two workers to disagree.)
        return "it was made more than half of result_ttl away from now"
    return None


def held_request(field: str, raw: bytes, name: str) -> GrantRequest | None:
    """The request a hold recorded in shard ``name``'s held hash was taken for; None, logged,
    for a record that is not a grant of its field's part (only workers write there: such a
    record is a defect, and what it holds cannot be held again)."""
    try:
        grant = KeyGrant.from_wire(loads(raw.decode()))
    except (ValueError, MalformedMessage) as exc:
        log.error("shard %s: an unreadable hold %s: %s", name, field, exc)
        return None
    if grant.home < 0 or part_id(grant.op_id, grant.home, grant.attempt) != field:
        log.error("shard %s: hold %s is not a grant of that part: %r", name, field, raw)
        return None
    keys = tuple(key for key, _ in grant.states)
    return GrantRequest(grant.home, grant.op_id, grant.attempt, name, keys, "", 0)
