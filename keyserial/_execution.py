"""Running a shard's ops: one key's ops one after another, different keys' ops side by side.

Sync ops on a free key run inline (no task); an ``async`` op gets a chain task for its key, and
later ops on that key queue behind it. A multi-key op is a :class:`Barrier` placed in every one
of its keys' chains: the last chain to reach it runs it, the others wait, so it sees and writes
all its keys alone. Chains fill in stream order, so two barriers can never wait for each other.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import anyio
from anyio.abc import TaskGroup

from ._codec import Envelope, encode_error, encode_ok
from ._ops import Context, MultiContext, Op, Registry
from .errors import MalformedOperation, OperationFailed, UnknownOperation

log = logging.getLogger("keyserial.worker")


class StateCache(dict[str, str | None]):
    """The owner's copy of its shard's committed states (key -> JSON, ``None``: no state).
    Once :attr:`complete` (every state was loaded when the owner took the shard over, and only
    the owner writes them), a key it does not hold has no state."""

    complete = False

    def __missing__(self, key: str) -> str | None:
        if not self.complete:
            raise KeyError(key)
        self[key] = None
        return None


@dataclass(slots=True)
class Entry:
    """A fetched stream entry; progress may pass it once ``remaining`` reaches zero."""

    entry_id: str
    remaining: int


@dataclass(slots=True)
class Run:
    """One op to run, and every fetched occurrence of its op id waiting for its outcome."""

    envelope: Envelope
    entries: list[Entry] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    #: Set once the op has run; later occurrences then reuse it instead of joining the run.
    outcome: str | None = None
    #: Whether its outcome is stored (not for an op this worker does not know: see
    #: :meth:`Executor.refusal`).
    keep: bool = True


@dataclass(slots=True)
class Barrier:
    """A multi-key op's place in each of its (local) keys' chains: it runs once it heads all of
    them, and those chains move on only after it has run."""

    run: Run
    needed: int
    #: Run by the cross-shard coordination (a grant request, or an op with keys elsewhere).
    coordinated: bool = False
    arrived: int = 0
    #: Set once it has run; created by the first chain that has to wait for that.
    done: anyio.Event | None = None


@dataclass(slots=True, eq=False)
class Hold:
    """Keys held for a cross-shard op that another shard of this worker coordinates: like a
    barrier, but what runs at the head of the chains is that coordinator, elsewhere."""

    keys: tuple[str, ...]
    arrived: int = 0
    #: Queued behind other ops: set once the hold heads every chain, or once the runner stops
    #: (``abandoned``). None: held (or abandoned) from the start.
    held: anyio.Event | None = None
    abandoned: bool = False
    #: Queued: what its chains wait on. None: its keys were free, so it heads chains that no
    #: task runs until it is released.
    released: anyio.Event | None = None


class Coordination(Protocol):
    """Runs the ops that involve other shards (see ``_crossshard``) once their local keys are
    held."""

    def local_keys(self, envelope: Envelope) -> tuple[str, ...] | None:
        """The keys the op's barrier holds here if the coordination runs it, else None."""
        ...

    async def run(self, run: Run) -> None: ...

    def start_now(self, run: Run) -> bool:
        """Take the op without a task if it can (see ``CrossShard.start_now``)."""
        ...


def error_type_name(exc: BaseException) -> str:
    """The type an op's error travels as: keyserial's own name, or ``module.Class``."""
    if isinstance(exc, OperationFailed):
        return exc.error_type
    kind = type(exc)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


class Executor:
    """Runs ops against the owner's state cache and reports each outcome to ``on_complete``.

    ``cache`` (key -> JSON state, ``None``: no state) and ``dirty`` (keys changed since the last
    commit) are the runner's; the executor updates both when an op succeeds.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        shard: int,
        fence: int,
        cache: dict[str, str | None],
        dirty: set[str],
        on_complete: Callable[[Run, str], None],
        coordination: Coordination | None = None,
        max_state_bytes: int = 16 << 20,
    ) -> None:
        self.shard = shard
        self._max_state_bytes = max_state_bytes
        self.task_group: TaskGroup | None = None
        self._coordination = coordination
        self._registry = registry
        self._fence = fence
        self._cache = cache
        self._dirty = dirty
        self._on_complete = on_complete
        self._chains: dict[str, deque[Run | Barrier | Hold]] = {}
        self._holds: set[Hold] = set()

    def schedule(self, run: Run) -> None:
        """Run now if every key is free and nothing needs awaiting; otherwise queue the op on
        each of its keys' chains. A multi-key op waits at the head of all its chains (a barrier);
        chains fill in stream order, so two barriers can never wait for each other."""
        envelope, coordination = run.envelope, self._coordination
        # Only an op that involves other shards holds fewer keys here than it names.
        local = None if coordination is None else coordination.local_keys(envelope)
        special = local is not None
        keys = envelope.keys if local is None else local
        definition = self._registry.get(envelope.name)
        if not special and not any(key in self._chains for key in keys) and (
            definition is None or not definition.is_async
        ):
            self._execute_now(run, definition)  # nothing to wait for: no task needed
            return
        if special and coordination is not None and coordination.start_now(run):
            return
        item: Run | Barrier = (
            run if len(keys) == 1 and not special else Barrier(run, len(keys), special)
        )
        for key in keys:
            self._enqueue(key, item)

    def try_hold(self, keys: tuple[str, ...]) -> Hold | None:
        """Hold ``keys`` now if nothing is queued on them (no task needed), else None."""
        if self.task_group is None or any(key in self._chains for key in keys):
            return None
        item = Hold(keys)
        for key in keys:
            self._chains[key] = deque([item])
        return item

    def hold(self, keys: tuple[str, ...]) -> Hold:
        """Queue a hold on ``keys``: its ``held`` is set once every op queued on them before it
        has run; ops queued after it wait until :meth:`release`."""
        item = Hold(keys)
        if self.task_group is None:  # the runner has stopped
            item.abandoned = True
            return item
        if not any(key in self._chains for key in keys):
            # Free keys: held at once, and no chain task until something queues behind it.
            for key in keys:
                self._chains[key] = deque([item])
            return item
        item.held, item.released = anyio.Event(), anyio.Event()
        self._holds.add(item)
        for key in keys:
            self._enqueue(key, item)
        return item

    def release(self, item: Hold) -> None:
        """Let the ops queued behind a hold run."""
        if item.released is not None:
            item.released.set()
            return
        if item.abandoned or self.task_group is None:
            return
        for key in item.keys:
            chain = self._chains[key]
            chain.popleft()
            if chain:
                self._task_group().start_soon(self._run_chain, key)
            else:
                del self._chains[key]

    def abandon_holds(self) -> None:
        """The runner stopped: its chains will never reach the holds still waiting."""
        for item in self._holds:
            item.abandoned = True
            assert item.held is not None, "only queued holds wait"
            item.held.set()
        self._holds.clear()

    def _enqueue(self, key: str, item: Run | Barrier | Hold) -> None:
        chain = self._chains.get(key)
        if chain is None:
            self._chains[key] = deque([item])
            self._task_group().start_soon(self._run_chain, key)
        else:
            chain.append(item)

    async def _run_chain(self, key: str) -> None:
        """Run a key's queued ops one after another; other keys' chains run meanwhile."""
        chain = self._chains[key]
        while chain:
            item = chain.popleft()
            if isinstance(item, Run):
                await self._execute(item)
                continue
            item.arrived += 1
            if isinstance(item, Hold):
                assert item.held is not None and item.released is not None, "queued"
                if item.arrived == len(item.keys):
                    self._holds.discard(item)
                    item.held.set()
                await item.released.wait()
                continue
            if item.arrived == item.needed:  # the last of its keys to get here runs it
                if item.coordinated:
                    assert self._coordination is not None
                    await self._coordination.run(item.run)
                else:
                    await self._execute(item.run)
                if item.done is not None:
                    item.done.set()
            else:
                if item.done is None:
                    item.done = anyio.Event()
                await item.done.wait()
        del self._chains[key]

    def problem(self, envelope: Envelope) -> str | None:
        """The error outcome of an op that cannot run at all (unknown, wrong kind), or None."""
        definition = self._registry.get(envelope.name)
        if definition is None:
            return self._error_outcome(
                envelope,
                UnknownOperation(
                    f"no op named {envelope.name!r} on this worker (it serves: "
                    f"{', '.join(self._registry.names())}); nothing was stored: once every"
                    " worker serves it, submit the same op id again"
                ),
            )
        if not _takes(definition, envelope):
            wanted = "a list of keys (submit_many)" if definition.multi_key else "one key (submit)"
            return self._error_outcome(
                envelope, MalformedOperation(f"op {envelope.name!r} takes {wanted}")
            )
        return None

    def refusal(self, run: Run) -> str | None:
        """:meth:`problem` for a run. An op this worker does not know is refused without
        storing the refusal (``run.keep``): during a rolling deploy, a worker that does know
        it must be able to run it when the caller submits the same op id again."""
        problem = self.problem(run.envelope)
        if problem is not None and self._registry.get(run.envelope.name) is None:
            run.keep = False
            log.error(
                "shard %d: op %r (%s) is not served by this worker; refused, nothing stored"
                " (deploy it to every worker of the namespace; the caller may resubmit the"
                " same op id then)", self.shard, run.envelope.name, run.envelope.op_id,
            )
        return problem

    def runs_inline(self, envelope: Envelope) -> bool:
        """Whether the op exists, takes the keys it was given, and is not ``async``."""
        definition = self._registry.get(envelope.name)
        return _takes(definition, envelope) and not definition.is_async

    async def evaluate(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        """Run a multi-key op on ``states`` (keys of any shard) without touching the cache:
        its outcome, and every key's new state (None if it failed). ``fences``: the fencing
        tokens of its keys on other shards, from their owners (this shard's keys get one of
        this shard's)."""
        definition = self._registry.get(envelope.name)
        assert definition is not None, "problem() is checked first"
        if not definition.is_async:
            return self.evaluate_now(envelope, states, fences)
        context = self._multi_context(envelope, states, fences)
        try:
            value = await definition.fn(context, *envelope.args, **envelope.kwargs)
        except Exception as exc:
            return self._error_outcome(envelope, exc), None
        return self._multi_outcome(envelope, context, value)

    def evaluate_now(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[str, dict[str, str | None] | None]:
        """:meth:`evaluate` for an op that :meth:`runs_inline`."""
        definition = self._registry.get(envelope.name)
        assert definition is not None and not definition.is_async, "runs_inline() first"
        context = self._multi_context(envelope, states, fences)
        try:
            value = definition.fn(context, *envelope.args, **envelope.kwargs)
        except Exception as exc:
            return self._error_outcome(envelope, exc), None
        return self._multi_outcome(envelope, context, value)

    def next_fence(self) -> int:
        """A fencing token for an op on this shard's keys: larger than every one before it
        (a new owner's start above all of an older owner's: they carry the epoch)."""
        self._fence += 1
        return self._fence

    def _multi_context(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> MultiContext:
        here = self.next_fence()
        return MultiContext(
            keys=envelope.keys,
            op_id=envelope.op_id,
            shard=self.shard,
            fences={key: fences.get(key, here) for key in envelope.keys},
            encoded_states=states,
        )

    def _multi_outcome(
        self, envelope: Envelope, context: MultiContext, value: Any
    ) -> tuple[str, dict[str, str | None] | None]:
        try:
            outcome, states = encode_ok(value), context.encoded_states()
        except (TypeError, ValueError) as exc:
            return self._error_outcome(envelope, _not_json(envelope, exc)), None
        if (too_large := self._too_large(envelope, outcome, states)) is not None:
            return self._error_outcome(envelope, too_large), None
        return outcome, states

    async def _execute(self, run: Run) -> None:
        definition = self._registry.get(run.envelope.name)
        if definition is None or not definition.is_async or self.problem(run.envelope):
            self._execute_now(run, definition)
            return
        context = self._context(run.envelope)
        try:
            value = await definition.fn(context, *run.envelope.args, **run.envelope.kwargs)
        except Exception as exc:
            self._failed(run, exc)
        else:
            self._succeeded(run, context, value)

    def _execute_now(self, run: Run, definition: Op[..., Any] | None) -> None:
        """Run ``run``'s op (``definition``: the registry's, looked up by the caller) now."""
        envelope = run.envelope
        if not _takes(definition, envelope):
            problem = self.refusal(run)
            assert problem is not None
            self._on_complete(run, problem)
            return
        context = self._context(envelope)
        try:
            value = definition.fn(context, *envelope.args, **envelope.kwargs)
        except Exception as exc:
            self._failed(run, exc)
        else:
            self._succeeded(run, context, value)

    def _context(self, envelope: Envelope) -> Context | MultiContext:
        if envelope.multi:
            return self._multi_context(
                envelope, {key: self._cache[key] for key in envelope.keys}, {}
            )
        return Context(
            key=envelope.key,
            op_id=envelope.op_id,
            shard=self.shard,
            fence=self.next_fence(),
            encoded_state=self._cache[envelope.key],
        )

    def _succeeded(self, run: Run, context: Context | MultiContext, value: Any) -> None:
        try:
            outcome = encode_ok(value)
            if isinstance(context, MultiContext):
                states = context.encoded_states()
            else:
                state = context.encoded_state()
        except (TypeError, ValueError) as exc:
            self._failed(run, _not_json(run.envelope, exc))
            return
        if not isinstance(context, MultiContext):
            states = {context.key: state}
        if (too_large := self._too_large(run.envelope, outcome, states)) is not None:
            self._failed(run, too_large)
            return
        for key, each in states.items():
            self._store(key, each)
        self._on_complete(run, outcome)

    def _too_large(
        self, envelope: Envelope, outcome: str, states: Mapping[str, str | None]
    ) -> ValueError | None:
        """Why an op may not commit what it produced (a state or result over
        ``max_state_bytes``: a step carrying it could grow past what Redis takes), or None."""
        limit = self._max_state_bytes
        quarter = limit // 4  # (a character is at most 4 bytes: the common case encodes none)
        if len(outcome) <= quarter and all(s is None or len(s) <= quarter for s in states.values()):
            return None
        sized = [("its result", outcome)]
        sized += [(f"key {key!r}", state) for key, state in states.items() if state is not None]
        for what, text in sized:
            if len(text.encode()) > limit:
                return ValueError(
                    f"op {envelope.name!r} left {what} at {len(text.encode())} bytes of JSON,"
                    f" over max_state_bytes ({limit}); nothing was written"
                )
        return None

    def _store(self, key: str, state: str | None) -> None:
        if state != self._cache[key]:
            self._cache[key] = state
            self._dirty.add(key)

    def _failed(self, run: Run, exc: Exception) -> None:
        self._on_complete(run, self._error_outcome(run.envelope, exc))

    def _error_outcome(self, envelope: Envelope, exc: Exception) -> str:
        if not isinstance(exc, OperationFailed):
            # The op's own refusal, reported to its caller: not a fault of the worker.
            log.info(
                "shard %d: op %r (%s) failed: %s: %s",
                self.shard,
                envelope.name,
                envelope.op_id,
                type(exc).__name__,
                exc,
            )
        data = exc.data if isinstance(exc, OperationFailed) else None
        message = exc.message if isinstance(exc, OperationFailed) else str(exc)
        return encode_error(error_type_name(exc), message, data)

    def _task_group(self) -> TaskGroup:
        assert self.task_group is not None, "the runner sets task_group before scheduling"
        return self.task_group


def _takes(definition: Op[..., Any] | None, envelope: Envelope) -> TypeGuard[Op[..., Any]]:
    """The op exists and takes what the envelope carries (one key, or a list of keys)."""
    return definition is not None and definition.multi_key == envelope.multi


def _not_json(envelope: Envelope, exc: Exception) -> TypeError:
    return TypeError(f"op {envelope.name!r} returned or stored non-JSON: {exc}")
