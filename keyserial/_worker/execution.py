"""Running one op: build its context, call it, turn what it returned (or raised) into an outcome
and new states. One path for every op: sync or ``async``, one key or several; only the ``await``
differs. Which op runs when is :mod:`._chains`' job.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeGuard

import anyio
import anyio.to_thread

from .. import _telemetry as telemetry
from .._logfields import fields
from .._ops import Context, MultiContext, Op, Registry
from .._wire.codec import Envelope, encode_error, encode_ok
from ..errors import MalformedOperation, OperationFailed, UnknownOperation
from .keystates import KeyStates

log = logging.getLogger("keyserial.worker")

#: An op's outcome (JSON) and its keys' new states (None: it failed, nothing is written).
Evaluated = tuple[str, dict[str, str | None] | None]
#: Seconds a sync op may hold the event loop before the worker warns that it should be
#: ``blocking`` (every shard of the worker waits while it runs).
SLOW_INLINE_OP = 0.1
_SLOW_WARNING_EVERY = 60.0


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
class _Raised:
    """What an op raised (an op may return an exception object as a value)."""

    error: Exception


def _escaped(cancelled: asyncio.CancelledError) -> Exception:
    """The failure of an op that let a ``CancelledError`` out of its own code (it awaited a
    task that was cancelled): an error like any other, not the end of the runner that ran it.
    One that cancels this task (the worker stopping) goes on up."""
    task = asyncio.current_task()
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

    def definition(self, envelope: Envelope) -> Op[..., Any] | None:
        return self.registry.get(envelope.name)

    def runs_inline(self, envelope: Envelope) -> bool:
        """Whether the op exists, takes the keys it was given, and runs on the event loop with
        nothing to await (neither ``async`` nor ``blocking``)."""
        definition = self.definition(envelope)
        return _accepts_keys(definition, envelope) and not _awaited(definition)

    def awaited(self, envelope: Envelope) -> bool:
        """Whether the op has to be awaited (``async``, or ``blocking``: in a thread), so it
        needs a task; an op that cannot run is refused at once, with no task."""
        definition = self.definition(envelope)
        return definition is not None and _awaited(definition)

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

    # -- running on the shard's states ---------------------------------------------------------

    def execute_now(self, run: Run) -> None:
        """Run a sync op (or refuse one that cannot run) on the shard's states, now."""
        refused = self.refusal(run)
        if refused is not None:
            self.on_complete(run, refused)
            return
        envelope = run.envelope
        self._applied(run, self.evaluate_now(envelope, self._current(envelope), {}))

    async def execute(self, run: Run) -> None:
        """Run any op on the shard's states: an ``async`` one is awaited, a ``blocking`` one
        runs in a worker thread."""
        definition = self.definition(run.envelope)
        if definition is None or not _awaited(definition) or self.cannot_run(run.envelope):
            self.execute_now(run)
            return
        envelope = run.envelope
        self._applied(run, await self.evaluate(envelope, self._current(envelope), {}))

    def _current(self, envelope: Envelope) -> dict[str, str | None]:
        return {key: self.states[key] for key in envelope.keys}

    def _applied(self, run: Run, evaluated: Evaluated) -> None:
        outcome, new_states = evaluated
        for key, state in (new_states or {}).items():
            self.states.write(key, state)
        self.on_complete(run, outcome)

    # -- running on given states ---------------------------------------------------------------

    def evaluate_now(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> Evaluated:
        """Run a sync op on ``states`` (keys of any shard), touching nothing else: its outcome,
        and every key's new state (None if it failed). ``fences``: the fencing tokens of its
        keys on other shards, from their owners (this shard's keys get one of this shard's)."""
        definition, context = self._begin(envelope, states, fences)
        assert not _awaited(definition), "runs_inline() first"
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
        """:meth:`evaluate_now` for any op: an ``async`` one is awaited."""
        if self.runs_inline(envelope):
            return self.evaluate_now(envelope, states, fences)
        definition, context = self._begin(envelope, states, fences)
        traced = telemetry.tracer()
        if traced is None:
            return self._end(envelope, context, await _awaited_call(definition, context, envelope))
        with _run_span(traced, envelope) as span:
            value = await _awaited_call(definition, context, envelope)
            _record(span, value)
        return self._end(envelope, context, value)

    def _begin(
        self, envelope: Envelope, states: Mapping[str, str | None], fences: Mapping[str, int]
    ) -> tuple[Op[..., Any], Context | MultiContext]:
        definition = self.definition(envelope)
        assert _accepts_keys(definition, envelope), "cannot_run() is checked first"
        here = self.next_fence()
        if not envelope.multi:
            return definition, Context(
                key=envelope.key,
                op_id=envelope.op_id,
                shard=self.shard,
                fence=fences.get(envelope.key, here),
                encoded_state=states[envelope.key],
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
            return self._error_outcome(envelope, value.error), None
        try:
            outcome = encode_ok(value)
            if isinstance(context, MultiContext):
                states = context.encoded_states()
            else:
                states = {context.key: context.encoded_state()}
        except (TypeError, ValueError) as exc:
            error = TypeError(f"op {envelope.name!r} returned or stored non-JSON: {exc}")
            return self._error_outcome(envelope, error), None
        if (too_large := self._too_large(envelope, outcome, states)) is not None:
            return self._error_outcome(envelope, too_large), None
        return outcome, states

    def _too_large(
        self, envelope: Envelope, outcome: str, states: Mapping[str, str | None]
    ) -> ValueError | None:
        """Why an op may not commit what it produced (a state or result over
        ``max_state_bytes``: a step carrying it could grow past what Redis takes), or None."""
        limit = self.max_state_bytes
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


def _awaited(definition: Op[..., Any]) -> bool:
    """Whether the op is awaited (``async``, or ``blocking``: in a thread), not run inline."""
    return definition.is_async or definition.blocking


async def _awaited_call(
    definition: Op[..., Any], context: Context | MultiContext, envelope: Envelope
) -> Any:
    """What an ``async`` op returned, or a ``blocking`` one in a worker thread; or what it
    raised (as :class:`_Raised`)."""
    if definition.blocking:
        # (Abandoned on cancel: a thread cannot be stopped, and the runner's end must not
        # wait for it; what it returns then is dropped, as a killed worker's would be.)
        return await anyio.to_thread.run_sync(
            _called, definition.fn, context, envelope, abandon_on_cancel=True
        )
    try:
        return await definition.fn(context, *envelope.args, **envelope.kwargs)
    except Exception as exc:
        return _Raised(exc)
    except asyncio.CancelledError as exc:
        return _Raised(_escaped(exc))


def _run_span(traced: Any, envelope: Envelope) -> AbstractContextManager[Any]:
    """The op's run as a span, the child of the submit that sent it (OpenTelemetry)."""
    keys = envelope.keys if envelope.multi else envelope.key
    return telemetry.running(traced, envelope.name, keys, envelope.op_id, envelope.trace)


def _record(span: Any, value: Any) -> None:
    if isinstance(value, _Raised):
        telemetry.failed(span, value.error)


def _called(fn: Callable[..., Any], context: Context | MultiContext, envelope: Envelope) -> Any:
    """What a sync op returned, or what it raised (as :class:`_Raised`)."""
    try:
        return fn(context, *envelope.args, **envelope.kwargs)
    except Exception as exc:
        return _Raised(exc)
    except asyncio.CancelledError as exc:
        return _Raised(_escaped(exc))


class _SlowInlineOps:
    """Warns of a sync op that held the event loop for ``SLOW_INLINE_OP`` or more: once per op
    name, then at most once a minute, with how long it took."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, envelope: Envelope, took: float) -> None:
        now = time.monotonic()
        if now - self._last.get(envelope.name, -_SLOW_WARNING_EVERY) < _SLOW_WARNING_EVERY:
            return
        self._last[envelope.name] = now
        log.warning(
            "op %r (%s) ran %.2fs on the worker's event loop: every shard of this worker"
            " waited meanwhile. Declare it @keyserial.op(blocking=True) to run it in a"
            " thread, or make it async",
            envelope.name,
            envelope.op_id,
            took,
            extra=fields(op=envelope.name, op_id=envelope.op_id, key=envelope.key),
        )


def _accepts_keys(definition: Op[..., Any] | None, envelope: Envelope) -> TypeGuard[Op[..., Any]]:
    """The op exists and takes what the envelope carries (one key, or a list of keys)."""
    return definition is not None and definition.multi_key == envelope.multi
