"""An outage of Redis, as one process sees it: the warnings it causes are logged once, the rest
held back (logged at DEBUG), and one line says when it ended and how many were held back. A
process with many tasks that each retry (a worker's shards, its leases, its subscriptions)
would otherwise log every retry of every task: hundreds of lines for a restart of Redis.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("keyserial")


class Outage:
    """Whether the server at ``url`` has failed to answer since it last answered."""

    __slots__ = ("_held_back", "_url", "since")

    def __init__(self, url: str) -> None:
        self._url = url
        #: When the outage began (``time.monotonic()``), or None while the server answers.
        self.since: float | None = None
        self._held_back = 0

    def warn(self, logger: logging.Logger, message: str, *args: object) -> None:
        """A warning that the server did not answer: logged if it is the outage's first, else
        held back (logged at DEBUG) until the server answers again."""
        if self.since is None:
            self.since = time.monotonic()
            logger.warning("Redis does not answer (more warnings held back): " + message, *args)
        else:
            self._held_back += 1
            logger.debug(message, *args)

    def answered(self) -> None:
        """The server answered: an outage under way is over (one line says so)."""
        if self.since is None:
            return
        log.warning(
            "Redis at %s answers again, after %.1fs; %d warnings were held back meanwhile",
            self._url,
            time.monotonic() - self.since,
            self._held_back,
        )
        self.since, self._held_back = None, 0
