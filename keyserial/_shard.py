"""Serving one owned shard: fetch entries in order, run ops, group-commit their effects.

While it holds the lease, the owner is the only writer of the shard's keys, so it caches their
state in memory. Ops on one key run one after another, in stream order; ops on different keys
overlap (an ``async`` op waiting on I/O does not hold up the rest of the shard). A commit takes
every op finished since the last one; it writes their state, results and the shard's progress
atomically, fenced by the epoch, and publishes their replies (nothing is replied before it is
committed). Progress only passes an entry once all its ops have committed; an op that committed
ahead of it is skipped on replay because its result exists.

After a crash, the acquire script strikes the first op without a result, in stream order (the
*suspect*). The new owner replays as usual (batched, ops on different keys overlapping), except
that the suspect runs alone: nothing after it starts until it has committed, or has run for a
lease TTL. If it kills this owner too, it is again the first op without a result and takes the
next strike, so a poison op reaches ``max_strikes`` in that many deaths in a row. The trade-off:
when an owner dies with several ops in flight, the strike may land on an innocent op ahead of the
killer (a slow one). That op then runs alone and commits, and clears its name; the killer is
struck once every op ahead of it has committed, after one more death per such op. An innocent op
is dead-lettered only if it is still running, a lease TTL after it started alone, at
``max_strikes`` deaths in a row. In exchange a takeover stalls the shard for at most one lease
TTL (the suspect), however many slow ops were in flight: an op stuck forever holds its key only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from . import _backend
from ._backend import Backend, Script, ScriptCall
from ._backoff import Backoff
from ._codec import (
    Envelope,
    MalformedEntry,
    decode_entry,
    encode_error,
    salvage_replies,
)
from ._crossshard import GRANT_OP, CrossShard, Mailbox
from ._execution import Entry, Executor, Hold, Run, StateCache
from ._json import dumps
from ._layout import ShardKeys
from ._lease_scripts import LeaseGrant
from ._metrics import NO_METRICS, ShardMetrics
from ._ops import Registry
from ._pipeline import Pipeliner, Replies
from ._refusals import Fenced
from ._routing import route, shard_for
from ._settings import Settings
from .errors import (
    BackendUnavailable,
    LeaseLost,
    MalformedOperation,
)

log = logging.getLogger("keyserial.worker")
T = TypeVar("T")

#: Committed entries a busy shard leaves in its stream at most before a step trims them.
_TRIM_EVERY = 32
_RESERVED_ID = "'#' is reserved in op ids (keyserial names its coordination records with it)"


@dataclass(slots=True)
class _Finished:
    """An op's outcome waiting for the next commit."""

    op_id: str
    outcome: str
    entries: list[Entry]
    replies: list[str]
    store: bool = True


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


class ShardRunner:
    """Runs the ops of one shard for as long as this worker holds its lease (one epoch)."""

    #: What it reports to (``Metrics.acquired``); the default ignores everything.
    metrics: ShardMetrics = NO_METRICS

    def __init__(
        self,
        pipeliner: Pipeliner,
        settings: Settings,
        registry: Registry,
        *,
        shard: int,
        shard_count: int,
        grant: LeaseGrant,
        backend: Backend,
        mailbox: Mailbox,
    ) -> None:
        self.shard = shard
        self.keys = ShardKeys(settings.namespace, shard)
        self.epoch = grant.epoch
        self._pipeliner = pipeliner
        self._backend = backend
        self._settings = settings
        self._registry = registry
        self._shard_count = shard_count
        self._cursor = grant.progress
        #: Up to this entry, the previous owner may have committed some ops: look them up.
        self._replay_until = parse_id(grant.replay_until) if grant.replay_until else None
        #: The op blamed for the previous owner's death: it runs alone (see the module doc).
        self._suspect = grant.suspect
        #: Set once the replay is over: only then can another shard's op hold keys here in
        #: process, since until then this owner does not know what the last one had granted.
        self._replayed = anyio.Event()
        if self._replay_until is None:
            self._replayed.set()
        self.cache = StateCache()
        self.dirty: set[str] = set()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._running: dict[str, Run] = {}
        self._finished: list[_Finished] = []
        self._dead: list[tuple[str, str, str]] = []
        self._uncommitted = 0
        self._stopping = False
        self._poked = False
        self._poke = anyio.Event()
        self._steps_started = 0
        self._steps_done = 0
        #: Keys whose writes the step in flight carries.
        self._writing: set[str] = set()
        #: The last committed entry still in the stream ('' if none), and how many such entries.
        self._untrimmed = ""
        self._untrimmed_entries = 0
        #: The fewest fetched entries held since :meth:`_passed_by_ops` last looked.
        self._fewest = 0
        self._results_since = grant.results_since
        #: Set at the end of every step someone waits for (see :meth:`flush`).
        self._stepped: anyio.Event | None = None
        k = self.keys
        self._step_keys = [
            k.epoch, k.state, k.progress, k.stream, k.results, k.results_old, k.dead, k.horizon,
            k.results_since,
        ]
        #: Set once :meth:`run` has returned: no step will ever come again.
        self._ended = False
        self._executor = Executor(
            registry,
            shard=shard,
            fence=grant.epoch << 32,
            cache=self.cache,
            dirty=self.dirty,
            on_complete=self._complete,
            coordination=CrossShard(self, backend, mailbox, settings, shard_count),
            max_state_bytes=settings.max_state_bytes,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop` (then drain) or cancellation.

        :raises LeaseLost: when a step finds another owner's epoch.
        """
        try:
            await self._preload()
            async with anyio.create_task_group() as task_group:
                self._executor.task_group = task_group
                task_group.start_soon(self._poll)
                await self._step_loop()
                task_group.cancel_scope.cancel()
        finally:
            self._ended = True
            self._replayed.set()  # (holds waiting for it find the runner ended: abandoned)
            if self._stepped is not None:
                self._stepped.set()  # flush() waiters from other shards' coordinators
            self._executor.task_group = None
            self._executor.abandon_holds()

    async def _preload(self) -> None:
        """Load every state of a small shard, so steps need not read any. (The epoch is ours
        already: an earlier owner's late writes are fenced out.)"""
        limit = self._settings.preload_states
        if not limit or await self._retrying(lambda: self._backend.state_count(self.keys)) > limit:
            return
        loaded = await self._retrying(lambda: self._backend.all_states(self.keys))
        for raw_key, raw_state in _fields(loaded).items():
            self.cache[raw_key.decode()] = raw_state.decode()
        self.cache.complete = True

    def stop(self) -> None:
        """Stop fetching; :meth:`run` returns once everything fetched is committed."""
        self._stopping = True
        self._notify()

    def wake(self) -> None:
        """New entries were appended (a message on the shard's wake channel)."""
        self._notify()

    def _notify(self) -> None:
        self._poked = True
        self._poke.set()

    async def _wait(self) -> None:
        """Wait for a notification (new entries, a finished op, stop, the poll)."""
        if not self._poked:
            self._poke = anyio.Event()
            await self._poke.wait()
        self._poked = False

    async def _poll(self) -> None:
        """Notify every ``idle_poll`` seconds, in case a wake-up was lost. (One timer for the
        runner's life, rather than a timeout on every wait: a cancel scope per wait was a
        visible cost under spread-out load.)"""
        while True:
            await anyio.sleep(self._settings.idle_poll)
            self._notify()

    # -- the step loop -------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        """Commit what finished and fetch what is next, one round trip per step, until stopped.

        Sync ops run inline while a fetched batch is dispatched, so under load each step commits
        the previous batch and fetches the next.
        """
        idle = False
        while True:
            want = self._fetch_size()
            if self._finished or self._dead or (want and not idle):
                self._poked = False
                entries, done = await self._step(want)
                if want:
                    idle = not entries
                if entries:
                    await self._dispatch(entries, done)
                continue
            if self._stopping and not self._running:
                return
            await self._wait()
            idle = False

    def _fetch_size(self) -> int:
        if self._stopping or self._uncommitted >= self._settings.max_inflight:
            return 0
        if self._replay_until is not None and parse_id(self._cursor) >= self._replay_until:
            self._end_replay()
        return self._settings.fetch_batch

    def _end_replay(self) -> None:
        self._replay_until = None
        self._suspect = None
        self._replayed.set()

    async def _step(self, want: int) -> tuple[list[Any], dict[bytes, bytes]]:
        """Commit what finished; fetch up to ``want`` entries. Returns the entries and the stored
        outcomes of op ids among them that already ran.

        Never cancel a step while the runner goes on: it takes its batch out of memory first,
        so a cancelled step that never reached Redis loses the batch's results while the cache
        keeps their effects, and the next commit of those keys writes the effects alone."""
        batch, self._finished = self._finished, []
        dead, self._dead = self._dead, []
        progress, commit, replies = self._commit_args(batch, dead)
        replaying = "1" if self._replay_until is not None else "0"
        trim_to, trim_now = self._trim_args(progress)
        now_ms = int(time.time() * 1000)
        rotate = self._rotate_results(now_ms)
        args = [
            self.epoch, progress, rotate, self._cursor, want, commit, replaying,
            self._settings.result_ttl_ms,
            trim_to, trim_now, int(self.cache.complete), "",
        ]
        self._steps_started += 1
        step = self._steps_started
        began = time.monotonic()  # (metrics)
        entries, done, states = await self.fenced(
            _backend.STEP, self._step_keys, args, replies=replies
        )
        self.metrics.stepped(batch, len(dead), began)
        self._steps_done = step
        if trim_to and (trim_now == "1" or not want or not entries):
            self._untrimmed, self._untrimmed_entries = "", 0
        if self._stepped is not None:
            self._stepped.set()
            self._stepped = None
        for finished in batch:
            if self._running.pop(finished.op_id, None) is not None:
                self._uncommitted -= 1
        if not entries:
            if want and self._replay_until is not None:
                self._end_replay()
            return [], {}
        for raw_key, raw_state in zip(states[::2], states[1::2], strict=True):
            key = raw_key.decode()
            if key not in self.cache:
                self.cache[key] = raw_state.decode() or None
        return entries, dict(zip(done[::2], done[1::2], strict=True))

    async def _commit_through(self, run: Run) -> None:
        """Commit until ``run`` (the suspect) has committed, scheduling nothing else meanwhile.
        A suspect still running after a lease TTL is left to run on (it holds its key, not the
        shard): if the worker then dies, it is still the first op without a result and takes
        the strike. The time limit ends a wait, never a step (see :meth:`_step`)."""
        deadline = anyio.current_time() + self._settings.lease_ttl
        while self._running.get(run.envelope.op_id) is run or self._finished or self._dead:
            if self._finished or self._dead:
                await self._step(0)
                continue
            with anyio.move_on_after(deadline - anyio.current_time()) as waiting:
                await self._wait()
            if waiting.cancelled_caught:
                return

    # -- dispatching ---------------------------------------------------------------------------

    async def _dispatch(self, entries: list[Any], done: dict[bytes, bytes]) -> None:
        runnable: list[Run] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            self._cursor = entry_id
            runnable.extend(self._accept(entry_id, _fields(fields), done))
        self.metrics.dispatched(runnable)
        for run in runnable:
            self._executor.schedule(run)
            if run.envelope.op_id == self._suspect:
                # Alone: every op before it has a result (or is a grant request, which runs
                # no code), and nothing after it starts until it has committed.
                self._suspect = None
                await self._commit_through(run)

    def _accept(
        self, entry_id: str, fields: dict[bytes, bytes], done: dict[bytes, bytes]
    ) -> list[Run]:
        """Register an entry; return its ops that must run (the rest are settled already)."""
        try:
            items = decode_entry(fields)
        except MalformedEntry as exc:
            log.error("shard %d: dead-lettering malformed entry %s: %s", self.shard, entry_id, exc)
            self._dead.append((entry_id, exc.reason, _raw(fields)))
            self._entries[entry_id] = Entry(entry_id, 0)
            outcome = encode_error(MalformedOperation.wire_type, exc.reason)
            for op_id, reply in salvage_replies(fields):
                self._finish(_Finished(op_id, outcome, [], _opt(reply)))
            return []
        entry = self._entries[entry_id] = Entry(entry_id, len(items))
        runnable = []
        for item in items:
            if isinstance(item, MalformedEntry):
                self._reject(entry, item)
            elif (stored := done.get(item.op_id.encode())) is not None:
                self._finish(
                    _Finished(item.op_id, stored.decode(), [entry], _opt(item.reply), store=False)
                )
            elif (running := self._running.get(item.op_id)) is not None:
                if running.outcome is None:
                    running.entries.append(entry)
                    running.replies.extend(_opt(item.reply))
                else:
                    self._finish(
                        _Finished(
                            item.op_id, running.outcome, [entry], _opt(item.reply), store=False
                        )
                    )
            elif (misrouted := self._misrouted(item)) is not None:
                self._reject(entry, MalformedEntry(misrouted, op_id=item.op_id, reply=item.reply))
            else:
                run = self._running[item.op_id] = Run(item, [entry], _opt(item.reply))
                self._uncommitted += 1
                runnable.append(run)
        return runnable

    def _misrouted(self, envelope: Envelope) -> str | None:
        """Why the envelope does not belong on this shard, or None. A multi-key op belongs on
        the lowest shard of its keys (its home), which coordinates the others."""
        if not envelope.multi and shard_for(envelope.keys[0], self._shard_count) == self.shard:
            if "#" in envelope.op_id:
                return _RESERVED_ID
            return None  # most ops: one key, routed right
        if envelope.name == GRANT_OP:
            request = envelope.kwargs
            if envelope.op_id != f"{request.get('op')}#{request.get('attempt')}":
                return "a grant request's id must be '<op id>#<attempt>' (keyserial's own op)"
        elif "#" in envelope.op_id:
            return _RESERVED_ID
        shards = route(envelope, self._shard_count)
        if envelope.multi and envelope.name != GRANT_OP:
            if min(shards) != self.shard:
                return (
                    f"keys {list(envelope.keys)!r} are on shards {sorted(set(shards))} of"
                    f" {self._shard_count}: a multi-key op goes to the lowest, not to shard"
                    f" {self.shard}"
                )
            return None
        for key, shard in zip(envelope.keys, shards, strict=True):
            if shard != self.shard:
                return (
                    f"key {key!r} routes to shard {shard} of {self._shard_count},"
                    f" not to shard {self.shard}"
                )
        return None

    def _reject(self, entry: Entry, problem: MalformedEntry) -> None:
        if problem.op_id is None:
            self._dead.append((entry.entry_id, problem.reason, problem.raw))
            self._finish(_Finished("", "", [entry], [], store=False))
            return
        outcome = encode_error(MalformedOperation.wire_type, problem.reason)
        self._finish(_Finished(problem.op_id, outcome, [entry], _opt(problem.reply)))

    # -- outcomes ------------------------------------------------------------------------------

    def _complete(self, run: Run, outcome: str) -> None:
        run.outcome = outcome  # from now on, no occurrence of the op joins the run
        self._finish(
            _Finished(run.envelope.op_id, outcome, run.entries, run.replies, store=run.keep)
        )

    def _finish(self, finished: _Finished) -> None:
        self._finished.append(finished)
        self._notify()

    def settle(self, run: Run, outcome: str, *, store: bool, replies: list[str]) -> None:
        """Report an op finished outside the executor (a cross-shard op or a grant request);
        ``store``: the next commit stores its outcome (False: it is in Redis already, or must
        not be kept)."""
        run.outcome = outcome
        self._finish(
            _Finished(run.envelope.op_id, outcome, list(run.entries), replies, store=store)
        )

    def refusal(self, run: Run) -> str | None:
        return self._executor.refusal(run)

    @asynccontextmanager
    async def hold(self, keys: tuple[str, ...]) -> AsyncIterator[dict[str, str | None] | None]:
        """Hold ``keys`` for a cross-shard op coordinated by another shard of this worker:
        yields their committed states once every earlier op on them has run and committed (None
        if this runner stopped first); later ops on them wait until the block exits."""
        await self._replayed.wait()
        hold = self._executor.hold(keys)
        try:
            if hold.held is not None:
                await hold.held.wait()
            if not hold.abandoned:
                await self.flush(keys)
                missing = [key for key in keys if key not in self.cache]
                if missing and not self._ended and not self.cache.complete:
                    for key, state in zip(missing, await self._read_states(missing), strict=True):
                        self.cache.setdefault(key, None if state is None else state.decode())
            yield None if hold.abandoned or self._ended else {key: self.cache[key] for key in keys}
        finally:
            self._executor.release(hold)

    def try_hold(self, keys: tuple[str, ...]) -> Hold | None:
        """Hold ``keys`` at once, with no task, if they are idle: nothing queued on them, every
        write to them committed, their states cached. None if not (or if this runner is
        stopping); :meth:`hold` waits instead."""
        if self._ended or self._stopping or not self.dirty.isdisjoint(keys):
            return None
        if not self._replayed.is_set():
            return None
        if self._steps_done < self._steps_started and not self._writing.isdisjoint(keys):
            return None
        if not self.cache.complete and any(key not in self.cache for key in keys):
            return None
        return self._executor.try_hold(keys)

    def release(self, hold: Hold) -> None:
        self._executor.release(hold)

    def spawn(self, task: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``task`` in this runner's task group (its errors end the runner); nothing if the
        runner has stopped."""
        if self._executor.task_group is not None:
            self._executor.task_group.start_soon(task)

    def runs_inline(self, envelope: Envelope) -> bool:
        return self._executor.runs_inline(envelope)

    def evaluate_now(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        return self._executor.evaluate_now(envelope, states, fences)

    def next_fence(self) -> int:
        return self._executor.next_fence()

    def commit_later(
        self, call: ScriptCall[Any], replies: Replies, on_done: Callable[[Any], None]
    ) -> None:
        """Queue a fenced script in the next pipeline; ``on_done`` gets its reply or error."""
        self._pipeliner.submit(call, replies, on_done)

    async def pipelined(self, call: ScriptCall[Any]) -> Any:
        return await self._pipeliner.run(call)

    async def evaluate(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        return await self._executor.evaluate(envelope, states, fences)

    async def flush(self, keys: Iterable[str]) -> None:
        """Return once every write to ``keys`` made so far has committed: the next step takes
        it (dirty keys), or the step in flight carries it."""
        keys = set(keys)
        if not self.dirty.isdisjoint(keys):
            target = self._steps_started + 1
            self._notify()
        elif not self._writing.isdisjoint(keys):
            target = self._steps_started
        else:
            return
        while self._steps_done < target and not self._ended:
            if self._stepped is None:
                self._stepped = anyio.Event()
            await self._stepped.wait()

    # -- committing ----------------------------------------------------------------------------

    def _commit_args(
        self, batch: list[_Finished], dead: list[tuple[str, str, str]]
    ) -> tuple[str, str, dict[str, list[tuple[str, str]]]]:
        """The new progress marker, the step script's commit argument for ``batch``, and the
        replies to publish once it has committed."""
        results: list[tuple[str, str]] = []
        replies: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for finished in batch:
            for entry in finished.entries:
                entry.remaining -= 1
            if finished.store:
                results.append((finished.op_id, finished.outcome))
            for channel in finished.replies:
                replies[channel].append((finished.op_id, finished.outcome))
        writes = [(key, self.cache[key] or "") for key in self.dirty]
        self._writing = set(self.dirty)
        self.dirty.clear()
        progress = self._advance_progress()
        passed = self._passed_by_ops()
        if not (writes or results or dead or passed):
            return progress, "", replies
        commit: dict[str, Any] = {"s": writes, "r": results, "d": dead}
        if passed:
            commit["x"] = passed
        return progress, dumps(commit), replies

    def _passed_by_ops(self) -> list[str]:
        """Entries whose ops have all committed, but that progress cannot pass yet (an
        unfinished op in an earlier entry): removed from the stream, so that a stuck op keeps
        its own entry only, not the shard's backlog. (Looked for once it holds ``_TRIM_EVERY``
        more entries than the fewest it held since the last look.)"""
        self._fewest = min(self._fewest, len(self._entries))
        if len(self._entries) < self._fewest + _TRIM_EVERY:
            return []
        passed = [entry_id for entry_id, entry in self._entries.items() if entry.remaining == 0]
        for entry_id in passed:
            del self._entries[entry_id]
        self._fewest = len(self._entries)
        return passed

    def _rotate_results(self, now_ms: int) -> str:
        """'1' if this step should ask for a new results generation: by this owner's clock,
        the current one is a retention period old (or there is none). The script decides by
        the server's clock, and not while a result of the generation it would drop may still
        be needed by a replay: results live at least one period, and until progress passes
        their entry. (A clock off either way only makes it ask early or late.)"""
        since = self._results_since
        if since is not None and now_ms < since + self._settings.result_ttl_ms:
            return "0"
        self._results_since = now_ms
        return "1"

    def _trim_args(self, progress: str) -> tuple[str, str]:
        """What the step trims from the stream: committed entries go every ``_TRIM_EVERY`` of
        them while the shard is busy (a command each time), and at once when it goes idle."""
        if progress:
            self._untrimmed = progress
        return self._untrimmed, "1" if self._untrimmed_entries >= _TRIM_EVERY else "0"

    def _advance_progress(self) -> str:
        """Id of the last entry of the fetched prefix whose ops have all finished ('' if none)."""
        progress = ""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.remaining > 0:
                break
            progress = first.entry_id
            self._entries.popitem(last=False)
            self._untrimmed_entries += 1
        return progress

    async def _read_states(self, keys: list[str]) -> list[bytes | None]:
        """Committed states of keys this owner has not cached."""
        return await self._retrying(lambda: self._backend.states(self.keys, keys))

    async def fenced(
        self, script: Script, keys: Sequence[str], args: Sequence[Any], *,
        replies: Replies | None = None,
    ) -> Any:
        """Run a fenced script (raises ``LeaseLost`` when another owner's epoch refuses it);
        ``replies`` go out once it has committed (see :meth:`Pipeliner.run`)."""
        call: ScriptCall[Any] = ScriptCall(script, keys, args)
        try:
            return await self._retrying(lambda: self._pipeliner.run(call, replies))
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
                log.warning("shard %d: %s; retrying in %.2fs", self.shard, exc, backoff.delay)
                await backoff.sleep()

def _fields(raw: Any) -> dict[bytes, bytes]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(raw[::2], raw[1::2], strict=True))


def _raw(fields: dict[bytes, bytes]) -> str:
    return dumps(
        {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
    )


def _opt(reply: str | None) -> list[str]:
    return [] if reply is None else [reply]
