"""A shard owner's side of pushes (``submit.lua``): a fresh entry arrives in its wake-up, naming
the entry that stood last in the stream before it. The owner takes such entries in, without
fetching them, as long as each one follows on from its cursor; it fetches when that chain breaks
(an entry appended another way, a lost message, a key whose state it has not cached), when a
plain wake-up announces an entry, and at its poll. One per runner; only its step loop touches it.

A push is a hint: anyone who may publish on the wake channel could have sent it. The owner runs
a pushed entry at once, but the next step first confirms, in the script, that the stream holds
exactly the pushed entries after the cursor, each with the pushed fields (sent with the step and
compared whole: a Lua string comparison costs less than hashing them there); it commits nothing
otherwise (``UNCONFIRMED``), and the owner gives the shard up to start again from what Redis has.
So no progress, horizon or result ever passes an entry that Redis does not hold as it ran.

An owner takes pushes only once a step of its own has recorded that it does (``takes_pushes``):
a takeover then counts every entry in the stream as one it may have run, so an op that kills
the owner before any step of its records the entry still takes its strike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .._scripts.commit import StepReply
from .._wire.codec import Push, parse_id
from .intake import entry_keys
from .keystates import KeyStates

#: Pushes kept at most while the owner takes none in (replaying, or at ``max_inflight``): past
#: that, they are dropped and the owner fetches instead.
MAX_WAITING = 1024


@dataclass(slots=True, eq=False)
class Wakeups:
    """The pushes a runner got, and whether its next step fetches."""

    #: Pushes not taken in yet, in the order they came (the order of the stream).
    _waiting: list[Push] = field(default_factory=list)
    #: Whether the next step fetches: the stream may hold entries that no push brings.
    must_fetch: bool = True
    #: Whether a step of this owner has recorded that it takes pushes (until then it takes none).
    recorded: bool = False
    #: The cursor before the first entry taken in from a push since the last step.
    _taken_after: str = ""
    #: The entries taken in from pushes since the last step: (entry id, its fields).
    _taken: list[tuple[str, Mapping[bytes, bytes]]] = field(default_factory=list)

    def push(self, pushed: Push) -> None:
        """Keep a push for :meth:`take` (past :data:`MAX_WAITING`, fetch instead)."""
        if len(self._waiting) >= MAX_WAITING:
            self._waiting.clear()
            self.must_fetch = True
        self._waiting.append(pushed)

    def take(self, cursor: str, states: KeyStates) -> StepReply | None:
        """The pushed entries that follow on from ``cursor``, in order, as if fetched (None if
        none does). Call it only when the owner would fetch now. A push that does not follow on
        (an entry lies between it and the cursor, which came some other way) is left to a fetch;
        one whose keys' states are not cached ends the chain: the next step fetches instead."""
        if not self.recorded or not self._waiting:
            return None
        waiting, self._waiting = self._waiting, []
        entries: list[tuple[str, dict[bytes, bytes]]] = []
        at = parse_id(cursor)
        for pushed in waiting:
            entry_id = parse_id(pushed.entry_id)
            if entry_id <= at:
                continue  # fetched already
            if pushed.after not in (cursor, "-"):
                self.must_fetch = True  # (an entry lies between: a later push may still follow on)
                continue
            if not states.complete and not states.cached(entry_keys(pushed.fields)):
                self.must_fetch = True
                break
            entries.append((pushed.entry_id, dict(pushed.fields)))
            if not self._taken:
                self._taken_after = cursor
            self._taken.append((pushed.entry_id, pushed.fields))
            cursor, at = pushed.entry_id, entry_id
        if not entries:
            return None
        return StepReply(entries, {}, {})

    @property
    def pushed_to(self) -> str:
        """The last entry taken in from a push since the last step, or '' (the step raises the
        horizon to it)."""
        return self._taken[-1][0] if self._taken else ""

    def to_confirm(self) -> tuple[str, list[str | bytes]]:
        """What the next step confirms before it commits: ``StepArgs.pushed``, the cursor before
        the entries taken in from pushes ('' if none was), and those entries, in order: each its
        id, the number of its fields and values, then those."""
        if not self._taken:
            return "", []
        values: list[str | bytes] = []
        for entry_id, fields in self._taken:
            values += (entry_id, str(2 * len(fields)))
            for name, value in fields.items():
                values += (name, value)
        return self._taken_after, values

    def fetch_size(self, want: int, replaying: bool) -> int:
        """How many entries the next step fetches: ``want`` while replaying, or when entries may
        be waiting that no push brings; else none."""
        return want if self.must_fetch or replaying else 0

    def records(self, want: int, replaying: bool) -> bool:
        """Whether the next step records that this owner takes pushes: once, when it would
        take them (not replaying, not stopping)."""
        return bool(want) and not replaying and not self.recorded

    def sending(self, fetch: int) -> None:
        """A step that fetches goes out: a wake-up from now on asks for the next fetch."""
        if fetch:
            self.must_fetch = False

    def stepped(self, fetch: int, fetched: int, recorded: bool) -> None:
        """A step went through, asking for ``fetch`` entries and getting ``fetched`` (one that
        got all it asked for fetches again), having ``recorded`` that this owner takes pushes."""
        self._taken = []
        self.recorded |= recorded
        if fetch and fetched >= fetch:
            self.must_fetch = True
