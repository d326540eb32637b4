"""A shard owner's side of its shard's timers: the alarm for the next one, and what an op's
timers become in its commit.

The alarm: for its shard's timers (ops due later, see ``lib.lua``): the timers
live in Redis, and the owner keeps only when the next one is due, as its last fetching step
read it, so a million pending timers cost it one number per shard. The alarm asks the step
loop for a fetch at that time; the fetch fires what is due (early is harmless: it fires nothing
not due, and reads the next due time again). One per runner, on the worker's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

#: Seconds added to a timer's wait: Redis's clock and this process's run apart a little, and a
#: fetch a moment early would find nothing due and set the alarm again.
MARGIN = 0.001


class TimerAlarm:
    """Calls ``fetch`` once the shard's next timer is due."""

    def __init__(self, fetch: Callable[[], None]) -> None:
        self._fetch = fetch
        self._handle: asyncio.TimerHandle | None = None
        #: How many timers wait on the shard, as the last fetching step read it.
        self.waiting = 0

    @property
    def next_in(self) -> float | None:
        """Seconds until the alarm rings (about when the shard's next timer is due); None if
        it is not set."""
        if self._handle is None:
            return None
        return max(0.0, self._handle.when() - asyncio.get_running_loop().time())

    def follow(self, next_timer_ms: int | None, waiting: int = 0) -> None:
        """A fetching step read that the next timer is due in ``next_timer_ms`` (by Redis's
        clock when the step ran: a little before now, so the alarm is never early by more than
        the margin), or that none waits (None), and that ``waiting`` timers wait."""
        self.waiting = waiting
        self.cancel()
        if next_timer_ms is not None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_later(next_timer_ms / 1000 + MARGIN, self._ring)

    def expect(self, delay_ms: int) -> None:
        """A step just committed a timer due in ``delay_ms``: ring then, unless set sooner."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_ms / 1000 + MARGIN
        if self._handle is None or self._handle.when() > at:
            self.cancel()
            self._handle = loop.call_at(at, self._ring)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _ring(self) -> None:
        self._handle = None
        self._fetch()


@dataclass(frozen=True, slots=True)
class TimerChanges:
    """The timers one op sets and cancels, as its commit writes them (see ``step.lua``)."""

    #: Per timer set: its id, its delay in ms (from the commit, by Redis's clock) and the inbox
    #: item it fires as (one op: its call on the key, no reply channel).
    set: tuple[tuple[str, int, str], ...] = ()
    #: The timer ids cancelled.
    cancelled: tuple[str, ...] = ()
