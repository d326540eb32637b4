"""Serving one owned shard: fetch entries in order, run ops, group-commit their effects.

While it holds the lease, the owner is the only writer of the shard's keys, so it caches their
states (:mod:`.keystates`). Ops on one key run one after another, in stream order; ops on
different keys overlap (:mod:`.chains`). Each step is one script call: it commits every op
finished since the last one (their states, results and the shard's progress, atomically and
fenced by the epoch, :mod:`.commits`), publishes their replies (nothing is replied before it is
committed), and fetches entries when some may be waiting that no push brought (:mod:`.intake`
takes them in). Fresh entries come pushed with their wake-ups (:mod:`.wakeups`), and are taken
in without a fetch while each follows on from the cursor.

After a crash, the new owner replays what the last one may have run (:mod:`.replay`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._backend.backend import Backend
from .._backoff import Backoff
from .._ops import Registry
from .._scripts.calls import ScriptCall
from .._scripts.commit import StepArgs, StepReply, step
from .._scripts.lease import LeaseGrant
from .._scripts.refusals import Diverged, Fenced, OwnedElsewhere, StreamRestarted
from .._settings import Settings
from .._wire.codec import (
    GRANT_OP,
    Envelope,
    Push,
    binding,
)
from .._wire.layout import Layout, part_id, shard_name
from .._wire.messages import GrantRequest
from .._wire.resharding import Seal
from ..errors import BackendUnavailable, LeaseLost
from .chains import Chains, Hold
from .commits import (
    AcrossCommit,
    Commit,
    CommitPlanner,
    DeadLetter,
    Finished,
    Record,
    ResultGenerations,
)
from .crossshard.coordination import RunnerServices
from .crossshard.cross_shard import CrossShard
from .crossshard.mailbox import Mailbox
from .crossshard.participant import held_request, request_refusal
from .draining import Drain, EarlierLayouts
from .execution import Entry, Executor, Run
from .intake import accept, entry_place
from .keystates import KeyStates
from .metrics import NO_METRICS, ShardMetrics
from .pauses import PausedKeys
from .pipeline import Pipeliner
from .replay import Replay
from .timers import TimerAlarm
from .wakeups import Wakeups
from .writes import Replies, WriteChain, WriteChainBroken

log = logging.getLogger("keyserial.worker")
T = TypeVar("T")


class ShardRunner:
    """Runs the ops of one shard for as long as this worker holds its lease (one epoch)."""

    def __init__(
        self,
        pipeliner: Pipeliner,
        settings: Settings,
        registry: Registry,
        *,
        shard: int,
        layout: Layout,
        history: Sequence[tuple[Layout, int]] = (),
        grant: LeaseGrant,
        backend: Backend,
        mailbox: Mailbox,
        metrics: ShardMetrics = NO_METRICS,
    ) -> None:
        #: What it reports to (``Metrics.acquired``); the default ignores everything.
        self.metrics = metrics
        self.shard = shard
        self.keys = layout.keys(shard)
        self.epoch = grant.epoch
        self._pipeliner = pipeliner
        self._backend = backend
        self._settings = settings
        self._shard_count = layout.shards
        self._cursor = grant.progress
        self._replay = Replay(grant.replay_until, grant.suspect)
        self.states = KeyStates(request_step=self.wake)
        #: This owner's writes: broken once one of them is not confirmed as durable.
        self.write_chain = WriteChain()
        self._running: dict[str, Run] = {}
        self._finished: list[Finished] = []
        self._dead: list[DeadLetter] = []
        #: The entries taken in from pushes since the last step, in order: each gets its stream
        #: id from the step that moves it in, and only then is tracked for progress (their dead
        #: letters name it as ``+<n>``, n counting from 1, which the step resolves).
        self._pushed: list[Entry] = []
        #: Cross-shard records for the next step (see :meth:`commit_record`).
        self._records: list[Record] = []
        #: Calls for the step loop's next round (see :meth:`in_step_loop`).
        self._soon: list[Callable[[], None]] = []
        #: Cross-shard ops' writes to this worker's other shards, for the next step (see
        #: :meth:`commit_across`).
        self._across: list[AcrossCommit] = []
        self._uncommitted = 0
        self._stopping = False
        #: A wake-up not waited for yet (new entries, a finished op, stop, the poll).
        self._woken = False
        #: What a sleeping step loop awaits (a bare asyncio future, not an event: the loop
        #: makes one per sleep, and an event costs several times as much, a system call
        #: included; the worker runs on asyncio). None while it is not asleep.
        self._sleeping: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeups = Wakeups()
        #: Asks for a fetch when the shard's next timer is due.
        self._alarm = TimerAlarm(self.entries_waiting)
        self._commits = CommitPlanner(self.keys, settings.idle_poll)
        self._generations = ResultGenerations(grant.results_since, settings.result_ttl_ms)
        #: Steps in a row that committed, trimmed, fetched and confirmed nothing (see
        #: :attr:`dormant`).
        self._empty_steps = 0
        #: Set once :meth:`run` has returned: no step will ever come again.
        self._ended = False
        #: A reshard's seal, as this owner drains the shard (see :meth:`seal`).
        self._drain = Drain(
            self.keys,
            self.epoch,
            backend,
            retrying=self._retrying,
            fenced=self.fenced,
            spawn=self._spawn,
            finish=self._finish,
        )
        self._earlier = EarlierLayouts(
            history, backend, retrying=self._retrying, result_ttl_ms=settings.result_ttl_ms
        )
        #: The shard's name, as grant requests for it name it.
        self.name = shard_name(shard, layout.generation)
        #: Runs of grant requests the last owner had recorded a hold for (its held hash): their
        #: keys are held again before anything else runs (see :meth:`_hold_again`).
        self._held_again: list[Run] = []
        self.executor = Executor(
            registry,
            shard=shard,
            last_fence=grant.epoch << 32,
            states=self.states,
            on_complete=self._complete,
            max_state_bytes=settings.max_state_bytes,
        )
        self._task_group: TaskGroup | None = None
        self._cross = CrossShard(
            RunnerServices(
                home=self,
                pipeliner=pipeliner,
                backend=backend,
                mailbox=mailbox,
                settings=settings,
                layout=layout,
                finish=self.finish,
                commit_record=self.commit_record,
                record_with_step=self.record_with_step,
                in_step_loop=self.in_step_loop,
                commit_across=self.commit_across,
                end_request=self.end_request,
                spawn=self._spawn,
            )
        )
        self._chains = Chains(self.executor, self._cross)
        #: The keys an operator paused on this shard (``keyserial keys pause``).
        self._paused = PausedKeys(self._chains, shard)

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop` (then drain) or cancellation.

        :raises LeaseLost: when a step finds another owner's epoch.
        """
        self._loop = asyncio.get_running_loop()
        try:
            await self._read_seal()
            await self._preload()
            await self._read_holds()
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                self._chains.open(task_group)
                self._hold_again()
                await self._follow_pauses()  # (recorded in Redis: honoured from the first op)
                await self._step_loop()
                task_group.cancel_scope.cancel()
        finally:
            self._ended = True
            self._alarm.cancel()
            self._replay.end()  # (holds waiting for it find the runner ended: abandoned)
            self.states.end()  # flush() waiters from other shards' coordinators
            self._task_group = None
            self._chains.close()

    async def _read_seal(self) -> None:
        """Start sealed if a reshard sealed the shard already: a worker may take an old shard
        over (even after the flip, before it has read the layout again), and must forward, not
        run, what a client appended past the seal: run here, after the flip, its effects would
        land in a layout nobody reads. (A seal written later comes with the worker's poll.)"""
        (seal,) = await self._retrying(lambda: self._backend.seals([self.keys]))
        if seal is not None:
            self.seal(seal)

    async def _preload(self) -> None:
        """Load every state of a small shard, so steps need not read any. (The epoch is ours
        already: an earlier owner's late writes are fenced out.)"""
        limit = min(self._settings.preload_states, self._settings.max_cached_states)
        if not limit or await self._retrying(lambda: self._backend.state_count(self.keys)) > limit:
            return
        loaded = await self._retrying(lambda: self._backend.all_states(self.keys))
        self.states.load_all({key.decode(): state.decode() for key, state in loaded.items()})

    async def _read_holds(self) -> None:
        """Read the holds the last owner recorded for other shards' cross-shard ops (the held
        hash): each attempt's keys are held again, ahead of every op this owner takes in, until
        its decision is applied (read at once: its notice went to the last owner)."""
        held = await self._retrying(lambda: self._backend.held(self.keys))
        for name, raw in held.items():
            request = held_request(name.decode(), raw, self.name)
            if request is not None:
                self._held_again.append(self._request_run(request, recorded=True))

    def _hold_again(self) -> None:
        """Hold the keys of the holds read by :meth:`_read_holds` (nothing else is queued yet)."""
        held_again, self._held_again = self._held_again, []
        for run in held_again:
            self._chains.schedule(run)

    def _request_run(self, request: GrantRequest, *, recorded: bool = False) -> Run:
        """The run of a grant request, in the running map (its op id is the attempt's)."""
        field = part_id(request.op_id, request.home, request.attempt)
        envelope = Envelope(field, request.keys, GRANT_OP, [], {}, None, multi=True)
        run = self._running[field] = Run(envelope, request=request, recorded=recorded)
        self._uncommitted += 1
        self._drain.took_request()
        self.metrics.dispatched([run])
        return run

    def pauses_changed(self) -> None:
        """An operator paused or resumed some key of the namespace: the step loop reads this
        shard's paused keys again before it takes in anything more (the wake-up that says so
        arrives ahead of any push appended after the pause)."""
        self._paused.stale = True
        self.wake()

    async def _follow_pauses(self) -> None:
        """Hold each key paused in Redis (behind the ops already queued on it), and let go of
        each that was resumed."""
        records = await self._retrying(lambda: self._backend.paused_keys(self.keys))
        self._paused.follow({key.decode() for key in records})

    def seal(self, seal: Seal) -> None:
        """A reshard sealed this shard: clients append no more ops here (``submit.lua``), and
        the shard drains. An op pushed after the seal (a plain ``RPUSH``), or found in an entry
        appended to the stream after it (by a client of an older version), is forwarded to its
        shard in the new layout, not run; a grant request is still taken (its op was appended
        before the seal). Once nothing is under way, the owner records the shard drained
        (:meth:`Drain.record`)."""
        if self._drain.seal_with(seal):
            self._wakeups.must_fetch = True  # (pushes waiting now are never taken in)
            self.wake()

    @property
    def sealed(self) -> bool:
        return self._drain.seal is not None

    @property
    def uncommitted(self) -> int:
        """Ops fetched and not committed yet."""
        return self._uncommitted

    def stop(self) -> None:
        """Stop fetching; :meth:`run` returns once everything fetched is committed."""
        self._stopping = True
        self.wake()

    def push(self, pushed: Push) -> None:
        """A wake-up that carries an entry: taken in without a fetch where it follows on. A
        sealed shard takes none in (a client user may publish a push of an op nobody pushed):
        its next step looks, and it forwards from the inbox what a client pushed there."""
        if self.sealed:
            self.entries_waiting()
            return
        self._wakeups.push(pushed)
        self.wake()

    def entries_waiting(self) -> None:
        """New entries may be in the stream that no push brings (or the worker's poll, every
        ``idle_poll``, looks for a wake-up that may have been lost): the next step fetches."""
        self._wakeups.must_fetch = True
        self.wake()

    def wake(self) -> None:
        """Something for the step loop: a push, a finished op, a stop, a flush, the poll."""
        self._woken = True
        if (sleeping := self._sleeping) is not None and not sleeping.done():
            sleeping.set_result(None)

    async def _sleep(self) -> None:
        """Until the next :meth:`wake` (at once if one came since the last sleep)."""
        if not self._woken:
            assert self._loop is not None, "run() first"
            self._sleeping = self._loop.create_future()
            try:
                await self._sleeping
            finally:
                self._sleeping = None
        self._woken = False

    @property
    def dormant(self) -> bool:
        """Idle for two polls in a row: nothing running, nothing to commit, two steps that
        fetched nothing (the second found the stream trimmed, and nothing pushed to confirm),
        and no new results generation due. The worker's poll looks for new entries for all its
        dormant shards in one cheap read, and wakes those that have some, instead of a step for
        each: with hundreds of idle shards, those steps were most of an idle worker's CPU."""
        return (
            self._empty_steps >= 2
            and not (self._running or self._finished or self._dead)
            and not self._generations.due(int(time.time() * 1000))
        )

    @property
    def timers(self) -> TimerAlarm:
        """The shard's timers as this owner last read them: how many wait, and when the next
        is due."""
        return self._alarm

    @property
    def cursor(self) -> str:
        """The last entry this owner has fetched or taken in."""
        return self._cursor

    def _spawn(self, task: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        if self._task_group is None:
            return False
        self._task_group.start_soon(task)
        return True

    # -- the step loop -------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        """Commit what finished and fetch what no push brought (see :mod:`.wakeups`), one
        round trip per step, until stopped. Pushes are taken in, and sync ops run, between
        steps: under load each step commits what came in since the last one."""
        while True:
            if self._soon:
                self._call_soon()
            if self._paused.stale:
                self._paused.stale = False
                await self._follow_pauses()
            if pushed := self._take_push():
                await self._dispatch_pushed(pushed)
            want, replaying = self._fetch_size(), self._replay.replaying
            fetch = self._wakeups.fetch_size(want, replaying)
            record = self._wakeups.records(want, replaying)
            if self._finished or self._dead or self._records or self._across or fetch or record:
                self._woken = False
                fetched = await self._step(fetch, record=record)
                if fetched.entries:
                    await self._dispatch(fetched)
                if fetch and self.sealed:
                    self._drain.forward_inbox()
                continue
            if self._stopping and not self._running:
                return
            if self._drains_now():
                await self._drain.record(self._cursor)
                continue
            await self._sleep()

    def _call_soon(self) -> None:
        """Make the calls handed to :meth:`in_step_loop` since the last round."""
        soon, self._soon = self._soon, []
        for callback in soon:
            callback()

    def _drains_now(self) -> bool:
        """Sealed, past the seal, and nothing under way or to commit but forwards, where the
        last record said otherwise (see :meth:`Drain.due`). (Asked before each sleep: the
        seal is checked first, so an unsealed shard asks the drain nothing.)"""
        return (
            self.sealed
            and not self._replay.replaying
            and not (self._dead or self._records or self._across)
            and self._drain.due(
                self._cursor,
                running=self._running,
                finished=(finished.op_id for finished in self._finished),
                uncommitted=self._uncommitted,
            )
        )

    def _fetch_size(self) -> int:
        if self._stopping or self._uncommitted >= self._settings.max_inflight:
            return 0
        if self._replay.replaying:
            self._replay.reached(self._cursor)
        return self._settings.fetch_batch

    def _take_push(self) -> list[Push]:
        """The pushed entries that follow on from the last item taken, if this owner would
        fetch now (not replaying)."""
        if not self._fetch_size() or self._replay.replaying or self.sealed:
            return []
        return self._wakeups.take(self.states)

    async def _step(self, want: int, *, record: bool = False) -> StepReply:
        """Commit what finished; fetch up to ``want`` entries, with the stored outcomes of op
        ids among them that already ran; ``record`` that this owner takes pushes from now on.

        Never cancel a step while the runner goes on: it takes its batch out of memory first,
        so a cancelled step that never reached Redis loses the batch's results while the cache
        keeps their effects, and the next commit of those keys writes the effects alone."""
        batch, self._finished = self._finished, []
        dead, self._dead = self._dead, []
        records, self._records = self._records, []
        across, self._across = self._across, []
        self._evict_idle_states()
        number, writes = self.states.start_step()
        pushed_entries, self._pushed = self._pushed, []
        others = [other for commit in across for other in commit.writes]
        commit = self._commits.plan(
            batch, dead, writes, records, others, pushed=bool(pushed_entries)
        )
        pushed_from, pushed = self._wakeups.to_confirm()
        if pushed_from:
            pushed_from += " " + _kept(pushed_entries, dead)
        call = step(
            self.keys,
            StepArgs(
                epoch=self.epoch,
                progress=commit.progress,
                rotate=self._generations.rotate(int(time.time() * 1000)),
                cursor=self._cursor,
                fetch=want,
                replaying=self._replay.replaying,
                result_ttl_ms=self._settings.result_ttl_ms,
                trim_to=commit.trim_to,
                trim_now=commit.trim_now,
                states_held=self.states.complete,
                pushed=pushed_from,
                takes_pushes=record,
            ),
            commit.others,
            self._earlier.to_check(batch, self._running),
            pushed,
            commit.payload,
        )
        self._wakeups.sending(want)
        began = time.monotonic()  # (metrics)
        fetched = await self._send_step(call, commit, across)
        if want:
            self._alarm.follow(fetched.next_timer_ms, fetched.timers_waiting)
        self._follow_records(fetched)
        self._moved_in(pushed_entries, fetched.moved)
        _settle(records, self.write_chain, fetched.skipped)
        last = entry_place(*fetched.entries[-1]) if fetched.entries else ""
        self._wakeups.stepped(want, len(fetched.entries), record, fetched.taken, last)
        empty = not (
            commit.payload is not None
            or commit.trim_to
            or fetched.entries
            or pushed_entries
            or record
        )
        self._empty_steps = self._empty_steps + 1 if empty and want else 0
        if want:  # (fewer entries than asked for: none followed the last one)
            self._drain.fetched(reached_end=len(fetched.entries) < want)
        self.metrics.stepped(batch, len(dead), began)
        self.states.step_done(number)
        _settle_across(across, True)
        if commit.trim_to and (commit.trim_now or not want or not fetched.entries):
            self._commits.trimmed()
        self._committed(batch)
        self._drain.committed(batch)
        if not fetched.entries:
            if want and self._replay.replaying:
                self._replay.end()
            return fetched
        for key, state in fetched.states.items():
            self.states.load(key, state)
        return fetched

    async def _send_step(
        self, call: ScriptCall[StepReply], commit: Commit, across: Sequence[AcrossCommit]
    ) -> StepReply:
        """Send a step; the cross-shard ops whose writes to other shards it carries hear if it
        wrote nothing (or if that is not known) at once, if it committed after the step."""
        try:
            return await self.fenced(
                call,
                replies=commit.replies,
                messages=commit.messages,
                builds=commit.builds,
                also=[chain for across_commit in across for chain in across_commit.write_chains],
            )
        except Diverged as exc:
            # Ops ran on what Redis does not hold (entries not as pushed, an op id that has an
            # outcome already, another shard's owner moved on): the cache is not Redis's.
            self.write_chain.broken = True
            _settle_across(across, isinstance(exc, StreamRestarted))
            if isinstance(exc, OwnedElsewhere):
                elsewhere = commit.others[exc.index - 1].shard
                raise WriteChainBroken(
                    f"shard {elsewhere} changed hands during a cross-shard op of this shard's"
                    " next step, which wrote nothing"
                ) from None
            raise WriteChainBroken(str(exc)) from None
        except (LeaseLost, WriteChainBroken):
            _settle_across(across, False)  # refused or not sent: nothing written
            raise
        except BaseException:
            _settle_across(across, None)
            raise

    def _committed(self, batch: Sequence[Finished]) -> None:
        """``batch`` has committed: its runs leave memory, and the alarm rings for the
        timers they set."""
        if self.executor.cancelled:
            self._forget_cancelled(batch)
        for finished in batch:
            if finished.run is not None and self._running.get(finished.op_id) is finished.run:
                del self._running[finished.op_id]
                self._uncommitted -= 1
            if finished.timers is not None and finished.timers.set:
                self._alarm.expect(min(delay for _, delay, _ in finished.timers.set))

    def _forget_cancelled(self, batch: Sequence[Finished]) -> None:
        """Forget the cancelled timers that no op in memory can be any more, now that ``batch``
        has committed: one that ran (answered as cancelled), and one whose cancel committed
        while its op is not waiting here (it fires no more, or its entry, fetched from now on,
        is answered from the outcome the cancel stored)."""
        cancelled = self.executor.cancelled
        for finished in batch:
            cancelled.discard(finished.op_id)
            for timer_id in finished.timers.cancelled if finished.timers else ():
                run = self._running.get(timer_id)
                if run is None or run.outcome is not None:
                    cancelled.discard(timer_id)

    def _moved_in(self, pushed: list[Entry], ids: list[str]) -> None:
        """The step took the entries taken in from pushes out of the inbox, moving those not
        done into the stream as ``ids`` ('' for one done, which went): from now on those count
        for progress."""
        assert len(ids) == len(pushed), "a step takes every entry pushed since the last"
        for entry, entry_id in zip(pushed, ids, strict=True):
            if entry_id:
                entry.entry_id = self._cursor = entry_id
                self._commits.track(entry)

    def _follow_records(self, fetched: StepReply) -> None:
        """Take the seal and the paused keys the step read with its entries: each entry is then
        judged by them, though their wake-ups come later (or are lost)."""
        if fetched.sealed is not None and not self.sealed:
            self.seal(Seal.decode(self._settings.namespace, fetched.sealed))
        if fetched.paused is not None and fetched.paused != self._paused.keys():
            self._paused.follow(fetched.paused)

    def _evict_idle_states(self) -> None:
        """Keep at most ``max_cached_states`` states in memory: past it, drop idle ones (see
        :meth:`KeyStates.evict`), down to 90% of it, so that eviction runs once in a while,
        not at every step. Called before each step and wherever another shard's cross-shard op
        adds states (a key it holds or commits stays until that op has let it go)."""
        bound = self._settings.max_cached_states
        if len(self.states) <= bound:
            return
        needed = {key for run in self._running.values() for key in run.envelope.keys}
        dropped = self.states.evict(
            bound * 9 // 10, lambda key: key in needed or self._chains.holds_key(key)
        )
        log.debug("shard %d: %d idle states dropped from memory", self.shard, dropped)

    async def _commit_through(self, run: Run) -> None:
        """Commit until ``run`` (the suspect) has committed, scheduling nothing else meanwhile.
        A suspect still running after a lease TTL is left to run on (it holds its key, not the
        shard): if the worker then dies, it is still the first op without a result and takes
        the strike. The time limit ends a sleep, never a step (see :meth:`_step`)."""
        deadline = anyio.current_time() + self._settings.lease_ttl
        while self._running.get(run.envelope.op_id) is run or self._finished or self._dead:
            if self._soon:
                self._call_soon()
            if self._finished or self._dead or self._records or self._across:
                await self._step(0)
                continue
            with anyio.move_on_after(deadline - anyio.current_time()) as sleeping:
                await self._sleep()
            if sleeping.cancelled_caught:
                return

    async def _dispatch_pushed(self, pushes: list[Push]) -> None:
        """Take in entries pushed with their wake-ups, which only the next step confirms, and
        moves into the stream (it gives them their ids)."""
        taken = StepReply([("", dict(pushed.fields)) for pushed in pushes], {}, {})
        await self._dispatch(taken, places=[str(pushed.place) for pushed in pushes])

    async def _dispatch(self, fetched: StepReply, *, places: list[str] | None = None) -> None:
        """Take entries in: fetched from the stream, or (``places``: their places in the
        inbox) taken in from pushes (see :meth:`_dispatch_pushed`)."""
        if self._earlier and fetched.entries:
            await self._earlier.answer(fetched, replaying=self._replay.replaying)
        runnable: list[Run] = []
        for at, (entry_id, fields) in enumerate(fetched.entries):
            if places is None:
                self._cursor = entry_id
                place = entry_place(entry_id, fields)
            else:
                place = places[at]
            accepted = accept(
                entry_id,
                fields,
                place=place,
                shard=self.shard,
                shard_count=self._shard_count,
                done=fetched.done,
                running=self._running,
            )
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "shard %d (epoch %d): entry %s runs %s, answers %s",
                    self.shard,
                    self.epoch,
                    entry_id or f"pushed at {place}",
                    [run.envelope.op_id for run in accepted.runs],
                    [finished.op_id for finished in accepted.finished],
                )
            past_seal = False
            if places is None:
                self._commits.track(accepted.entry)
                self._dead.extend(accepted.dead)
                past_seal = self._drain.past_seal(entry_id)
                if b"due" in fields:
                    self.metrics.fired(fields[b"due"])
            else:
                self._pushed.append(accepted.entry)
                n = f"+{len(self._pushed)}"
                self._dead += [(n, why, raw) for _, why, raw in accepted.dead]
            for finished in accepted.finished:
                finished.store = finished.store and not past_seal  # (replied only: see there)
                self._finish(finished)
            self._uncommitted += len(accepted.runs)
            runnable.extend(self._drain.to_run(entry_id, accepted.runs, from_stream=places is None))
        self.metrics.dispatched(runnable)
        for run in runnable:
            self._chains.schedule(run)
            if self._replay.suspect is not None and self._replay.runs_alone(run):
                await self._commit_through(run)

    # -- outcomes ------------------------------------------------------------------------------

    def _complete(self, run: Run, outcome: str) -> None:
        run.outcome = outcome  # from now on, no occurrence of the op joins the run
        self._finish(
            Finished(
                run.envelope.op_id,
                outcome,
                run.entries,
                run.replies,
                run.keep,
                answered=not run.keep,
                binding=binding(run.envelope) if run.keep else "",
                timers=run.timers,
                run=run,
            ),
            run.envelope.keys,
        )

    def finish(
        self,
        run: Run,
        outcome: str,
        *,
        store: bool,
        replies: list[str],
        binding: str = "",
        releases: str = "",
    ) -> None:
        """Take the outcome of an op that finished outside the executor (a cross-shard op or a
        grant request) into the next commit; ``store``: the commit stores it (False: it is in
        Redis already, or must not be kept), bound to ``binding``; ``releases``: the hold the
        commit deletes (see ``Finished``)."""
        run.outcome = outcome
        # (An outcome a cross-shard script committed already leaves its keys committed.)
        committed_already = not store and run.keep
        self._finish(
            Finished(
                run.envelope.op_id,
                outcome,
                list(run.entries),
                replies,
                store,
                answered=not run.keep,
                binding=binding,
                releases=releases,
                run=run,
            ),
            () if committed_already else run.envelope.keys,
        )

    async def commit_record(self, record: Record) -> None:
        """Commit a cross-shard record with the next step (with whatever else finished before
        it); return once that step has committed it, confirmed as durable where the settings
        ask. If the step fails, the runner ends, and this waits until it is cancelled.

        :raises WriteChainBroken: the step committed, but not durably (the shard is given up).
        """
        assert self._loop is not None, "run() first"
        done = self._loop.create_future()

        def committed(_: Record) -> None:
            if not done.done():  # (done: its caller left)
                done.set_result(None)

        record.on_committed = committed
        self.record_with_step(record)
        await done
        if record.error is not None:
            raise record.error

    def record_with_step(self, record: Record) -> None:
        """:meth:`commit_record` with no wait: the step that commits it calls its
        ``on_committed`` (if the step fails, the runner ends, and nothing is called)."""
        self._records.append(record)
        self.wake()

    def in_step_loop(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` from the step loop's next round: in its task, where a message
        handler or a timer (which run in none) cannot start one or set an anyio event."""
        self._soon.append(callback)
        self.wake()

    def commit_across(self, commit: AcrossCommit) -> None:
        """Commit a cross-shard op's writes to other shards of this worker with the next step,
        with the op's outcome and home writes (:meth:`finish` them first, with nothing awaited
        in between); ``commit.settle`` hears what became of them."""
        self._across.append(commit)
        self.wake()

    def end_request(self, run: Run) -> None:
        """End a grant request that has nothing to commit (a lent grant: see
        ``crossshard.participant``), as its step would have."""
        if self._running.pop(run.envelope.op_id, None) is not None:
            self._uncommitted -= 1
            self.metrics.ended(run.envelope.op_id)
        self.wake()

    def _finish(self, finished: Finished, keys: Sequence[str] = ()) -> None:
        """``keys``: those of an op that ran (one answered from Redis, or refused, has none)."""
        self.states.answered(keys)
        self._finished.append(finished)
        self.wake()

    # -- holds for other shards' cross-shard ops -----------------------------------------------

    @asynccontextmanager
    async def hold(self, keys: tuple[str, ...]) -> AsyncIterator[dict[str, str | None] | None]:
        """Hold ``keys`` for a cross-shard op coordinated by another shard of this worker:
        yields their committed states once every earlier op on them has run and committed (None
        if this runner stopped first); later ops on them wait until the block exits."""
        await self._replay.over.wait()
        hold = self._chains.hold(keys)
        try:
            if hold.held is not None:
                await hold.held.wait()
            if not hold.abandoned:
                await self.states.flush(keys)
                await self.load_states(keys)
            yield None if hold.abandoned or self._ended else {key: self.states[key] for key in keys}
        finally:
            self._chains.release(hold)

    async def load_states(self, keys: Sequence[str]) -> None:
        """Cache the committed states of those of ``keys`` not cached (nothing queued on them
        has written them: an op's write stays cached until it has committed)."""
        missing = self.states.missing(keys)
        if missing and not self._ended:
            for key, state in zip(missing, await self._read_states(missing), strict=True):
                self.states.load(key, None if state is None else state.decode())
            self._evict_idle_states()

    def take_request(self, request: GrantRequest) -> None:
        """A grant request for this shard, from the mailbox: checked, then held in the step
        loop's next round (see :meth:`_take_request`)."""
        self.in_step_loop(lambda: self._take_request(request))

    def _take_request(self, request: GrantRequest) -> None:
        """Hold a grant request's keys behind every op taken in on them so far, and grant them
        (``crossshard.participant``). Dropped, with a log line, if it is not for this shard,
        too old, or this owner is stopping (its coordinator asks again after a poll); and
        with none if the attempt's request is held or being held here already (a request sent
        again: a lent grant is sent again, a recorded one read by the coordinator's poll)."""
        refusal = self._request_refusal(request)
        if refusal is not None:
            log.warning(
                "shard %s: dropping the grant request of %s#%d: %s",
                self.name,
                request.op_id,
                request.attempt,
                refusal,
            )
            return
        if run := self._running.get(part_id(request.op_id, request.home, request.attempt)):
            self._cross.request_again(run, request)
            return
        self._chains.schedule(self._request_run(request))

    def _request_refusal(self, request: GrantRequest) -> str | None:
        """Why this owner does not take ``request``; None if it does."""
        if self._ended or self._stopping:
            return "this owner is stopping"
        ttl = self._settings.result_ttl_ms
        return request_refusal(request, self.shard, self.name, self._shard_count, ttl)

    def try_hold(self, keys: tuple[str, ...], *, committed: bool = True) -> Hold | None:
        """Hold ``keys`` at once, with no task, if they are idle: nothing queued on them, their
        states cached, and (``committed``) every write to them committed. None if not (or if
        this runner is stopping); :meth:`hold` waits instead."""
        if self._ended or self._stopping or not self._replay.over.is_set():
            return None
        if committed and not self.states.all_committed(keys):
            return None
        if not self.states.cached(keys):
            return None
        return self._chains.try_hold(keys)

    @property
    def ended(self) -> bool:
        """Whether this runner has stopped (nothing it was handed commits any more)."""
        return self._ended

    def release(self, hold: Hold) -> None:
        self._chains.release(hold)

    def cached_state(self, key: str) -> str | None:
        return self.states[key]

    def next_fence(self) -> int:
        return self.executor.next_fence()

    def committed(self, key: str, state: str | None) -> None:
        self.states.committed(key, state)
        self._evict_idle_states()

    # -- talking to Redis ----------------------------------------------------------------------

    async def _read_states(self, keys: list[str]) -> list[bytes | None]:
        """Committed states of keys this owner has not cached."""
        return await self._retrying(lambda: self._backend.states(self.keys, keys))

    async def fenced(
        self,
        call: ScriptCall[T],
        *,
        replies: Replies | None = None,
        durably: bool = False,
        also: Sequence[WriteChain] = (),
        builds: bool = True,
        messages: Sequence[tuple[str, str]] = (),
    ) -> T:
        """Run a script fenced by this owner's epoch in the next pipeline (raises ``LeaseLost``
        when another owner's epoch refuses it); ``replies`` go out once it has committed (see
        :meth:`Pipeliner.run`). ``durably``: an idempotent call, returned only once confirmed
        as durable (:meth:`Pipeliner.run_durably`). It is a write of this owner's write chain
        (raises ``WriteChainBroken`` once that is broken), and of the write chains ``also`` (the
        other shards a step writes for cross-shard ops, see :meth:`commit_across`); ``builds``:
        it commits states or results (False for a step that only fetches, moves progress or
        trims)."""
        write_chains = (self.write_chain, *also)

        def attempt() -> Awaitable[T]:
            if durably:
                return self._pipeliner.run_durably(call, write_chains)
            return self._pipeliner.run(
                call, replies, write_chains, builds=builds, messages=messages
            )

        try:
            return await self._retrying(attempt)
        except Fenced:
            raise LeaseLost(self.shard, "another worker took the shard over") from None

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, again while Redis is unreachable: the lease loop, not this runner,
        decides whether the worker still owns the shard."""
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                return await attempt()
            except BackendUnavailable as exc:
                message = "shard %d: %s; retrying in %.2fs"
                self._backend.outage.warn(log, message, self.shard, exc, backoff.delay)
                await backoff.sleep()


def _kept(pushed: Sequence[Entry], dead: Sequence[DeadLetter]) -> str:
    """Per entry taken in from a push, '1' to move it into the stream, or '0' if its ops have
    all committed (with this step or before) and no dead letter names it: a takeover then has
    nothing left to run of it, and it goes, as a committed entry leaves the stream."""
    named = {letter[0] for letter in dead}
    return "".join(
        ["1" if entry.remaining or f"+{n}" in named else "0" for n, entry in enumerate(pushed, 1)]
    )


def _settle_across(across: Sequence[AcrossCommit], landed: bool | None) -> None:
    for commit in across:
        commit.settle(landed)


def _settle(records: Sequence[Record], write_chain: WriteChain, skipped: Sequence[str]) -> None:
    """Tell the records' waiters that their step came back: committed, unless its pipeline was
    not confirmed as durable (which broke the write chain), or ``skipped`` (holds not recorded).
    """
    for record in records:
        record.skipped = record.hold and record.name in skipped
        if write_chain.broken:
            record.error = WriteChainBroken("a cross-shard record not confirmed as durable")
        if record.on_committed is not None:
            record.on_committed(record)
