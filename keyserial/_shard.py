"""Serving one owned shard: fetch entries in order, run ops, group-commit their effects.

While it holds the lease, the owner is the only writer of the shard's keys, so it caches their
state in memory. Ops on one key run one after another, in stream order; ops on different keys
overlap (an ``async`` op waiting on I/O does not hold up the rest of the shard). A commit takes
every op finished since the last one; it writes their state, results and the shard's progress
atomically, fenced by the epoch, and publishes their replies (nothing is replied before it is
committed). Progress only passes an entry once all its ops have committed; an op that committed
ahead of it is skipped on replay because its result exists.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis import exceptions as redis_errors

from . import _backend
from ._backend import ScriptCall
from ._codec import (
    Envelope,
    MalformedEntry,
    decode_entry,
    dumps,
    encode_error,
    encode_ok,
    encode_reply,
    salvage_replies,
)
from ._layout import ShardKeys
from ._ops import Context, MultiContext, Registry
from ._pipeline import Pipeliner
from ._routing import shard_for
from ._settings import Settings
from .errors import (
    BackendUnavailable,
    LeaseLost,
    MalformedOperation,
    OperationFailed,
    UnknownOperation,
)

log = logging.getLogger("keyserial.worker")


@dataclass(frozen=True, slots=True)
class Grant:
    """What acquiring a shard's lease returned."""

    epoch: int
    progress: str
    careful_until: str | None
    poisoned: str | None


@dataclass(slots=True)
class _Entry:
    """A fetched stream entry; progress may pass it once ``remaining`` reaches zero."""

    entry_id: str
    remaining: int


@dataclass(slots=True)
class _Run:
    """One op to run, and every fetched occurrence of its op id waiting for its outcome."""

    envelope: Envelope
    entries: list[_Entry] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    #: Set once the op has run; later occurrences then reuse it instead of joining the run.
    outcome: str | None = None


@dataclass(slots=True)
class _Barrier:
    """A multi-key op's place in each of its keys' chains: it runs once it heads all of them,
    and those chains move on only after it has run."""

    run: _Run
    arrived: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(slots=True)
class _Finished:
    """An op's outcome waiting for the next commit."""

    op_id: str
    outcome: str
    entries: list[_Entry]
    replies: list[str]
    store: bool = True


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def error_type_name(exc: BaseException) -> str:
    if isinstance(exc, OperationFailed):
        return exc.error_type
    kind = type(exc)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


class ShardRunner:
    """Runs the ops of one shard for as long as this worker holds its lease (one epoch)."""

    def __init__(
        self,
        pipeliner: Pipeliner,
        settings: Settings,
        registry: Registry,
        *,
        shard: int,
        shard_count: int,
        grant: Grant,
    ) -> None:
        self.shard = shard
        self.keys = ShardKeys(settings.namespace, shard)
        self.epoch = grant.epoch
        self._pipeliner = pipeliner
        self._settings = settings
        self._registry = registry
        self._shard_count = shard_count
        self._cursor = grant.progress
        self._careful_until = parse_id(grant.careful_until) if grant.careful_until else None
        self._cache: dict[str, str | None] = {}
        self._dirty: set[str] = set()
        self._done: dict[bytes, bytes] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._running: dict[str, _Run] = {}
        self._chains: dict[str, deque[_Run | _Barrier]] = {}
        self._finished: list[_Finished] = []
        self._dead: list[tuple[str, str, str]] = []
        self._uncommitted = 0
        self._stopping = False
        self._poked = False
        self._poke = anyio.Event()
        self._fence = grant.epoch << 32

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop` (then drain) or cancellation.

        :raises LeaseLost: when a step finds another owner's epoch.
        """
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            await self._step_loop()
            task_group.cancel_scope.cancel()

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

    async def _wait(self, timeout: float | None) -> None:
        """Wait for a notification (new entries, a finished op, stop), or ``timeout``."""
        if not self._poked:
            self._poke = anyio.Event()
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await self._poke.wait()
        self._poked = False

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
                entries = await self._step(want)
                if want:
                    idle = not entries
                if entries:
                    await self._dispatch(entries)
                continue
            if self._stopping and not self._running:
                return
            # Idle: wait for a wake-up, but poll now and then in case one was lost.
            await self._wait(self._settings.idle_poll if want else None)
            idle = False

    def _fetch_size(self) -> int:
        if self._stopping or self._uncommitted >= self._settings.max_inflight:
            return 0
        if self._careful_until is not None:
            if parse_id(self._cursor) < self._careful_until:
                return 1
            self._careful_until = None
        return self._settings.fetch_batch

    async def _step(self, want: int) -> list[Any]:
        batch, self._finished = self._finished, []
        dead, self._dead = self._dead, []
        k = self.keys
        keys = [
            k.epoch,
            k.state,
            k.progress,
            k.stream,
            k.results,
            k.results_expiry,
            k.dead,
            k.horizon,
        ]
        progress, commit = self._commit_args(batch, dead)
        args = [self.epoch, progress, self._settings.result_ttl_ms, self._cursor, want, commit]
        entries, done, states = await self._retrying(_backend.STEP, keys, args)
        for finished in batch:
            if self._running.pop(finished.op_id, None) is not None:
                self._uncommitted -= 1
        if not entries:
            if want and self._careful_until is not None:
                self._careful_until = None
            return []
        self._done = dict(zip(done[::2], done[1::2], strict=True))
        for raw_key, raw_state in zip(states[::2], states[1::2], strict=True):
            key = raw_key.decode()
            if key not in self._cache:
                self._cache[key] = raw_state.decode() or None
        return entries  # type: ignore[no-any-return]

    async def _commit_through(self, run: _Run) -> None:
        """Commit until ``run`` has committed (careful mode: one op per commit)."""
        while self._running.get(run.envelope.op_id) is run or self._finished or self._dead:
            if self._finished or self._dead:
                await self._step(0)
            else:
                await self._wait(None)

    # -- dispatching ---------------------------------------------------------------------------

    async def _dispatch(self, entries: list[Any]) -> None:
        careful = self._careful_until is not None
        runnable: list[_Run] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            self._cursor = entry_id
            runnable.extend(self._accept(entry_id, _fields(fields), self._done))
        for run in runnable:
            self._schedule(run)
            if careful:
                # One op per commit: if this op kills the worker, it alone takes the strike.
                await self._commit_through(run)

    def _accept(
        self, entry_id: str, fields: dict[bytes, bytes], done: dict[bytes, bytes]
    ) -> list[_Run]:
        """Register an entry; return its ops that must run (the rest are settled already)."""
        try:
            items = decode_entry(fields)
        except MalformedEntry as exc:
            log.error("shard %d: dead-lettering malformed entry %s: %s", self.shard, entry_id, exc)
            self._dead.append((entry_id, exc.reason, _raw(fields)))
            self._entries[entry_id] = _Entry(entry_id, 0)
            outcome = encode_error(MalformedOperation.wire_type, exc.reason)
            for op_id, reply in salvage_replies(fields):
                self._finish(_Finished(op_id, outcome, [], _opt(reply)))
            return []
        entry = self._entries[entry_id] = _Entry(entry_id, len(items))
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
                run = self._running[item.op_id] = _Run(item, [entry], _opt(item.reply))
                self._uncommitted += 1
                runnable.append(run)
        return runnable

    def _misrouted(self, envelope: Envelope) -> str | None:
        """Why the envelope does not belong on this shard, or None."""
        for key in envelope.keys:
            shard = shard_for(key, self._shard_count)
            if shard != self.shard:
                if envelope.multi:
                    return (
                        f"key {key!r} is on shard {shard}, not {self.shard}: multi-key ops"
                        " across shards are not supported by this worker yet"
                    )
                return (
                    f"key {key!r} routes to shard {shard} of {self._shard_count},"
                    f" not to shard {self.shard}"
                )
        return None

    def _reject(self, entry: _Entry, problem: MalformedEntry) -> None:
        if problem.op_id is None:
            self._dead.append((entry.entry_id, problem.reason, problem.raw))
            self._finish(_Finished("", "", [entry], [], store=False))
            return
        outcome = encode_error(MalformedOperation.wire_type, problem.reason)
        self._finish(_Finished(problem.op_id, outcome, [entry], _opt(problem.reply)))

    # -- running ops ---------------------------------------------------------------------------

    def _schedule(self, run: _Run) -> None:
        """Run now if every key is free and nothing needs awaiting; otherwise queue the op on
        each of its keys' chains. A multi-key op waits at the head of all its chains (a barrier);
        chains fill in stream order, so two barriers can never wait for each other."""
        keys = run.envelope.keys
        definition = self._registry.get(run.envelope.name)
        if not any(key in self._chains for key in keys) and (
            definition is None or not definition.is_async
        ):
            self._execute_now(run)  # nothing to wait for: no task needed
            return
        item: _Run | _Barrier = run if len(keys) == 1 else _Barrier(run)
        for key in keys:
            chain = self._chains.get(key)
            if chain is None:
                self._chains[key] = deque([item])
                self._task_group.start_soon(self._run_chain, key)
            else:
                chain.append(item)

    async def _run_chain(self, key: str) -> None:
        """Run a key's queued ops one after another; other keys' chains run meanwhile."""
        chain = self._chains[key]
        while chain:
            item = chain.popleft()
            if isinstance(item, _Run):
                await self._execute(item)
                continue
            item.arrived += 1
            if item.arrived == len(item.run.envelope.keys):
                await self._execute(item.run)  # the last of its keys to get here runs it
                item.done.set()
            else:
                await item.done.wait()
        del self._chains[key]

    async def _execute(self, run: _Run) -> None:
        definition = self._registry.get(run.envelope.name)
        if definition is None or not definition.is_async:
            self._execute_now(run)
            return
        context = self._context(run.envelope)
        try:
            value = await definition.fn(context, *run.envelope.args, **run.envelope.kwargs)
        except Exception as exc:
            self._failed(run, exc)
        else:
            self._succeeded(run, context, value)

    def _execute_now(self, run: _Run) -> None:
        envelope = run.envelope
        definition = self._registry.get(envelope.name)
        if definition is None:
            self._failed(
                run,
                UnknownOperation(
                    f"no op named {envelope.name!r} on this worker (it serves: "
                    f"{', '.join(self._registry.names())})"
                ),
            )
            return
        if definition.multi_key != envelope.multi:
            wanted = "a list of keys (submit_many)" if definition.multi_key else "one key (submit)"
            self._failed(run, MalformedOperation(f"op {envelope.name!r} takes {wanted}"))
            return
        context = self._context(envelope)
        try:
            value = definition.fn(context, *envelope.args, **envelope.kwargs)
        except Exception as exc:
            self._failed(run, exc)
        else:
            self._succeeded(run, context, value)

    def _context(self, envelope: Envelope) -> Context | MultiContext:
        self._fence += 1
        if envelope.multi:
            return MultiContext(
                keys=envelope.keys,
                op_id=envelope.op_id,
                shard=self.shard,
                fence=self._fence,
                encoded_states={key: self._cache[key] for key in envelope.keys},
            )
        return Context(
            key=envelope.key,
            op_id=envelope.op_id,
            shard=self.shard,
            fence=self._fence,
            encoded_state=self._cache[envelope.key],
        )

    def _succeeded(self, run: _Run, context: Context | MultiContext, value: Any) -> None:
        try:
            outcome = encode_ok(value)
            if isinstance(context, MultiContext):
                states = context.encoded_states()
            else:
                states = {context.key: context.encoded_state()}
        except (TypeError, ValueError) as exc:
            self._failed(
                run, TypeError(f"op {run.envelope.name!r} returned or stored non-JSON: {exc}")
            )
            return
        for key, state in states.items():
            if state != self._cache[key]:
                self._cache[key] = state
                self._dirty.add(key)
        self._complete(run, outcome)

    def _failed(self, run: _Run, exc: Exception) -> None:
        if not isinstance(exc, OperationFailed):
            log.warning(
                "shard %d: op %r (%s) raised",
                self.shard,
                run.envelope.name,
                run.envelope.op_id,
                exc_info=exc,
            )
        data = exc.data if isinstance(exc, OperationFailed) else None
        message = exc.message if isinstance(exc, OperationFailed) else str(exc)
        self._complete(run, encode_error(error_type_name(exc), message, data))

    def _complete(self, run: _Run, outcome: str) -> None:
        run.outcome = outcome
        self._finish(_Finished(run.envelope.op_id, outcome, list(run.entries), list(run.replies)))

    def _finish(self, finished: _Finished) -> None:
        self._finished.append(finished)
        self._notify()

    # -- committing ----------------------------------------------------------------------------

    def _commit_args(
        self, batch: list[_Finished], dead: list[tuple[str, str, str]]
    ) -> tuple[str, str]:
        """The new progress marker, and the step script's commit argument for ``batch``."""
        results: list[tuple[str, str]] = []
        replies: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for finished in batch:
            for entry in finished.entries:
                entry.remaining -= 1
            if finished.store:
                results.append((finished.op_id, finished.outcome))
            for channel in finished.replies:
                replies[channel].append((finished.op_id, finished.outcome))
        writes = [(key, self._cache[key] or "") for key in self._dirty]
        self._dirty.clear()
        progress = self._advance_progress()
        if not (writes or results or dead or replies):
            return progress, ""
        commit = {
            "s": writes,
            "r": results,
            "d": dead,
            "p": [(channel, encode_reply(outcomes)) for channel, outcomes in replies.items()],
        }
        return progress, dumps(commit)

    def _advance_progress(self) -> str:
        """Id of the last entry of the fetched prefix whose ops have all finished ('' if none)."""
        progress = ""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.remaining > 0:
                break
            progress = first.entry_id
            self._entries.popitem(last=False)
        return progress

    async def _retrying(self, script: _backend.Script, keys: list[str], args: list[Any]) -> Any:
        """Run a fenced script, retrying while Redis is unreachable (the lease loop decides
        whether this worker still owns the shard)."""
        delay = 0.05
        while True:
            try:
                return await self._pipeliner.run(ScriptCall(script, keys, args))
            except redis_errors.ResponseError as exc:
                if str(exc).startswith("FENCED"):
                    raise LeaseLost(self.shard, "another worker took the shard over") from None
                raise
            except BackendUnavailable as exc:
                log.warning("shard %d: %s; retrying in %.2fs", self.shard, exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)


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
