"""Waiting before trying again: one doubling, capped delay for every retry loop."""

from __future__ import annotations

import anyio


class Backoff:
    """Delays that double from ``first`` up to ``most`` seconds. ``delay`` is the next wait
    (for log lines); :meth:`sleep` waits it and doubles it."""

    __slots__ = ("_most", "delay")

    def __init__(self, first: float, most: float) -> None:
        self.delay = first
        self._most = most

    async def sleep(self) -> None:
        await anyio.sleep(self.delay)
        self.delay = min(self.delay * 2, self._most)
