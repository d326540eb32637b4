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
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis import exceptions as redis_errors

from . import _backend
from ._backend import Backend
from ._codec import (
    Envelope,
    MalformedEntry,
    decode_entry,
    dumps,
    encode_error,
    encode_ok,
    encode_reply,
)
from ._layout import ShardKeys
from ._ops import Context, Registry
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
        backend: Backend,
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
        self._backend = backend
        self._settings = settings
        self._registry = registry
        self._shard_count = shard_count
        self._cursor = grant.progress
        self._careful_until = parse_id(grant.careful_until) if grant.careful_until else None
        self._cache: dict[str, str | None] = {}
        self._dirty: set[str] = set()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._running: dict[str, _Run] = {}
        self._chains: dict[str, deque[_Run]] = {}
        self._finished: list[_Finished] = []
        self._dead: list[tuple[str, str, str]] = []
        self._has_finished = anyio.Event()
        self._uncommitted = 0
        self._settled = anyio.Event()
        self._capacity = anyio.Event()
        self._wake = anyio.Event()
        self._stopping = False
        self._fence = grant.epoch << 32

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop` (then drain) or cancellation.

        :raises LeaseLost: when a fetch or commit finds another owner's epoch.
        """
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            task_group.start_soon(self._commit_loop)
            await self._fetch_loop()
            await self._drained()
            task_group.cancel_scope.cancel()

    def stop(self) -> None:
        """Stop fetching; :meth:`run` returns once everything fetched is committed."""
        self._stopping = True
        self._wake.set()
        self._capacity.set()

    def wake(self) -> None:
        self._wake.set()

    # -- fetching ------------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        while not self._stopping:
            if self._uncommitted >= self._settings.max_inflight:
                self._capacity = anyio.Event()
                await self._capacity.wait()
                continue
            careful = (
                self._careful_until is not None and parse_id(self._cursor) < self._careful_until
            )
            wake = self._wake = anyio.Event()
            entries, done = await self._fetch(1 if careful else self._settings.fetch_batch)
            if not entries:
                self._careful_until = None
                with anyio.move_on_after(self._settings.idle_poll):
                    await wake.wait()
                continue
            await self._dispatch(entries, dict(zip(done[::2], done[1::2], strict=True)), careful)

    async def _fetch(self, count: int) -> tuple[list[Any], list[bytes]]:
        reply = await self._retrying(
            _backend.FETCH,
            [self.keys.epoch, self.keys.stream, self.keys.horizon, self.keys.results],
            [self.epoch, self._cursor, count],
        )
        entries, done = reply
        return entries, done

    async def _dispatch(self, entries: list[Any], done: dict[bytes, bytes], careful: bool) -> None:
        runnable: list[_Run] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            self._cursor = entry_id
            runnable.extend(self._accept(entry_id, _fields(fields), done))
        await self._load_states({run.envelope.key for run in runnable})
        for run in runnable:
            self._schedule(run)
            if careful:
                # One op per commit: if this op kills the worker, it alone takes the strike.
                await self._drained()

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
            self._finish(_Finished("", "", [], [], store=False))
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
            elif shard_for(item.key, self._shard_count) != self.shard:
                self._reject(
                    entry,
                    MalformedEntry(
                        f"key {item.key!r} routes to shard {shard_for(item.key, self._shard_count)}"
                        f" of {self._shard_count}, not to shard {self.shard}",
                        op_id=item.op_id,
                        reply=item.reply,
                    ),
                )
            else:
                run = self._running[item.op_id] = _Run(item, [entry], _opt(item.reply))
                self._uncommitted += 1
                runnable.append(run)
        return runnable

    def _reject(self, entry: _Entry, problem: MalformedEntry) -> None:
        if problem.op_id is None:
            self._dead.append((entry.entry_id, problem.reason, ""))
            self._finish(_Finished("", "", [entry], [], store=False))
            return
        outcome = encode_error(MalformedOperation.wire_type, problem.reason)
        self._finish(_Finished(problem.op_id, outcome, [entry], _opt(problem.reply)))

    async def _load_states(self, keys: set[str]) -> None:
        missing = [key for key in keys if key not in self._cache]
        if not missing:
            return
        values = await self._backend.hmget(self.keys.state, missing)
        for key, value in zip(missing, values, strict=True):
            self._cache[key] = None if value is None else value.decode()

    # -- running ops ---------------------------------------------------------------------------

    def _schedule(self, run: _Run) -> None:
        key = run.envelope.key
        chain = self._chains.get(key)
        if chain is not None:
            chain.append(run)
            return
        definition = self._registry.get(run.envelope.name)
        if definition is None or not definition.is_async:
            self._execute_now(run)  # nothing to wait for: no task needed
            return
        self._chains[key] = deque([run])
        self._task_group.start_soon(self._run_chain, key)

    async def _run_chain(self, key: str) -> None:
        """Run a key's queued ops one after another; other keys' chains run meanwhile."""
        chain = self._chains[key]
        while chain:
            run = chain.popleft()
            definition = self._registry.get(run.envelope.name)
            if definition is not None and definition.is_async:
                context = self._context(run.envelope)
                try:
                    value = await definition.fn(context, *run.envelope.args, **run.envelope.kwargs)
                except Exception as exc:
                    self._failed(run, exc)
                else:
                    self._succeeded(run, context, value)
            else:
                self._execute_now(run)
        del self._chains[key]

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
        context = self._context(envelope)
        try:
            value = definition.fn(context, *envelope.args, **envelope.kwargs)
        except Exception as exc:
            self._failed(run, exc)
        else:
            self._succeeded(run, context, value)

    def _context(self, envelope: Envelope) -> Context:
        self._fence += 1
        return Context(
            key=envelope.key,
            op_id=envelope.op_id,
            shard=self.shard,
            fence=self._fence,
            encoded_state=self._cache[envelope.key],
        )

    def _succeeded(self, run: _Run, context: Context, value: Any) -> None:
        try:
            outcome = encode_ok(value)
            state = context.encoded_state()
        except (TypeError, ValueError) as exc:
            self._failed(
                run, TypeError(f"op {run.envelope.name!r} returned or stored non-JSON: {exc}")
            )
            return
        if state != self._cache[run.envelope.key]:
            self._cache[run.envelope.key] = state
            self._dirty.add(run.envelope.key)
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
        self._has_finished.set()

    # -- committing ----------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        while True:
            await self._has_finished.wait()
            self._has_finished = anyio.Event()
            batch, self._finished = self._finished, []
            dead, self._dead = self._dead, []
            await self._retrying(
                _backend.COMMIT, self._commit_keys(), self._commit_args(batch, dead)
            )
            for finished in batch:
                if self._running.pop(finished.op_id, None) is not None:
                    self._uncommitted -= 1
            self._capacity.set()
            if not self._finished and not self._running:
                self._settled.set()

    def _commit_keys(self) -> list[str]:
        k = self.keys
        return [k.epoch, k.state, k.progress, k.stream, k.results, k.results_expiry, k.dead]

    def _commit_args(self, batch: list[_Finished], dead: list[tuple[str, str, str]]) -> list[Any]:
        states: dict[str, str | None] = {}
        results: list[str] = []
        replies: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for finished in batch:
            for entry in finished.entries:
                entry.remaining -= 1
            if finished.store:
                results += (finished.op_id, finished.outcome)
            for channel in finished.replies:
                replies[channel].append((finished.op_id, finished.outcome))
        for key in self._dirty:
            states[key] = self._cache[key]
        self._dirty.clear()
        args: list[Any] = [self.epoch, self._advance_progress(), self._settings.result_ttl_ms]
        args += [len(states)]
        for key, encoded in states.items():
            args += (key, "" if encoded is None else encoded)
        args += [len(results) // 2, *results, len(dead)]
        for triple in dead:
            args += triple
        args += [len(replies)]
        for channel, outcomes in replies.items():
            args += (channel, encode_reply(outcomes))
        return args

    def _advance_progress(self) -> str:
        progress = ""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.remaining > 0:
                break
            progress = first.entry_id
            self._entries.popitem(last=False)
        return progress

    async def _drained(self) -> None:
        """Wait until every fetched op has committed."""
        while self._running or self._finished or self._dead:
            self._settled = anyio.Event()
            await self._settled.wait()

    async def _retrying(self, script: _backend.Script, keys: list[str], args: list[Any]) -> Any:
        """Run a fenced script, retrying while Redis is unreachable (the lease loop decides
        whether this worker still owns the shard)."""
        delay = 0.05
        while True:
            try:
                return await self._backend.run(script, keys, args)
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
