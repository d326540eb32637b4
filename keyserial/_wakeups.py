"""A shard owner's side of the wake-up marker (``submit.lua``, ``step.lua``): the entry last
pushed to it, the one it took in since its last step, and whether the marker already says
``busy``. One per runner; only its step loop touches it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ._commit_scripts import StepReply
from ._intake import Push, entry_keys
from ._keystates import KeyStates

#: How long after a fetch set ``busy`` the owner takes it to be still set: well inside the
#: marker's 3-s expiry (step.lua), so the marker never lapses while the owner keeps fetching.
BUSY_KNOWN = 2.0


@dataclass(slots=True, eq=False)
class Wakeups:
    """What a runner knows of its wake-up marker, and the pushes it gets."""

    _pushed: Push | None = None
    #: The last entry taken in from a push since the last step, or '' (the step raises the
    #: horizon to it).
    pushed_to: str = ""
    #: When a fetch of this owner last set the marker to ``busy`` (None: it may not say so).
    _busy_since: float | None = None

    def push(self, pushed: Push) -> None:
        """Keep the latest push, for :meth:`take`."""
        self._pushed = pushed

    def take(self, cursor: str, states: KeyStates) -> StepReply | None:
        """The entry last pushed, as if fetched, if it is next after ``cursor`` (nothing was
        fetched since the marker said idle there) and ``states`` holds the states of its keys.
        Call it only when the owner would fetch now."""
        pushed, self._pushed = self._pushed, None
        if pushed is None or pushed.after != cursor:
            return None
        if not states.complete and not states.cached(entry_keys(pushed.fields)):
            return None
        self.pushed_to = pushed.entry_id
        return StepReply([(pushed.entry_id, dict(pushed.fields))], {}, {})

    @property
    def busy(self) -> bool:
        """Whether the marker says ``busy`` already (a step then need not set it again)."""
        return self._busy_since is not None and time.monotonic() - self._busy_since < BUSY_KNOWN

    def stepped(self, fetching: bool, fetched: bool) -> None:
        """A step went through: ``fetching`` (it asked for entries) and ``fetched`` (it got
        some, so it set the marker to ``busy`` unless :attr:`busy` said it was)."""
        self.pushed_to = ""
        if fetching and not fetched:
            self._busy_since = None
        elif fetched and not self.busy:
            self._busy_since = time.monotonic()
