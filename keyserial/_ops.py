"""Defining ops (``@op``), naming them in calls (``call``), and the context they run with."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from ._wire.call import Call
from ._wire.json_text import dumps, loads
from .errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")

_ABSENT: Any = object()

#: Op names keyserial keeps for itself (a cross-shard grant request is one).
RESERVED_PREFIX = "keyserial."
#: The longest a timer an op sets may wait, in seconds (about 3,000 years: a due time of at
#: most 15 digits in ms).
MAX_TIMER_SECONDS = 10**11
_TIMER_ID = re.compile(r"[^#]+(#t[1-9][0-9]*)+")


def is_timer_id(op_id: str) -> bool:
    """Whether ``op_id`` names a timer an op set (``<op id>#t<n>``, ``…#t<n>#t<m>`` for one a
    timer's op set): the one kind of op id with '#' a worker runs, and only as its timer
    fires."""
    return _TIMER_ID.fullmatch(op_id) is not None


def call(name: str, *args: Any, **kwargs: Any) -> Call[Any]:
    """Name an op registered on the workers, with JSON-serializable arguments."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"op name must be a non-empty string, not {name!r}")
    if name.startswith(RESERVED_PREFIX):
        raise ValueError(f"op names starting with {RESERVED_PREFIX!r} are keyserial's: {name!r}")
    return Call(name, args, kwargs)


class Context:
    """What an op sees: its key, its op id, a fencing token, and the key's state.

    ``state`` is the key's committed JSON value (``None`` when the key has none). Assign to it, or
    mutate it in place; the new value commits atomically with the op's result. If the op raises,
    nothing it did to ``state`` is kept.

    ``op_id`` is stable across retries: pass it as an idempotency key to external systems.
    ``fence`` is the key's fencing token: every op on the key, multi-key ops included, gets a
    larger one than the op before it on that key, across owners, so an external store that
    keeps the last token per key refuses a stale writer (``UPDATE … WHERE fence < $1``). An op
    run again (its worker died before it committed) gets a new, larger token.

    :meth:`after` sets a timer: an op on the same key, due later, committed with this op's
    writes (none if the op raises); :meth:`cancel` removes one, likewise.
    """

    __slots__ = (
        "_accessed",
        "_encoded",
        "_value",
        "fence",
        "key",
        "op_id",
        "shard",
        "timers_cancelled",
        "timers_set",
    )

    def __init__(
        self, *, key: str, op_id: str, shard: int, fence: int, encoded_state: str | None
    ) -> None:
        self.key = key
        self.op_id = op_id
        self.shard = shard
        self.fence = fence
        self._encoded = encoded_state
        self._value: Any = _ABSENT
        self._accessed = False
        #: The timers this run sets: (timer id, seconds, call), in order.
        self.timers_set: list[tuple[str, float, Call[Any]]] = []
        #: The timer ids this run cancels, in order.
        self.timers_cancelled: list[str] = []

    def after(self, seconds: float, call: Call[Any]) -> str:
        """Run ``call`` on this key ``seconds`` from this op's commit (by Redis's clock), in the
        key's order then, once; returns the timer's id, ``<op id>#t<n>`` (the n-th this op
        sets), for :meth:`cancel` and ``ks.result(timer_id, key=...)``. The timer exists only
        if this op commits: if it raises, or its commit is fenced out, nothing is set. The
        same op run again sets the same ids.

        :raises TypeError, ValueError: for a bad delay or call (the op fails, nothing is set).
        """
        if not isinstance(seconds, (int, float)) or type(seconds) is bool:
            raise TypeError(f"seconds must be a number, not {seconds!r}")
        if not 0 <= seconds <= MAX_TIMER_SECONDS:  # (NaN too)
            raise ValueError(f"seconds must be 0 to {MAX_TIMER_SECONDS}, not {seconds!r}")
        if not isinstance(call, Call) or not isinstance(call.name, str) or not call.name:
            raise TypeError(f"expected an op call (op(...) or keyserial.call(...)), not {call!r}")
        if call.name.startswith(RESERVED_PREFIX):
            raise ValueError(f"op {call.name!r} is keyserial's own; a timer cannot run it")
        timer_id = f"{self.op_id}#t{len(self.timers_set) + 1}"
        self.timers_set.append((timer_id, float(seconds), call))
        return timer_id

    def cancel(self, timer_id: str) -> None:
        """Cancel the timer ``timer_id`` (an id :meth:`after` returned, on this key), with this
        op's writes: its op never runs after this op. One that ran before this op (or an id
        that names no timer) is left as it is.

        :raises ValueError: for a string that is not a timer's id.
        """
        if not isinstance(timer_id, str) or not is_timer_id(timer_id):
            raise ValueError(f"not a timer id (as ctx.after returns it): {timer_id!r}")
        self.timers_cancelled.append(timer_id)

    @property
    def state(self) -> Any:
        if self._value is _ABSENT:
            self._value = None if self._encoded is None else loads(self._encoded)
        self._accessed = True
        return self._value

    @state.setter
    def state(self, value: Any) -> None:
        self._value = value
        self._accessed = True

    def encoded_state(self) -> str | None:
        """The state to commit, as compact JSON (``None``: the key has no state).

        :raises TypeError, ValueError: if the op left a value JSON cannot carry.
        """
        if not self._accessed:
            return self._encoded
        if self._value is None:
            return None
        return dumps(self._value)


class _OwnStates(dict[str, Any]):
    """A multi-key op's states, which hold its keys and no other: a write elsewhere would be
    lost silently (only the op's own keys are committed, and held while it runs)."""

    __slots__ = ()

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self:
            raise KeyError(
                f"{key!r} is not a key of this op: a multi-key op writes only the"
                " keys it was submitted with"
            )
        super().__setitem__(key, value)


class MultiContext:
    """What a multi-key op sees: its keys (in the order the caller gave them), its op id, each
    key's fencing token, and every key's state.

    ``states`` maps each key to its committed JSON value (``None`` when it has none). Assign to
    ``states[key]`` or mutate values in place; all changes commit atomically with the result,
    or none do if the op raises. Assigning to a key the op was not submitted with raises
    ``KeyError``: it would never be committed.

    ``fences`` maps each key to its fencing token, as :attr:`Context.fence` (keys on other
    shards get their own shard's token, so each key's tokens keep increasing); ``fence`` is the
    first key's.
    """

    __slots__ = ("_encoded", "_states", "fence", "fences", "keys", "op_id", "shard")

    def __init__(
        self,
        *,
        keys: tuple[str, ...],
        op_id: str,
        shard: int,
        fences: Mapping[str, int],
        encoded_states: Mapping[str, str | None],
    ) -> None:
        self.keys = keys
        self.op_id = op_id
        self.shard = shard
        self.fences = dict(fences)
        self.fence = self.fences[keys[0]]
        self._encoded = dict(encoded_states)
        self._states: dict[str, Any] | None = None

    @property
    def states(self) -> dict[str, Any]:
        if self._states is None:
            self._states = _OwnStates(
                {key: None if raw is None else loads(raw) for key, raw in self._encoded.items()}
            )
        return self._states

    def encoded_states(self) -> dict[str, str | None]:
        """Every key's state to commit, as compact JSON (``None``: no state).

        :raises TypeError, ValueError: if the op left a value JSON cannot carry.
        """
        if self._states is None:
            return dict(self._encoded)
        return {
            key: None if self._states.get(key) is None else dumps(self._states[key])
            for key in self.keys
        }


class Op(Generic[P, R]):
    """An op function registered under a name. Calling it builds a :class:`Call`, it does not
    run it: ``await ks.submit("account:5", withdraw(30))``."""

    def __init__(
        self, fn: Callable[..., Any], name: str, *, multi_key: bool = False, inline: bool = False
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError(f"op name must be a non-empty string, not {name!r}")
        self.fn = fn
        self.name = name
        self.multi_key = multi_key
        self.is_async = inspect.iscoroutinefunction(fn)
        if inline and self.is_async:
            raise ConfigError(
                f"op {name!r}: inline=True is for sync ops (an async op runs on the event loop"
                " already, between its awaits)"
            )
        #: A sync op declared quick: it runs on the worker's event loop, between two awaits,
        #: with no thread hop. Every other sync op runs in a worker thread, so that the loop,
        #: the worker's other keys and its lease renewals never wait for it.
        self.inline = inline
        #: Whether the worker awaits it (``async``, or in a worker thread), so it needs a task;
        #: not run on the event loop with nothing to await. (Set once: the worker asks it of
        #: every op it runs.)
        self.awaited = self.is_async or not self.inline
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    @property
    def blocking(self) -> bool:
        """Whether the op runs in a worker thread: a sync op not declared ``inline``."""
        return not self.is_async and not self.inline

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Call[R]:
        return Call(self.name, args, kwargs)

    def __repr__(self) -> str:
        return f"<keyserial op {self.name!r}>"


class _NamedOp(Protocol):
    @overload
    def __call__(self, fn: Callable[Concatenate[Context, P], Awaitable[R]], /) -> Op[P, R]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[Context, P], R], /) -> Op[P, R]: ...


@overload
def op(fn: Callable[Concatenate[Context, P], Awaitable[R]], /) -> Op[P, R]: ...
@overload
def op(fn: Callable[Concatenate[Context, P], R], /) -> Op[P, R]: ...
@overload
def op(
    *, name: str | None = None, inline: bool = False, blocking: bool | None = None
) -> _NamedOp: ...
def op(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    inline: bool = False,
    blocking: bool | None = None,
) -> Any:
    """Register a function ``fn(ctx, *args, **kwargs)`` as an op, named after it unless ``name``.

    A sync op runs in a worker thread, its key held until it returns (ops on the key stay in
    order), while the worker's event loop, its other keys and its lease renewals go on: CPU
    work, ``time.sleep``, a blocking client such as ``requests`` or the Django ORM cannot
    stall them. ``inline=True`` declares a sync op quick (no I/O, well under a millisecond of
    CPU): it then runs on the event loop, between two awaits, with no thread hop, which is
    faster; but while it runs nothing else of its worker does, lease renewals included, so an
    inline op that is slow stalls every shard of the worker (a warning names it past 100 ms).
    An ``async def`` op runs on the event loop and may await I/O.

    ``blocking`` is deprecated: ``blocking=True`` is what every sync op does now, and
    ``blocking=False`` no longer runs an op on the event loop (declare ``inline=True``).
    """
    inline = _declared_inline(inline, blocking)

    def wrap(function: Callable[..., Any]) -> Op[..., Any]:
        _check_blocking(function, name, blocking)
        return Op(function, _op_name(function, name), inline=inline)

    return wrap if fn is None else wrap(fn)


@overload
def multi_op(fn: Callable[Concatenate[MultiContext, P], Awaitable[R]], /) -> Op[P, R]: ...
@overload
def multi_op(fn: Callable[Concatenate[MultiContext, P], R], /) -> Op[P, R]: ...
@overload
def multi_op(
    *, name: str | None = None, inline: bool = False, blocking: bool | None = None
) -> Callable[[Callable[..., Any]], Op[..., Any]]: ...
def multi_op(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    inline: bool = False,
    blocking: bool | None = None,
) -> Any:
    """Register ``fn(ctx: MultiContext, *args, **kwargs)`` as an op on several keys, submitted
    with ``ks.submit_many(keys, op(...))``: it sees and writes all their states atomically.
    ``inline`` and ``blocking``: as for :func:`op` (a sync one runs in a worker thread unless
    declared ``inline=True``)."""
    inline = _declared_inline(inline, blocking)

    def wrap(function: Callable[..., Any]) -> Op[..., Any]:
        _check_blocking(function, name, blocking)
        return Op(function, _op_name(function, name), multi_key=True, inline=inline)

    return wrap if fn is None else wrap(fn)


def _declared_inline(inline: bool, blocking: bool | None) -> bool:
    """``inline``, once the deprecated ``blocking`` has been checked against it (and warned of,
    at the line that declares the op)."""
    if blocking is None:
        return inline
    if blocking and inline:
        raise ConfigError(
            "an op is declared inline=True (on the event loop) or blocking=True (in a thread),"
            " not both; blocking=True is the default for sync ops now: drop it"
        )
    if blocking:
        message = (
            "@keyserial.op(blocking=True) is deprecated: every sync op runs in a worker thread"
            " now unless declared inline=True; drop blocking=True"
        )
    else:
        message = (
            "@keyserial.op(blocking=False) is deprecated and no longer runs a sync op on the"
            " event loop: sync ops run in a worker thread unless declared"
            " @keyserial.op(inline=True) (for quick ops only); drop blocking=False"
        )
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return inline


def _check_blocking(function: Any, name: str | None, blocking: bool | None) -> None:
    if blocking and inspect.iscoroutinefunction(function):
        raise ConfigError(
            f"op {name or getattr(function, '__name__', function)!r}: blocking=True is for sync"
            " ops (an async op runs on the event loop; make it sync, or await the blocking call"
            " through a thread)"
        )


def _where_defined(each: Op[..., Any]) -> str:
    fn = each.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _op_name(function: Any, name: str | None) -> str:
    """``name``, else the function's own; refuses what is not a plain function (an op already,
    a ``partial``, an object), whose name would be a guess."""
    if isinstance(function, Op) or not callable(function):
        raise TypeError(f"@keyserial.op and @keyserial.multi_op take a function, not {function!r}")
    if name is not None:
        return name
    own = getattr(function, "__name__", None)
    if not isinstance(own, str) or own == "<lambda>":
        raise TypeError(f"{function!r} has no name of its own: pass one, op(name=...)(fn)")
    return own


class Registry:
    """The ops a worker serves, by name."""

    def __init__(self, ops: Iterable[Op[..., Any]] = ()) -> None:
        self._ops: dict[str, Op[..., Any]] = {}
        for each in ops:
            self.add(each)

    def add(self, new: Op[..., Any]) -> None:
        if new.name.startswith(RESERVED_PREFIX):
            raise ConfigError(
                f"op names starting with {RESERVED_PREFIX!r} are reserved: {new.name!r}"
            )
        existing = self._ops.get(new.name)
        if existing is not None and existing.fn is not new.fn:
            raise ConfigError(
                f"two different ops are registered as {new.name!r}: {_where_defined(existing)}"
                f" and {_where_defined(new)} (op names are one namespace per worker, the"
                " ledger's deposit, withdraw, balance and transfer included)"
            )
        self._ops[new.name] = new

    def add_module(self, module: ModuleType | str) -> None:
        """Register every :class:`Op` defined at the top level of ``module``."""
        if isinstance(module, str):
            try:
                module = importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"cannot import app module {module!r}: {exc}") from exc
        found = [value for value in vars(module).values() if isinstance(value, Op)]
        if not found:
            raise ConfigError(f"app module {module.__name__!r} defines no @keyserial.op")
        for each in found:
            self.add(each)

    def get(self, name: str) -> Op[..., Any] | None:
        return self._ops.get(name)

    def names(self) -> list[str]:
        return sorted(self._ops)
