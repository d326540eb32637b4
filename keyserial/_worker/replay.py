"""A new owner's replay of what the last owner may have run.

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

import anyio

from .._wire.codec import parse_id
from .execution import Run


class Replay:
    """Up to the last owner's horizon, entries may have run already: while replaying, a step
    looks up their ops' stored outcomes, and the suspect runs alone. (Fields, not properties:
    the runner reads them at every step, and asks more only while it replays.)"""

    __slots__ = ("_until", "over", "replaying", "suspect")

    def __init__(self, until: str | None, suspect: str | None) -> None:
        #: Up to this entry, the last owner may have committed some ops; None once past it.
        self._until = parse_id(until) if until else None
        self.replaying = self._until is not None
        #: The op blamed for the last owner's death, until it runs.
        self.suspect = suspect
        #: Set once the replay is over: only then can another shard's op hold keys here in
        #: process, since until then this owner does not know what the last one had granted.
        self.over = anyio.Event()
        if self._until is None:
            self.over.set()

    def reached(self, cursor: str) -> None:
        """The owner has fetched up to ``cursor``: at the horizon, the replay is over."""
        if self._until is not None and parse_id(cursor) >= self._until:
            self.end()

    def end(self) -> None:
        """The replay is over (or the runner is: holds waiting for it find it ended)."""
        self._until = None
        self.replaying = False
        self.suspect = None
        self.over.set()

    def runs_alone(self, run: Run) -> bool:
        """Whether ``run`` is the suspect: every op before it has a result, and nothing after it
        starts until it has committed (the suspect runs once: asked again, it is not)."""
        if run.envelope.op_id != self.suspect:
            return False
        self.suspect = None
        return True
