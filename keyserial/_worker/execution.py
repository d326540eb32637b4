"""Running one op: build its context, call it, turn what it returned (or raised) into an outcome
and new states. One path for every op: sync or ``async``, one key or several; only the ``await``
differs. A sync op runs in a worker thread unless it is declared ``inline`` (then on the event
loop, with nothing to await). Which op runs when is :mod:`.chains`' job.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeGuard

from .. import _telemetry as telemetry
from .._logfields import fields
from .._ops import Context, MultiContext, Op, Registry
from .._wire.codec import Envelope, encode_envelope, encode_error, encode_ok, inbox_item, pack_entry
from .._wire.messages import GrantRequest, KeyGrant
from ..errors import MalformedOperation, OperationFailed, TimerCancelled, UnknownOperation
from .keystates import KeyStates
from .opthreads import DaemonThreadPool
from .timers import TimerChanges

log = logging.getLogger("keyserial.worker")

#: An op's outcome (JSON), its keys' new states (None: it failed, nothing is written) and the
#: timers it set and cancelled (None: none, or it failed).
Evaluated = tuple[str, dict[str, str | None] | None, TimerChanges | None]
#: Seconds an ``inline`` op may hold the event loop before the worker warns that it should not
#: be (every shard of the worker, and its lease renewals, wait while it runs).
SLOW_INLINE_OP = 0.1
_SLOW_WARNING_EVERY = 60.0
#: The most sync ops a worker process runs at once, each in a thread of its own; more wait for
#: a thread (while the event loop, and every other op, go on). Daemon threads (``opthreads``):
#: the process never waits for an op it abandoned.
MAX_OP_THREADS = 40
#: The interpreter's switch interval once a process runs sync ops in threads (it is 5 ms by
#: default): a thread holding the GIL (CPU work in Python) hands it to the event loop only when
#: the loop has waited this long, at each of the loop's wake-ups. Lowering it to 1 ms took the
#: other keys' p99 beside a CPU-bound op from 82-136 ms to 31-48 ms (``benchmarks.blocking``).
OP_SWITCH_INTERVAL = 0.001


@dataclass(slots=True)
class Entry:
    """A fetched stream entry; progress may pass it once ``remaining`` reaches zero."""

    #: Its stream id ('' for one taken in from a push, until the step that moves it in).
    entry_id: str
    remaining: int
    #: What its replies name it by (``e``): its place in the inbox it was pushed to (or, for
    #: an entry appended to the stream itself, as before the inbox, its id).
    place: str


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
    #: A grant request's, for the participant shard (``crossshard.participant``); None for
    #: an op from the stream.
    request: GrantRequest | None = None
    #: A grant request whose hold is recorded already (held again at a takeover).
    recorded: bool = False
    #: A grant request's grant, once made (sent again if the request comes again).
    grant: KeyGrant | None = None
    #: The timers the op set and cancelled, once it has run (None: none).
    timers: TimerChanges | None = None


@dataclass(slots=True)
class _Raised:
    """What an op raised (an op may return an exception object as a value)."""

    error: Exception


def _escaped(cancelled: asyncio.CancelledError, *, on_loop: bool = True) -> Exception:
    """The failure of an op that let a ``CancelledError`` out of its own code (it awaited a
    task that was cancelled): an error like any other, not the end of the runner that ran it.
    One that cancels this task (the worker stopping) goes on up; in a worker thread
    (``on_loop`` false) there is no task, so it is always the op's own."""
    task = asyncio.current_task() if on_loop else None
    if task is not None and task.cancelling():
        raise cancelled
    return RuntimeError(
        "the op let asyncio.CancelledError escape (it awaited something that was"
        " cancelled); catch it in the op to say what failed"
    )


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


@dataclass(slots=True, eq=False)
class Executor:
    """Runs ops on a shard's key states and reports each outcome to ``on_complete``."""

    registry: Registry
    _: KW_ONLY
    shard: int
    #: The last fencing token handed out (see :meth:`next_fence`).
    last_fence: int
    states: KeyStates
    on_complete: Callable[[Run, str], None]
    max_state_bytes: int = 16 << 20
    _slow_inline_ops: _SlowInlineOps = field(default_factory=lambda: _SlowInlineOps())
    #: Timers cancelled by ops that ran (from the moment each ran, in a worker thread too),
    #: whose own ops may still come: each is answered as cancelled instead of running (the
    #: runner forgets one once neither can be in memory).
    cancelled: set[str] = field(default_factory=set)

    def definition(self, envelope: Envelope) -> Op[..., Any] | None:
        return self.registry.get(envelope.name)

    def inline_definition(self, envelope: Envelope) -> Op[..., Any] | None:
        """The op's definition if it exists, takes the keys it was given, and runs on the event
        loop with nothing to await (a sync op declared ``inline``); else None."""
        definition = self.definition(envelope)
        if _accepts_keys(definition, envelope) and not definition.awaited:
            return definition
        return None

    def in_thread(self, envelope: Envelope) -> bool:
        """Whether the op is a one-key sync op not declared ``inline``: it runs in a worker
        thread, where a key's consecutive ones may share a trip (:meth:`execute_in_thread`)."""
        definition = self.definition(envelope)
        return (
            definition is not None
            and not definition.multi_key
            and not envelope.multi
            and not definition.is_async
            and not definition.inline
        )

    def next_fence(self) -> int:
        """A fencing token for an op on this shard's keys: larger than every one before it
        (a new owner's start above all of an older owner's: they carry the epoch)."""
        self.last_fence += 1
        return self.last_fence

    # -- ops that cannot run -------------------------------------------------------------------

    def cannot_run(self, envelope: Envelope) -> str | None:
        """The error outcome of an op that cannot run at all (unknown, wrong kind), or None."""
        definition = self.definition(envelope)
        if definition is None:
            return self._error_outcome(
                envelope,
                UnknownOperation(
                    f"no op named {envelope.name!r} on this worker (it serves: "
                    f"{', '.join(self.registry.names())}); nothing was stored: once every"
                    " worker serves it, submit the same op id again"
                ),
            )
        if not _accepts_keys(definition, envelope):
            wanted = "a list of keys (submit_many)" if definition.multi_key else "one key (submit)"
            return self._error_outcome(
                envelope, MalformedOperation(f"op {envelope.name!r} takes {wanted}")
            )
        return None

    def refusal(self, run: Run) -> str | None:
        """:meth:`cannot_run` for a run. An op this worker does not know is refused without
        storing the refusal (``run.keep``): during a rolling deploy, a worker that does know
        it must be able to run it when the caller submits the same op id again."""
        refused = self.cannot_run(run.envelope)
        if refused is not None and self.definition(run.envelope) is None:
            run.keep = False
            log.error(
                "shard %d: op %r (%s) is not served by this worker; refused, nothing stored"
                " (deploy it to every worker of the namespace; the caller may resubmit the"
                " same op id then)",
                self.shard,
                run.envelope.name,
                run.envelope.op_id,
                extra=fields(
                    shard=self.shard,
                    op=run.envelope.name,
                    op_id=run.envelope.op_id,
                    error="UnknownOperation",
                ),
            )
        return refused

    def refuse_now(self, run: Run) -> bool:
        """Answer an op that cannot run with its :meth:`refusal`, now; False, with nothing
        done, if it can run."""
        refused = self.refusal(run)
        if refused is None:
            return False
        self.on_complete(run, refused)
        return True

    # -- running on the shard's states ---------------------------------------------------------

    def execute_now(self, run: Run, definition: Op[..., Any] | None = None) -> None:
        """Run an ``inline`` op (or refuse one that cannot run) on the shard's states, now.
        ``definition``: the op's, if the caller looked it up already (once per op: this is
        every single-key op's path)."""
        envelope = run.envelope
        if self.cancelled and envelope.op_id in self.cancelled:
            self.on_complete(run, cancelled_outcome(envelope.op_id))
            return
        if definition is None:
            definition = self.definition(envelope)
        if not _accepts_keys(definition, envelope):
            self.refuse_now(run)
            return
        if envelope.multi:
            states = self._current(envelope)
        else:
            key = envelope.key
            states = {key: self.states[key]}
        self.applied(run, self.evaluate_now(envelope, states, {}, definition))

    async def execute(self, run: Run) -> None:
        """Run any op on the shard's states: an ``async`` one is awaited, a sync one not
        declared ``inline`` runs in a worker thread."""
        definition = self.definition(run.envelope)
        if (
            definition is None
            or not definition.awaited
            or self.cannot_run(run.envelope)
            or run.envelope.op_id in self.cancelled
        ):
            self.execute_now(run)
            return
        if self.in_thread(run.envelope):
            await self.execute_in_thread([run])
            return
        envelope = run.envelope
        self.applied(run, await self.evaluate(envelope, self._current(envelope), {}))

    async def execute_in_thread(self, runs: list[Run]) -> None:
        """Run one key's consecutive sync ops (each :meth:`in_thread`), in stream order, in one
        trip to a worker thread: each sees the state the one before it left, and each outcome
        is applied on the event loop as soon as the loop is free to take it, in order. A hot
        key's ops thus share the thread hop, and commit in batches as inline ops do."""
        key = runs[0].envelope.key
        assert all(self.in_thread(run.envelope) and run.envelope.key == key for run in runs)
        fences = [self.next_fence() for _ in runs]  # (on the loop: the thread takes none)
        trip = _Trip(self, runs, fences, self.states[key], asyncio.get_running_loop())
        try:
            rest = await asyncio.get_running_loop().run_in_executor(_op_threads(), trip.run)
        except BaseException:
            # (The runner stops: what the thread still returns is dropped, as a killed
            # worker's would be, and it starts no other op of the trip.)
            trip.abandoned = True
            raise
        trip.apply(rest)
        assert trip.applied_count == len(runs), "every op of the trip has its outcome"

    def evaluate_in_thread(self, envelope: Envelope, state: str | None, fence: int) -> Evaluated:
        """Run a one-key sync op on ``state`` in this (worker) thread, touching nothing else:
        :meth:`evaluate_now` off the event loop."""
        definition = self.definition(envelope)
        assert definition is not None, "in_thread() first"
        context = Context(
            key=envelope.key,
            op_id=envelope.op_id,
            shard=self.shard,
            fence=fence,
            encoded_state=state,
        )
        traced = telemetry.tracer()
        if traced is None:
            value = _called(definition.fn, context, envelope, False)
        else:
            with _run_span(traced, envelope) as span:
                value = _called(definition.fn, context, envelope, False)
                _record(span, value)
        return self._end(envelope, context, value)

    def _current(self, envelope: Envelope) -> dict[str, str | None]:
        return {key: self.states[key] for key in envelope.keys}

    def applied(self, run: Run, evaluated: Evaluated) -> None:
        """Write an op's new states and report its outcome (with the timers it set and
        cancelled, which commit with it)."""
        outcome, new_states, timers = evaluated
        for key, state in (new_states or {}).items():
            self.states.write(key, state)
        if timers is not None:
            run.timers = timers
        self.on_complete(run, outcome)

    # -- running on given states ---------------------------------------------------------------

    def evaluate_now(
        self,
        envelope: Envelope,
        states: Mapping[str, str | None],
        fences: Mapping[str, int],
        definition: Op[..., Any] | None = None,
    ) -> Evaluated:
        """Run an ``inline`` op on ``states`` (keys of any shard), touching nothing else: its
        outcome, and every key's new state (None if it failed). ``fences``: the fencing tokens
        of its keys on other shards, from their owners (this shard's keys get one of this
        shard's). ``definition``: the op's, if looked up and checked already (as
        :meth:`execute_now` and :meth:`inline_definition` do)."""
        definition, context = self._begin(envelope, states, fences, definition)
        assert not definition.awaited, "inline_definition() first"
        began = time.monotonic()
        traced = telemetry.tracer()
        if traced is None:  # (the common case: no span, and no context manager either)
            value = _called(definition.fn, context, envelope)
        else:
            with _run_span(traced, envelope) as span:
                value = _called(definition.fn, context, envelope)
                _record(span, value)
        if (took := time.monotonic() - began) >= SLOW_INLINE_OP:
            self._slow_inline_ops.warn(envelope, took)
        return self._end(envelope, context, value)

    async def evaluate(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> Evaluated:
        """:meth:`evaluate_now` for any op: an ``async`` one is awaited, a sync one not
        ``inline`` runs in a worker thread."""
        if (definition := self.inline_definition(envelope)) is not None:
            return self.evaluate_now(envelope, states, fences, definition)
        definition, context = self._begin(envelope, states, fences)
        traced = telemetry.tracer()
        if traced is None:
            return self._end(envelope, context, await _awaited_call(definition, context, envelope))
        with _run_span(traced, envelope) as span:
            value = await _awaited_call(definition, context, envelope)
            _record(span, value)
        return self._end(envelope, context, value)

    def _begin(
        self,
        envelope: Envelope,
        states: Mapping[str, str | None],
        fences: Mapping[str, int],
        definition: Op[..., Any] | None = None,
    ) -> tuple[Op[..., Any], Context | MultiContext]:
        if definition is None:  # (one given was checked: see evaluate_now)
            definition = self.definition(envelope)
            assert _accepts_keys(definition, envelope), "cannot_run() is checked first"
        self.last_fence += 1  # (next_fence(), inline: every op takes one)
        here = self.last_fence
        if not envelope.multi:
            key = envelope.keys[0]
            return definition, Context(
                key=key,
                op_id=envelope.op_id,
                shard=self.shard,
                fence=fences.get(key, here) if fences else here,
                encoded_state=states[key],
            )
        return definition, MultiContext(
            keys=envelope.keys,
            op_id=envelope.op_id,
            shard=self.shard,
            fences={key: fences.get(key, here) for key in envelope.keys},
            encoded_states=states,
        )

    def _end(self, envelope: Envelope, context: Context | MultiContext, value: Any) -> Evaluated:
        """The outcome of an op that returned ``value`` (or raised: :class:`_Raised`)."""
        if isinstance(value, _Raised):
            return self._error_outcome(envelope, value.error), None, None
        timers = None
        try:
            outcome = encode_ok(value)
            if isinstance(context, MultiContext):
                states = context.encoded_states()
            else:
                states = {context.key: context.encoded_state()}
                timers = timer_changes(context)
        except (TypeError, ValueError) as exc:
            error = TypeError(f"op {envelope.name!r} returned or stored non-JSON: {exc}")
            return self._error_outcome(envelope, error), None, None
        if (too_large := self._too_large(envelope, outcome, states)) is not None:
            return self._error_outcome(envelope, too_large), None, None
        if timers is not None and timers.cancelled:
            # (At once, in a worker thread too: an op of the same trip behind it checks it.)
            self.cancelled.update(timers.cancelled)
        return outcome, states, timers

    def _too_large(
        self, envelope: Envelope, outcome: str, states: Mapping[str, str | None]
    ) -> ValueError | None:
        """Why an op may not commit what it produced (a state or result over
        ``max_state_bytes``: a step carrying it could grow past what Redis takes), or None."""
        limit = self.max_state_bytes
        quarter = limit // 4  # (a character is at most 4 bytes: the common case encodes none)
        for state in states.values():  # (a loop, not all(): this is every op's path)
            if state is not None and len(state) > quarter:
                break
        else:
            if len(outcome) <= quarter:
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

    def _error_outcome(self, envelope: Envelope, exc: Exception) -> str:
        if isinstance(exc, OperationFailed):
            return encode_error(error_type_name(exc), exc.message, exc.data)
        message = _described(exc)
        # (An error keyserial made for the op, such as a result JSON cannot carry, was never
        # raised: it has no traceback to tell.)
        remote = remote_traceback(exc) if exc.__traceback__ is not None else None
        # The op's own failure, reported to its caller: not a fault of the worker (INFO), but
        # its stack is where the op's author looks.
        log.info(
            "shard %d: op %r (%s) on key %r failed: %s: %s%s",
            self.shard,
            envelope.name,
            envelope.op_id,
            envelope.key,
            type(exc).__name__,
            message,
            "" if remote is None else "\n" + remote,
            extra=fields(
                shard=self.shard,
                key=envelope.key,
                op=envelope.name,
                op_id=envelope.op_id,
                error=type(exc).__name__,
            ),
        )
        return encode_error(error_type_name(exc), message, None, remote)


@dataclass(slots=True, eq=False)
class _Trip:
    """One key's sync ops run one after another in a worker thread (:meth:`run`), their
    outcomes sent back to the event loop (:meth:`apply`): at once when none is on its way,
    else together with the next, so that the loop takes them in batches while it is busy."""

    executor: Executor
    runs: list[Run]
    fences: list[int]
    #: The key's state before the first op: each op then sees the one before it left.
    state: str | None
    loop: asyncio.AbstractEventLoop
    #: Set on the loop once the runner stops: nothing more is run or applied.
    abandoned: bool = False
    #: How many outcomes the loop has applied (in order: the assertion in :meth:`apply`).
    applied_count: int = 0
    #: Whether outcomes sent to the loop wait there to be applied.
    _sent: bool = False

    def run(self) -> list[tuple[Run, Evaluated]]:
        """In the worker thread: run the ops; the outcomes not sent to the loop yet."""
        pending: list[tuple[Run, Evaluated]] = []
        state = self.state
        for run, fence in zip(self.runs, self.fences, strict=True):
            if self.abandoned:
                break
            if (op_id := run.envelope.op_id) in self.executor.cancelled:
                evaluated: Evaluated = (cancelled_outcome(op_id), None, None)
            else:
                evaluated = self.executor.evaluate_in_thread(run.envelope, state, fence)
            if evaluated[1] is not None:
                state = evaluated[1][run.envelope.key]
            pending.append((run, evaluated))
            if not self._sent:
                self._sent = True
                try:
                    self.loop.call_soon_threadsafe(self.apply, pending)
                except RuntimeError:  # (the loop has closed: the worker is gone)
                    return []
                pending = []
        return pending

    def apply(self, done: list[tuple[Run, Evaluated]]) -> None:
        """On the event loop: apply outcomes (their states written, each run completed)."""
        self._sent = False
        if self.abandoned:
            return
        for run, evaluated in done:
            assert run is self.runs[self.applied_count], "a trip's outcomes apply in order"
            self.applied_count += 1
            self.executor.applied(run, evaluated)


def timer_changes(context: Context) -> TimerChanges | None:
    """What ``context``'s op set and cancelled (None: nothing), encoded for its commit.

    :raises TypeError, ValueError: for a timer's call that JSON cannot carry.
    """
    if not context.timers_set and not context.timers_cancelled:
        return None
    timers = tuple(
        (
            timer_id,
            math.ceil(seconds * 1000),
            inbox_item(
                pack_entry([encode_envelope(timer_id, context.key, call, None)]), fresh=False
            ),
        )
        for timer_id, seconds, call in context.timers_set
    )
    return TimerChanges(timers, tuple(context.timers_cancelled))


def cancelled_outcome(timer_id: str) -> str:
    """What a cancelled timer's op id is answered with (stored by the cancel's commit)."""
    return encode_error(TimerCancelled.wire_type, f"timer {timer_id!r} was cancelled before it ran")


#: The most of a failed op's traceback an outcome carries: its start (the outermost frames)
#: and its end (where it raised), the middle cut out.
TRACEBACK_LIMIT = 8192


def remote_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as text, at most ``TRACEBACK_LIMIT`` characters."""
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception as failure:  # (an exception whose repr raises: its failure still counts)
        return f"(the traceback could not be formatted: {type(failure).__name__})"
    if len(text) <= TRACEBACK_LIMIT:
        return text
    head, tail = TRACEBACK_LIMIT // 4, TRACEBACK_LIMIT * 3 // 4 - 100
    cut = len(text) - head - tail
    return f"{text[:head]}\n... ({cut} characters cut) ...\n{text[-tail:]}"


def _described(exc: Exception) -> str:
    """``str(exc)``, or a stand-in if the op's exception cannot say what it is: its failure
    must reach the caller, never stop the shard."""
    try:
        return str(exc)
    except Exception as failure:
        return f"(str() of this {type(exc).__name__} raised {type(failure).__name__})"


async def _awaited_call(
    definition: Op[..., Any], context: Context | MultiContext, envelope: Envelope
) -> Any:
    """What an ``async`` op returned, or a sync one (not ``inline``) in a worker thread; or
    what it raised (as :class:`_Raised`)."""
    if not definition.is_async:
        # (Abandoned on cancel: a thread cannot be stopped, and the runner's end must not
        # wait for it; what it returns then is dropped, as a killed worker's would be.)
        return await asyncio.get_running_loop().run_in_executor(
            _op_threads(), _called, definition.fn, context, envelope, False
        )
    try:
        return await definition.fn(context, *envelope.args, **envelope.kwargs)
    except Exception as exc:
        return _Raised(exc)
    except asyncio.CancelledError as exc:
        return _Raised(_escaped(exc))


def _op_threads() -> DaemonThreadPool:
    """The threads this process runs sync ops in (a forked child gets threads of its own)."""
    return _threads_of(os.getpid())


@functools.cache
def _threads_of(pid: int) -> DaemonThreadPool:
    if sys.getswitchinterval() > OP_SWITCH_INTERVAL:  # (lowered, never raised)
        sys.setswitchinterval(OP_SWITCH_INTERVAL)
    return DaemonThreadPool(MAX_OP_THREADS, f"keyserial-op-{pid}")


def _run_span(traced: Any, envelope: Envelope) -> AbstractContextManager[telemetry.RunSpan]:
    """The op's run as a span, the child of the submit that sent it (OpenTelemetry)."""
    keys = envelope.keys if envelope.multi else envelope.key
    return telemetry.running(traced, envelope.name, keys, envelope.op_id, envelope.trace)


def _record(span: telemetry.RunSpan, value: Any) -> None:
    if isinstance(value, _Raised):
        span.error = value.error


def _called(
    fn: Callable[..., Any],
    context: Context | MultiContext,
    envelope: Envelope,
    on_loop: bool = True,
) -> Any:
    """What a sync op returned, or what it raised (as :class:`_Raised`); ``on_loop`` false: in
    a worker thread."""
    try:
        return fn(context, *envelope.args, **envelope.kwargs)
    except Exception as exc:
        return _Raised(exc)
    except asyncio.CancelledError as exc:
        return _Raised(_escaped(exc, on_loop=on_loop))


class _SlowInlineOps:
    """Warns of an ``inline`` op that held the event loop for ``SLOW_INLINE_OP`` or more: once
    per op name, then at most once a minute, with how long it took."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, envelope: Envelope, took: float) -> None:
        now = time.monotonic()
        if now - self._last.get(envelope.name, -_SLOW_WARNING_EVERY) < _SLOW_WARNING_EVERY:
            return
        self._last[envelope.name] = now
        log.warning(
            "op %r (%s) is declared inline but ran %.2fs on the worker's event loop: every"
            " shard of this worker, and its lease renewals, waited meanwhile. Drop"
            " inline=True to run it in a worker thread, or make it async",
            envelope.name,
            envelope.op_id,
            took,
            extra=fields(op=envelope.name, op_id=envelope.op_id, key=envelope.key),
        )


def _accepts_keys(definition: Op[..., Any] | None, envelope: Envelope) -> TypeGuard[Op[..., Any]]:
    """The op exists and takes what the envelope carries (one key, or a list of keys)."""
    return definition is not None and definition.multi_key == envelope.multi
