"""A shard owner's side of pushes (``submit.lua``): a fresh entry arrives in its wake-up, with
its place in the shard's inbox (its number in the order of pushes). The owner takes such entries
in, without fetching them, as long as each one's place follows on from the last item it took; it
fetches when that chain breaks (an entry pushed another way, a lost message, a key whose state it
has not cached), when a plain wake-up announces an entry, and at its poll. One per runner; only
its step loop touches it.

A push is a hint: anyone who may publish on the wake channel could have sent it. The owner runs
a pushed entry at once, but the next step first confirms, in the script, that the inbox holds
exactly the pushed items first, the first at its place (sent with the step and compared whole: a
Lua string comparison costs less than hashing them there), and moves them into the stream; it
commits nothing otherwise (``UNCONFIRMED``), and the owner gives the shard up to start again from
what Redis has. So no progress, horizon or result ever passes an entry that Redis does not hold
as it ran.

An owner takes pushes only once a step of its own has recorded that it does (``takes_pushes``),
and has told it the inbox's taken count: a takeover then counts every entry in the stream, and
in the inbox, as one it may have run, so an op that kills the owner before any step of its
moves the entry still takes its strike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._wire.codec import Push
from .intake import entry_keys
from .keystates import KeyStates

#: Pushes kept at most while the owner takes none in (replaying, or at ``max_inflight``): past
#: that, they are dropped and the owner fetches instead.
MAX_WAITING = 1024


@dataclass(slots=True, eq=False)
class Wakeups:
    """The pushes a runner got, and whether its next step fetches."""

    #: Pushes not taken in yet, in the order they came (the order of the inbox).
    _waiting: list[Push] = field(default_factory=list)
    #: Whether the next step fetches: the inbox or the stream may hold entries that no push
    #: brings.
    must_fetch: bool = True
    #: Whether a step of this owner has recorded that it takes pushes (until then it takes none).
    recorded: bool = False
    #: The place of the next inbox item this owner may take from a push (0: not known until a
    #: step tells it the inbox's taken count).
    next_place: int = 0
    #: Whether the last step that fetched reached the end of the stream: until then an entry
    #: moved in by a fetch may wait there unfetched, which a pushed entry must not overtake.
    caught_up: bool = False
    #: The place of the first item taken in from a push since the last step.
    _taken_from: int = 0
    #: The items taken in from pushes since the last step, as pushed.
    _taken: list[bytes] = field(default_factory=list)

    def push(self, pushed: Push) -> None:
        """Keep a push for :meth:`take` (past :data:`MAX_WAITING`, fetch instead)."""
        if len(self._waiting) >= MAX_WAITING:
            self._waiting.clear()
            self.must_fetch = True
        self._waiting.append(pushed)

    def take(self, states: KeyStates) -> list[Push]:
        """The pushed entries that follow on from the last item taken, in order (none if none
        does, or the last fetch may have left entries in the stream). Call it only when the
        owner would fetch now. A push that does not follow on (an item lies between it and the
        last one taken, which came some other way) is left to a fetch; one whose keys' states
        are not cached ends the chain: the next step fetches instead."""
        if not self.recorded or not self.caught_up or not self._waiting:
            return []
        waiting, self._waiting = self._waiting, []
        taken: list[Push] = []
        for pushed in waiting:
            if pushed.place < self.next_place:
                continue  # moved in already
            if pushed.place > self.next_place:
                self.must_fetch = True  # (an item lies between: a later push may still follow on)
                continue
            if not states.complete and not states.cached(entry_keys(pushed.fields)):
                self.must_fetch = True
                break
            if not self._taken:
                self._taken_from = pushed.place
            self._taken.append(pushed.item)
            taken.append(pushed)
            self.next_place += 1
        return taken

    @property
    def pushed(self) -> bool:
        """Whether an entry was taken in from a push since the last step."""
        return bool(self._taken)

    def to_confirm(self) -> tuple[str, list[bytes]]:
        """What the next step confirms before it commits: ``StepArgs.pushed``, the place of the
        first item taken in from a push since the last step ('' if none was), and those items,
        in order."""
        if not self._taken:
            return "", []
        return str(self._taken_from), self._taken

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

    def stepped(
        self, fetch: int, fetched: int, recorded: bool, taken: int | None, last: str = ""
    ) -> None:
        """A step went through, asking for ``fetch`` entries and getting ``fetched`` (one that
        got all it asked for fetches again), having ``recorded`` that this owner takes pushes,
        and leaving the inbox's taken count at ``taken`` (None: not read); ``last``: the place
        of the last entry fetched. A fetch reached the end of the stream if it got fewer than it
        asked for, or if its last entry was the last item the inbox had moved out. One that moved
        as many items out of the inbox as it asked for fetches again too."""
        self._taken = []
        self.recorded |= recorded
        moved = taken - (self.next_place - 1) if taken is not None and self.next_place else 0
        if fetch and moved >= fetch:
            # (It moved a full batch out of the inbox, delayed items among them, which went to
            # the shard's timers, not the stream: more may wait there.)
            self.must_fetch = True
        if taken is not None:
            self.next_place = taken + 1
        if fetch:
            self.caught_up = fetched < fetch or (taken is not None and last == str(taken))
        if fetch and fetched >= fetch:
            self.must_fetch = True
