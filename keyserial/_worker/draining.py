"""A shard sealed for a reshard, as its owner drains it, and the layouts before a reshard, as a
new shard's owner answers from them.

A seal stops clients' appends (``submit.lua``). The owner runs what was appended before it,
forwards what a client appended past it some other way (an older client, a plain ``RPUSH``) to
the op's shard in the new layout, and records the shard drained once nothing but forwards is
under way: the mover flips once every old shard has said so twice, with no op run between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio

from .._backend.backend import Backend
from .._logfields import fields as log_fields
from .._scripts.commit import StepReply
from .._scripts.reshard import record_drained
from .._wire.codec import decode_entry_leniently, parse_id
from .._wire.layout import Layout, ShardKeys
from .._wire.resharding import Seal
from .._wire.routing import home_shard
from .commits import Finished
from .execution import Run
from .strays import Strays, forward, forward_inbox

log = logging.getLogger("keyserial.worker")

#: Runs a call again while Redis is unreachable (the runner's ``_retrying``).
Retrying = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: Runs a script fenced by the owner's epoch (the runner's ``fenced``).
Fenced = Callable[..., Awaitable[Any]]


class Drain:
    """One shard's seal, as its owner sees it: which entries run here, which are forwarded,
    and when the shard is drained (:meth:`due`, :meth:`record`)."""

    def __init__(
        self,
        keys: ShardKeys,
        epoch: int,
        backend: Backend,
        *,
        retrying: Retrying,
        fenced: Fenced,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool],
        finish: Callable[[Finished], None],
    ) -> None:
        self._keys = keys
        self._epoch = epoch
        self._backend = backend
        self._retrying = retrying
        self._fenced = fenced
        self._spawn = spawn
        self._finish = finish
        #: The seal of a reshard that moves this shard's keys elsewhere (see :meth:`seal_with`).
        self.seal: Seal | None = None
        #: What this owner last recorded it drained up to, with the count of ops it had run.
        self._drained_at: tuple[str, int] | None = None
        #: Ops appended past the seal, taken in to be forwarded, not committed yet: not work of
        #: this shard's (however many a client appends, they never keep it from draining).
        self._forwarded: set[str] = set()
        #: Ops this owner has run (not those it forwarded): the mover sees any change.
        self._ran = 0
        #: The last fetch reached the end of the stream (see :meth:`fetched`).
        self.fetched_all = False
        #: Forwards go out one at a time, in the order of their entries (a FIFO lock): ops on a
        #: key keep their order in the new layout.
        self._forwarding = anyio.Lock()
        #: A pass of :meth:`forward_inbox` is under way.
        self._forwarding_inbox = False

    def fetched(self, *, reached_end: bool) -> None:
        """A step fetched entries; ``reached_end``: fewer than it asked for."""
        self.fetched_all = reached_end

    def committed(self, batch: Iterable[Finished]) -> None:
        """A step committed ``batch`` (a forwarded op, once forwarded). Once a step, not once
        an op: forwards are rare, and none are under way unless the shard is sealed."""
        if self._forwarded:
            self._forwarded.difference_update(finished.op_id for finished in batch)

    def seal_with(self, seal: Seal) -> bool:
        """Take the seal; False if the shard was sealed already."""
        if self.seal is not None:
            return False
        self.seal = seal
        log.info(
            "shard %d: sealed for a reshard to %d shards (entries up to %s stay here)",
            self._keys.shard,
            seal.target.shards,
            seal.last,
            extra=log_fields(shard=self._keys.shard, epoch=self._epoch),
        )
        return True

    def past_seal(self, entry_id: str) -> bool:
        """Whether ``entry_id`` was appended after this shard's seal (by a client of an older
        version, or a plain ``RPUSH``). What an op of such an entry is answered with, without
        running here (a refusal, a stored outcome), is replied, never stored: after the flip the
        new layout's owners look each op id up here (:class:`EarlierLayouts`), and a client user
        can read the id of an op waiting in the new layout and append it here past the seal
        (misrouted, say): stored, the refusal would answer that op, which would then never run.
        Ops that would run here are forwarded instead (:meth:`_forward`), and run in the new
        layout, once; a client that appended past the seal reads its refusal on its reply
        channel."""
        seal = self.seal
        return seal is not None and parse_id(entry_id) > parse_id(seal.last)

    def to_run(self, entry_id: str, runs: list[Run], *, from_stream: bool) -> list[Run]:
        """Of the runs of an entry taken in, those to run here: all of them, unless the entry
        was fetched from past the seal: then none, each forwarded to the new layout."""
        if from_stream and self.past_seal(entry_id):
            for run in runs:  # (if the runner has stopped meanwhile, the next owner forwards)
                self._forwarded.add(run.envelope.op_id)
                self._spawn(partial(self._forward, run))
            return []
        self._ran += len(runs)
        return runs

    def forward_inbox(self) -> None:
        """Forward what a client pushed to the inbox since the seal (with a plain ``RPUSH``: the
        submit script refuses a sealed shard), until it is empty, in the background. Such items
        are never moved into the stream (``step.lua``), where a client user could read their op
        ids and push its own ops under them to the new layout first. Not work of this shard's:
        the shard counts as drained whatever the inbox holds (after the flip the heir forwards
        the rest, see :mod:`.strays`)."""
        if self.seal is None or self._forwarding_inbox:
            return
        self._forwarding_inbox = True
        if not self._spawn(self._forward_inbox):
            self._forwarding_inbox = False

    async def _forward_inbox(self) -> None:
        assert self.seal is not None
        target = self.seal.target
        # (What cannot run goes to the dead letters of the shard's heir in the new layout, as
        # after the flip: the mover may have copied this shard's dead letters there already.)
        strays = Strays.of(self._keys, target, target)
        try:
            async with self._forwarding:
                while await self._retrying(lambda: forward_inbox(self._backend, strays)):
                    pass
        finally:
            self._forwarding_inbox = False

    def took_request(self) -> None:
        """A grant request's run was taken (from a message, or held again at a takeover): it
        counts as an op run, so a mover that read the shard drained before it sees a change.
        (A sealed shard still takes requests: their ops were appended before the seal.)"""
        self._ran += 1

    async def _forward(self, run: Run) -> None:
        """Append ``run``'s op to its home shard in the layout the seal names, then let the
        entry go as if the op had finished (nothing stored: it runs there). Forwarded again
        after a crash, the op runs once: its id finds the first one's outcome."""
        assert self.seal is not None
        target = self.seal.target
        async with self._forwarding:
            there = await self._retrying(lambda: forward(self._backend, run.envelope, target))
        op_id = run.envelope.op_id
        log.warning(
            "shard %d: op %s was appended after the shard was sealed for a reshard (an older"
            " client, or a plain RPUSH): forwarded to shard %d of the new layout",
            self._keys.shard,
            op_id,
            there.shard,
            extra=log_fields(shard=self._keys.shard, epoch=self._epoch, op_id=op_id),
        )
        self._finish(Finished(op_id, "", run.entries, [], store=False, run=run))

    def due(
        self, cursor: str, *, running: Iterable[str], finished: Iterable[str], uncommitted: int
    ) -> bool:
        """Whether to record the shard drained now: sealed, taken in up to the seal, and
        nothing under way or to commit but forwards (``running``, ``finished``: the op ids
        under way and waiting to commit; the caller has nothing else to commit), where the
        last record said otherwise."""
        through = self._drained_through(cursor)
        forwarded = self._forwarded
        return (
            through is not None
            and (through, self._ran) != self._drained_at
            and all(op_id in forwarded for op_id in running)
            and all(op_id in forwarded for op_id in finished)
            and uncommitted == len(forwarded)
        )

    def _drained_through(self, cursor: str) -> str | None:
        """The seal's entry, once this owner has taken in everything up to it: its cursor
        reached it, or a fetch reached the end of the stream. (Entries between can be gone: a
        step deletes the entries of ops that committed behind one still running, so XLEN counts
        what waits, and an owner that died with that one running leaves the cursor of the next
        owner behind them, with nothing to fetch up to the seal.) Never past it: what follows
        the seal is forwarded, by this owner or after the flip by the heir's (``strays``),
        which starts after the record."""
        seal = self.seal
        if seal is None:
            return None
        if parse_id(cursor) >= parse_id(seal.last):
            return seal.last
        return seal.last if self.fetched_all else None

    async def record(self, cursor: str) -> None:
        """Record that every entry up to the cursor has taken effect and nothing is under way,
        with the count of ops run: the reshard flips once every old shard says so, twice over
        with no op run between."""
        at = self._drained_through(cursor)
        assert at is not None
        ran = self._ran
        await self._fenced(record_drained(self._keys, self._epoch, at, ran), builds=False)
        self._drained_at = (at, ran)
        log.info(
            "shard %d: drained up to %s for the reshard",
            self._keys.shard,
            at,
            extra=log_fields(shard=self._keys.shard, epoch=self._epoch),
        )


def _to_look_up(fetched: StepReply, *, trust_fresh: bool) -> dict[str, set[tuple[str, ...]]]:
    """The op ids of ``fetched`` with no outcome in it, each with every set of keys it comes
    with (a client user may append a copy of an op's id with other keys, and the op's outcome
    is at the home of its own keys); ``trust_fresh``: leave out entries marked fresh."""
    missing: dict[str, set[tuple[str, ...]]] = {}
    for _, fields in fetched.entries:
        if trust_fresh and fields.get(b"fresh") == b"1":
            continue
        for envelope in decode_entry_leniently(fields):
            if envelope.op_id not in fetched.done:
                missing.setdefault(envelope.op_id, set()).add(envelope.keys)
    return missing


class EarlierLayouts:
    """The namespace's layouts before this one, newest first, each with when (ms) it stopped
    taking ops: an op appended again after a reshard finds its outcome there while it may be
    retained.

    On a cluster every batch an owner takes in is looked up there before it runs: one more
    round trip per batch. On a standalone server only a batch with an op appended again (no
    ``fresh`` mark: a caller's retry, a resubmit) or replayed is; the step that commits the
    others looks them up in the same script, and an outcome there refuses it (``Replayed``):
    only a client user appending a copy marked fresh meets that, and the owner then starts
    again, replaying, when every op is looked up first."""

    def __init__(
        self,
        history: Sequence[tuple[Layout, int]],
        backend: Backend,
        *,
        retrying: Retrying,
        result_ttl_ms: int,
    ) -> None:
        self._history = tuple(reversed(history))
        self._backend = backend
        self._retrying = retrying
        self._result_ttl_ms = result_ttl_ms
        #: Whether the step looks fresh ops up (one script reaches every shard's keys).
        self._in_step = backend.one_script_reaches_every_shard
        #: Each layout's shard keys, by shard.
        self._shards = {
            layout: [layout.keys(shard) for shard in range(layout.shards)] for layout, _ in history
        }

    def __bool__(self) -> bool:
        return bool(self._history)

    def _retained(self) -> list[Layout]:
        """The layouts whose results may still be retained, newest first."""
        retained_since = int(time.time() * 1000) - 2 * self._result_ttl_ms
        return [layout for layout, until in self._history if until >= retained_since]

    async def answer(self, fetched: StepReply, *, replaying: bool) -> None:
        """Add to ``fetched.done`` the outcomes stored in the layouts before a reshard of its ops
        that have none here, looked up at each op's home there (one round trip per layout,
        while its results may be retained). ``fresh`` ops too, on a cluster or while
        ``replaying``: ``fresh`` lets an owner skip looking up its own shard only because the
        commit refuses an op id that has an outcome there, and a cluster's step cannot see an
        earlier layout's (an entry copied as fresh by a client user would run twice)."""
        missing = _to_look_up(fetched, trust_fresh=self._in_step and not replaying)
        for layout in self._retained():
            if not missing:
                return
            by_home: dict[int, list[str]] = {}
            for op_id, key_sets in missing.items():
                for home in {home_shard(keys, layout.shards) for keys in key_sets}:
                    by_home.setdefault(home, []).append(op_id)
            wanted = [(layout.keys(home), op_ids) for home, op_ids in by_home.items()]
            stored = await self._stored_on(wanted)
            for (_, op_ids), outcomes in zip(wanted, stored, strict=True):
                for op_id, outcome in zip(op_ids, outcomes, strict=True):
                    if outcome is not None and op_id in missing:
                        fetched.done[op_id] = outcome.decode()
                        del missing[op_id]

    def to_check(
        self, batch: Sequence[Finished], running: Mapping[str, Run]
    ) -> list[tuple[ShardKeys, list[str]]]:
        """Where the step that commits ``batch`` looks up the outcomes it records (stored, or
        answered) of ops that ran: each op's home in each retained earlier layout, by the keys
        of its run (where :meth:`answer` looks too, so a replay after a refused step answers
        the op). None on a cluster (:meth:`answer` looked every op up). A refusal, which did
        not run, is not looked up: a fresh entry's id is new unless a client user copied it,
        and a client user choosing keys that route nowhere near the op's home would evade any
        lookup by them."""
        if not self._in_step or not self._history:
            return []
        layouts = self._retained()
        if not layouts:
            return []
        wanted: dict[ShardKeys, list[str]] = {}
        for finished in batch:
            if not (finished.store or finished.answered):
                continue
            if (run := running.get(finished.op_id)) is None:
                continue
            for layout in layouts:
                home = self._shards[layout][home_shard(run.envelope.keys, layout.shards)]
                wanted.setdefault(home, []).append(finished.op_id)
        return list(wanted.items())

    async def _stored_on(
        self, wanted: list[tuple[ShardKeys, list[str]]]
    ) -> list[list[bytes | None]]:
        stored: list[list[bytes | None]] = await self._retrying(
            lambda: self._backend.stored_on_many(wanted)
        )
        return stored
