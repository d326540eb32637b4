"""Where a client's submits take their outcomes from: the records the op's shard stores.

A reply message only says "look now". Every client of a client user may publish on its
service's reply channels, so a message's outcome could be anyone's word; a record in a shard's
results hash only a worker's script writes. So a submit settles with what the shard stores
under its op id, read (and, with durability asked for, confirmed) after the reply came, or
when the sweep finds the reply overdue. The record must also be this op's: an outcome stored
with another op's binding answers the submit with the refusal a worker gives such an op.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio

from .._backend.backend import Backend
from .._backend.commands import raise_errors
from .._backend.durability import stored_confirmed
from .._backend.signers import SignersMet
from .._scripts.refusals import Refused
from .._settings import Settings
from .._wire.codec import decode_outcome, says_unknown, taken_outcome
from .._wire.layout import ShardKeys, answered_field
from .._wire.signing import ReplyVerifier
from ..errors import BackendUnavailable
from .pending import Pending

log = logging.getLogger("keyserial.client")

Outcome = dict[str, Any]
_ANSWERED = answered_field("")
#: The members a reply adds to an outcome, naming what it answers (``_wire.codec.reply_outcome``).
_ADDRESS = frozenset(("s", "g", "e"))


class StoredOutcomes:
    """Settles waiting submits (op id -> its submits) from the records their shards store."""

    def __init__(
        self, backend: Backend, settings: Settings, waiting: Mapping[str, list[Pending]]
    ) -> None:
        self._backend = backend
        self._settings = settings
        self._waiting = waiting

    async def settle(self, keys: ShardKeys, op_ids: Sequence[str]) -> list[str]:
        """Settle the submits of ``op_ids`` (all on ``keys``' shard) whose outcome the shard
        stores, once confirmed as durable; the op ids it stores no outcome for (an answer
        recorded for another entry of the op id is none). (One stored but not confirmed yet is
        neither: the next look finds it confirmed.)

        :raises BackendUnavailable: if the server does not answer.
        """
        fields = _fields(op_ids)
        found, confirmed = await stored_confirmed(
            self._backend, self._settings.durability, keys, fields
        )
        return self._settle_found(op_ids, found, confirmed)

    async def settle_replied(self, replied: Mapping[ShardKeys, Sequence[str]]) -> list[str]:
        """:meth:`settle` for ops a reply named, by shard (all of one node), each as the one
        results field its reply points to: the op id, or its answer not stored (the reply said
        UnknownOperation). Without durability, one round trip reads the current generation,
        and only what it lacks is looked for in the previous one. The op ids with no outcome
        there."""
        if self._settings.durability is not None:  # (a WAIT per shard: see stored_confirmed)
            return [
                op_id
                for keys, fields in replied.items()
                for op_id in await self.settle(keys, [_op_id(field) for field in fields])
            ]
        left = []
        for field, value in (await self._current_then_previous(replied)).items():
            op_id = _op_id(field)
            pair = (value, None) if field == op_id else (None, value)
            left += self._settle_found([op_id], pair, confirmed=True)
        return left

    async def _current_then_previous(
        self, wanted: Mapping[ShardKeys, Sequence[str]]
    ) -> dict[str, bytes | None]:
        """The values of results fields, from the current generation, else the previous one.
        (Fields of one op are on one shard: a reply names its op's home shard.)"""
        shards = list(wanted.items())
        current = raise_errors(
            await self._backend.pipeline(
                [("HMGET", keys.results, *fields) for keys, fields in shards]
            )
        )
        found: dict[str, bytes | None] = {}
        missing: list[tuple[ShardKeys, list[str]]] = []
        for (keys, fields), values in zip(shards, current, strict=True):
            found.update(zip(fields, values, strict=True))
            if absent := [
                field for field, value in zip(fields, values, strict=True) if value is None
            ]:
                missing.append((keys, absent))
        if missing:
            previous = raise_errors(
                await self._backend.pipeline(
                    [("HMGET", keys.results_old, *fields) for keys, fields in missing]
                )
            )
            for (_, fields), values in zip(missing, previous, strict=True):
                found.update(zip(fields, values, strict=True))
        return found

    def _settle_found(
        self, op_ids: Sequence[str], found: Sequence[bytes | None], confirmed: bool
    ) -> list[str]:
        left = []
        for at, op_id in enumerate(op_ids):
            stored, answered = found[2 * at], found[2 * at + 1]
            waiters = list(self._waiting.get(op_id, ()))
            outcomes = [_outcome_for(pending, stored, answered) for pending in waiters]
            if stored is None and all(outcome is None for outcome in outcomes):
                left.append(op_id)
            elif confirmed:
                for pending, outcome in zip(waiters, outcomes, strict=True):
                    if outcome is not None:
                        pending.settle(outcome)
        return left


def _op_id(field: str) -> str:
    """The op id of a results field (a waiting op's id never holds '#')."""
    return field.removesuffix(_ANSWERED)


def _fields(op_ids: Sequence[str]) -> list[str]:
    """The results fields of ``op_ids``: each one's outcome, and its answer not stored."""
    return [field for op_id in op_ids for field in (op_id, answered_field(op_id))]


def _outcome_for(pending: Pending, stored: bytes | None, answered: bytes | None) -> Outcome | None:
    """The outcome the records give ``pending``: the stored one (see :func:`own_outcome`), else the
    answer recorded for the very entry it appended (a refusal of an op no worker knew: a
    resubmit waits for its own); or None."""
    if stored is not None:
        return own_outcome(pending.op_id, decode_outcome(stored), pending.binding)
    if answered is None:
        return None
    outcome = decode_outcome(answered)
    entries = outcome.pop("e", ())
    if pending.entry is None or pending.entry.place not in entries:
        return None
    return outcome


def signed_outcome_for(pending: Pending, answer: Outcome) -> Outcome | None:
    """The outcome a signed reply's ``answer`` gives ``pending``, if it answers the very entry
    that ``pending`` appended to its shard, of the layout generation it appended to (see
    ``_wire.codec.reply_outcome``); else None (looked up instead: one that came before the
    append's own reply did, or a worker's genuine answer to an entry a client user appended
    to another shard, of this layout or an older one, under the same entry id). A reply with
    no generation (a worker of an older version) is looked up too."""
    entries = answer.get("e")
    if (
        pending.entry is None
        or answer.get("s") != pending.shard.shard
        or answer.get("g") != pending.shard.generation
        or not isinstance(entries, list)
        or pending.entry.place not in entries
    ):
        return None
    outcome = {name: value for name, value in answer.items() if name not in _ADDRESS}
    return own_outcome(pending.op_id, outcome, pending.binding)


def settle_signed(
    answers: Sequence[tuple[str, Outcome]], waiting: Mapping[str, list[Pending]]
) -> list[tuple[str, bool]]:
    """Settle the submits that a signed reply's ``answers`` answer; the op ids it names that
    still have submits waiting, each with whether it said UnknownOperation (to look up)."""
    left = []
    for op_id, answer in answers:
        unsettled = False
        for pending in waiting.get(op_id, ()):
            outcome = signed_outcome_for(pending, answer)
            if outcome is None:
                unsettled = True
            else:
                pending.settle(outcome)
        if unsettled:
            left.append((op_id, says_unknown(answer)))
    return left


def own_outcome(op_id: str, outcome: Outcome, binding: Callable[[], str]) -> Outcome:
    """An outcome stored under ``op_id``, as the answer of the op bound to ``binding()``:
    stored with another op's binding, it gives the refusal of an id taken."""
    bound_to = outcome.pop("b", None)
    if bound_to is not None and bound_to != (binding() or None):
        return decode_outcome(taken_outcome(op_id))
    return outcome


class ReplyLookups:
    """Looks up the outcomes that reply messages announce; :meth:`run` in a task of the
    client's. One lookup in flight per Redis node, for the ops of all its shards in one round
    trip (a stalled node holds up its own shards only); the op ids announced meanwhile are
    coalesced into the next. A message naming an op with no stored outcome (a forged one)
    settles nothing; a failed lookup leaves its ops to the sweep."""

    def __init__(
        self,
        backend: Backend,
        outcomes: StoredOutcomes,
        settings: Settings,
        waiting: Mapping[str, list[Pending]],
        verifier: ReplyVerifier,
    ) -> None:
        self._backend = backend
        self._namespace = settings.namespace
        #: The signers of replies that this client has not met yet (``verified``'s callback).
        self.signers = SignersMet(
            verifier, log, what="reply signers", meanwhile="their replies are looked up"
        )
        self._outcomes = outcomes
        self._waiting = waiting
        #: Results fields to look up, by node and shard, in the order replies named them (the
        #: order their ops settle in); the nodes with a lookup in flight, and those due one.
        self._due: dict[str, dict[ShardKeys, dict[str, None]]] = defaultdict(
            lambda: defaultdict(dict)
        )
        self._looking: set[str] = set()
        self._ready: set[str] = set()
        # (An asyncio event: replies arrive in a callback of the client's loop, outside any
        # task, where anyio cannot tell which library runs it.)
        self._wake = asyncio.Event()

    def announced(self, replied: Sequence[tuple[str, bool]]) -> None:
        """A reply message named these ops, each with whether it said UnknownOperation (an
        answer recorded apart): look up those still waiting."""
        for op_id, unknown in replied:
            waiters = self._waiting.get(op_id)
            if not waiters:
                continue
            shard = waiters[0].shard
            node = self._backend.node_of(shard.stream)
            self._due[node][shard][answered_field(op_id) if unknown else op_id] = None
            if node not in self._looking:
                self._ready.add(node)
                self._wake.set()

    async def run(self) -> None:
        """Start a lookup for each node that has ops due and none in flight, and read the keys
        of the signers met, until cancelled."""
        async with anyio.create_task_group() as group:
            group.start_soon(
                self.signers.learn,
                partial(self._backend.signer_records, self._namespace),
                self._backend.outage,
            )
            while True:
                await self._wake.wait()
                self._wake.clear()
                for node in self._ready:
                    self._looking.add(node)
                    group.start_soon(self._look_up, node)
                self._ready.clear()

    async def _look_up(self, node: str) -> None:
        due = self._due[node]
        try:
            while due:
                by_shard = {shard: list(ids) for shard, ids in due.items()}
                due.clear()
                await self._settle(by_shard)
        finally:
            self._looking.discard(node)

    async def _settle(self, by_shard: dict[ShardKeys, list[str]]) -> None:
        try:
            left = await self._outcomes.settle_replied(by_shard)
        except (BackendUnavailable, Refused, ValueError) as exc:
            message = "looking up the outcomes of ops replied: %s (the sweep looks again)"
            self._warn(exc, message, exc)
            return
        if left:
            log.warning(
                "ignoring replies for ops %s: their shards store no outcome for them"
                " (a forged reply?)",
                _few(left),
            )

    def _warn(self, error: Exception, message: str, *args: object) -> None:
        """Log a failed read: once per outage if Redis did not answer."""
        if isinstance(error, BackendUnavailable):
            self._backend.outage.warn(log, message, *args)
        else:
            log.warning(message, *args)


def _few(op_ids: Sequence[str]) -> str:
    shown = ", ".join(map(json.dumps, op_ids[:3]))
    return shown if len(op_ids) <= 3 else f"{shown} and {len(op_ids) - 3} more"
