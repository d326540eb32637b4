"""One awaited submit, from the client's queue to its outcome, and what it ends with."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .._scripts.submit import Pushed
from .._wire.codec import envelope_binding, with_reply
from .._wire.layout import ShardKeys
from ..errors import KeyserialError, OperationFailed


@dataclass(frozen=True, slots=True)
class When:
    """When a delayed op is due: the submit script's ``due`` argument (``+<ms>`` from now, or
    ``<ms>`` since the Unix epoch, by Redis's clock), and about how many seconds that is from
    now by this process's clock (its waits count from then)."""

    due: str
    seconds: float


#: What a pending submit is settled with when its timeout fires first.
TIMED_OUT: dict[str, Any] = {}
#: What an enqueued op is settled with once it is appended.
APPENDED: dict[str, Any] = {}


@dataclass(slots=True, eq=False)  # (eq=False: one submit is itself, never equal to another)
class Pending:
    """One awaited submit."""

    op_id: str
    keys: str | tuple[str, ...]
    #: The shard the op is appended to (its home).
    shard: ShardKeys
    envelope: str
    # A bare future of the client's own loop: an anyio Event costs several times as much to
    # make, once per submit, and the client's transport is bound to that loop anyway.
    done: asyncio.Future[None]
    _: KW_ONLY
    #: The op id was generated for this submit: no entry carried it before.
    fresh: bool
    #: Settled once appended (:data:`APPENDED`), for an enqueue that does not wait for the op.
    appended_only: bool = False
    #: When the op is due (None: now): the submit script's ``due`` argument.
    due: str = ""
    outcome: dict[str, Any] | BaseException | None = field(default=None, init=False)
    #: When its reply may be expected from (by the monotonic clock): a delayed op's, once
    #: it is due (the sweep looks up the replies overdue since).
    since: float = field(default_factory=time.monotonic)
    #: Where the entry that carries the op was pushed, once it was (the sweep checks it is
    #: there).
    entry: Pushed | None = field(default=None, init=False)

    @property
    def key(self) -> str:
        """The op's key; for a multi-key op, its first."""
        return self.keys if isinstance(self.keys, str) else self.keys[0]

    @property
    def all_keys(self) -> tuple[str, ...]:
        return (self.keys,) if isinstance(self.keys, str) else self.keys

    def binding(self) -> str:
        """What an outcome stored under the op id must be bound to, to be this op's (the
        envelope is read again: asked only of an outcome stored with a binding)."""
        return envelope_binding(self.envelope)

    def settle(self, outcome: dict[str, Any] | BaseException) -> None:
        if not self.done.done():  # (also done once its waiter is cancelled)
            self.outcome = outcome
            self.done.set_result(None)

    def expire(self) -> None:
        self.settle(TIMED_OUT)

    def rehome(self, shard: ShardKeys, reply: str) -> None:
        """Append the op to ``shard`` instead (a reshard sealed the one it was refused by), with
        replies on ``reply``."""
        self.shard, self.envelope = shard, with_reply(self.envelope, reply)

    def appended(self, entry: Pushed) -> None:
        """The entry pushed as ``entry`` carries the op now."""
        self.entry = entry
        if self.appended_only:
            self.settle(APPENDED)

    def lost(self) -> None:
        """Its entry is gone with no outcome (a failover lost it): it is appended again, not
        fresh, and a delayed one due when it was (by Redis's clock, as its push was told)."""
        if self.entry is not None and self.entry.delayed:
            self.due = str(self.entry.due_ms)
        self.entry, self.fresh = None, False


#: The slices of time submits' deadlines are kept in, in seconds: a submit times out at most
#: this much after its timeout, never before it.
DEADLINE_SLICE = 0.02


class Deadlines:
    """The timeouts of a client's submits: one timer per slice of time, for every submit whose
    deadline falls in that slice, instead of a timer of each submit's own (whose making and
    cancelling took a tenth of a submit's Python calls). A submit settled before its deadline
    leaves its slice at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slices: dict[int, set[Pending]] = {}

    def add(self, pending: Pending, seconds: float) -> int:
        """Expire ``pending`` once ``seconds`` have passed, unless discarded first; returns its
        slice, for :meth:`discard`."""
        at = math.ceil((self._loop.time() + seconds) / DEADLINE_SLICE)
        members = self._slices.get(at)
        if members is None:
            members = self._slices[at] = set()
            self._loop.call_at(at * DEADLINE_SLICE, self._expire, at)
        members.add(pending)
        return at

    def discard(self, pending: Pending, at: int) -> None:
        members = self._slices.get(at)
        if members is not None:
            members.discard(pending)

    def __len__(self) -> int:
        """Submits waiting for their deadline."""
        return sum(len(members) for members in self._slices.values())

    def _expire(self, at: int) -> None:
        for pending in self._slices.pop(at, ()):
            pending.expire()


def closed_while_waiting(pending: Pending, *, sent: bool) -> KeyserialError:
    """What a submit still waiting when its client closes fails with."""
    op_id = pending.op_id
    if not sent:
        return KeyserialError(
            f"the client was closed before op {op_id!r} was sent; it was never appended"
        )
    keys = pending.all_keys
    where = repr(keys[0]) if len(keys) == 1 else repr(list(keys))
    return KeyserialError(
        f"the client was closed while op {op_id!r} waited for its outcome; it may still apply."
        f" Fetch its outcome on an open client with `ks.result({op_id!r}, key={where})`,"
        f" or resubmit with op_id={op_id!r} (it never runs twice)."
    )


def value_or_raise(outcome: dict[str, Any], *, keys: tuple[str, ...], op_id: str) -> Any:
    """An op's value, or its error raised."""
    if "error" in outcome:
        raise OperationFailed.from_wire(outcome["error"], key=keys[0], op_id=op_id, keys=keys)
    return outcome["ok"]
