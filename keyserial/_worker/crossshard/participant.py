"""A participant shard's side of a cross-shard op: run a grant request (hold the keys, grant
their committed states to the coordinator), then apply the decision for them.

The request's barrier holds the keys (only they wait; the shard's other keys keep flowing) from
the grant until the decision is known, so the states the coordinator computed on stay current.
A participant that cannot learn the decision because its coordinator lost the home shard writes
an abort on the attempt's decision record, set-if-absent: a commit and an abort never both win.
"""

from __future__ import annotations

import logging

from ..._scripts.cross import ResolveArgs, resolve
from ..._scripts.refusals import AttemptAhead
from ..._wire.codec import encode_error
from ..._wire.json_text import dumps
from ..._wire.layout import grant_field
from ..._wire.messages import Decision, DecisionNotice, GrantRequest, KeyGrant, MalformedMessage
from ...errors import BackendUnavailable, MalformedOperation
from ..commits import Record
from ..execution import Run
from ..writes import WriteChainBroken
from .coordination import RunnerServices
from .mailbox import Waiter

log = logging.getLogger("keyserial.worker")

_APPLIED = '{"ok":"applied"}'
_RELEASED = '{"ok":"released"}'


class Participant:
    """Grants a shard's keys to cross-shard ops homed on lower shards."""

    def __init__(self, services: RunnerServices) -> None:
        self._services = services

    async def grant(self, run: Run) -> None:
        """Run a grant request once its barrier holds the requested keys."""
        services, envelope = self._services, run.envelope
        home = services.home
        try:
            request = GrantRequest.from_wire(envelope.kwargs, below=home.shard)
        except MalformedMessage as exc:
            outcome = encode_error(MalformedOperation.wire_type, str(exc))
            services.finish(run, outcome, store=True, replies=list(run.replies))
            return
        log.debug(
            "shard %d (epoch %d): granting keys %s to %s#%d of shard %d",
            home.shard,
            home.epoch,
            list(envelope.keys),
            request.op_id,
            request.attempt,
            request.home,
        )
        with services.mailbox.expect_decision(request.op_id, request.attempt) as waiter:
            key_grant = KeyGrant(
                request.op_id,
                request.attempt,
                home.shard,
                [(key, home.states[key]) for key in envelope.keys],
                home.executor.next_fence(),  # the granted keys' fencing token, for the op
                services.mailbox.channel_for(request.home),  # (the decision's script's slot)
            )
            await self._send(request, key_grant, run.entries[0].entry_id)
            decision = await self._await_decision(waiter, request)
        if decision is None:  # nobody asked: nothing is stored, so the attempt may still begin
            services.finish(run, _RELEASED, store=False, replies=[])
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
            services.finish(run, _RELEASED, store=True, replies=[])
            return
        mine = set(envelope.keys)
        for key, state in decision.writes_of(home.shard):
            if key in mine:
                home.states.write(key, state or None)
        services.finish(run, _APPLIED, store=True, replies=[])

    async def _send(self, request: GrantRequest, key_grant: KeyGrant, entry_id: str) -> None:
        """Record the grant and send it to the coordinator: in process when the coordinator is
        this worker, else published once the step that records it has committed (and the
        replicas have it, where the settings ask). The step commits the granted keys' earlier
        writes first, in the same script, so the granted states are committed states."""
        services = self._services
        home = services.home
        in_process = services.mailbox.is_mine(request.channel)
        durable = services.settings.durability is not None
        if in_process and not durable:
            # (No record is needed: an in-process message cannot be lost, and a grant writes
            # nothing, so this worker's zombie could not change anything by granting. But the
            # granted states must be committed ones, and a broken write chain's cache may not be
            # Redis's: it grants nothing from it.)
            await home.states.flush(key for key, _ in key_grant.states)
            if home.write_chain.broken:
                raise WriteChainBroken(
                    f"shard {home.shard} grants nothing: its write chain is broken"
                )
            services.mailbox.deliver(key_grant)
            return
        # Signed for the coordinator's worker (by the pipeliner, which batches what this worker
        # owes that one), the message is as good as the record: it takes it without reading
        # the record back.
        grant = dumps(key_grant.to_wire())
        messages = [] if in_process else [(request.channel, grant)]
        field = grant_field(request.op_id, request.attempt)
        # (A step that finds the request's entry gone, as a failover that lost entries this
        # owner fetched leaves it, writes nothing, and the owner gives its shard up: its holds
        # follow a stream order that Redis no longer has.)
        await services.commit_record(Record(field, grant, entry_id, messages))
        if in_process:
            services.mailbox.deliver(key_grant)

    async def _await_decision(self, waiter: Waiter, request: GrantRequest) -> Decision | None:
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
