"""A shard owner's view of its keys: the one place that changes it, and that says whether a key
may be touched now.

While it holds the lease, the owner is the only writer of its shard's keys, so it caches their
committed states. An op's new state is *pending* until a step commits it, and *in flight* while
the step that carries it is out. Cross-shard ops read and write the same view (a participant's
granted keys, a coordinator's committed writes), never the cache behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anyio


class StateCache(dict[str, str | None]):
    """Committed states (key -> JSON, ``None``: no state). Once :attr:`complete` (every state
    was loaded when the owner took the shard over, and only the owner writes them), a key it
    does not hold has no state."""

    complete = False

    def __missing__(self, key: str) -> str | None:
        if not self.complete:
            raise KeyError(key)
        self[key] = None
        return None


class KeyStates:
    """Committed states, pending writes and the writes of the step in flight, for one epoch.

    ``request_step`` asks the runner for a step soon (a flush waits for one).
    """

    def __init__(self, request_step: Callable[[], None]) -> None:
        self._cache = StateCache()
        self._pending: set[str] = set()
        #: Keys whose latest op finished with no write of its own, its outcome not committed.
        self._answered: set[str] = set()
        #: Keys the step in flight commits a write or an outcome of.
        self._in_flight: set[str] = set()
        self._request_step = request_step
        self._steps_started = 0
        self._steps_done = 0
        #: Set at the end of every step someone waits for (see :meth:`flush`).
        self._stepped: anyio.Event | None = None
        self._ended = False

    # -- reading -------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every state of the shard is cached (a key not cached has none)."""
        return self._cache.complete

    def __getitem__(self, key: str) -> str | None:
        """The key's state as the next op on it sees it (raises ``KeyError`` if not cached)."""
        return self._cache[key]

    def __len__(self) -> int:
        """How many keys' states this owner holds in memory."""
        return len(self._cache)

    def cached(self, keys: Iterable[str]) -> bool:
        return self._cache.complete or all(key in self._cache for key in keys)

    def missing(self, keys: Iterable[str]) -> list[str]:
        """Keys whose committed state must be read from Redis first."""
        if self._cache.complete:
            return []
        return [key for key in keys if key not in self._cache]

    def all_committed(self, keys: Iterable[str]) -> bool:
        """No write to ``keys``, nor the outcome of an op on them, waits for a step or rides in
        the step in flight."""
        keys = set(keys)
        if not self._pending.isdisjoint(keys) or not self._answered.isdisjoint(keys):
            return False
        return self._steps_done >= self._steps_started or self._in_flight.isdisjoint(keys)

    # -- changing ------------------------------------------------------------------------------

    def load_all(self, states: dict[str, str]) -> None:
        """Every committed state of the shard, read when the owner took it over."""
        self._cache.update(states)
        self._cache.complete = True

    def load(self, key: str, state: str | None) -> None:
        """A committed state read from Redis: kept unless this owner knows the key already."""
        self._cache.setdefault(key, state)

    def write(self, key: str, state: str | None) -> None:
        """An op's new state: pending until the next step commits it."""
        if state != self._cache[key]:
            self._cache[key] = state
            self._pending.add(key)

    def answered(self, keys: Iterable[str]) -> None:
        """An op on ``keys`` finished: its outcome commits with the next step. Until then the
        keys count as uncommitted even if the op wrote nothing, so a cross-shard op granted
        them never commits ahead of it: a crash would run it again after that op, with a
        larger fence, though it came first in the keys' order."""
        self._answered.update(keys)

    def committed(self, key: str, state: str | None) -> None:
        """A state a script has already committed (a cross-shard op's own commit)."""
        self._cache[key] = state

    def forget(self, key: str) -> None:
        """A key of another shard, looked up by a fetch that named it: not this owner's."""
        self._cache.pop(key, None)

    def evict(self, down_to: int, busy: Callable[[str], bool]) -> int:
        """Drop the committed states of idle keys, the first loaded first, until at most
        ``down_to`` are cached; how many were dropped. A key is idle if none of its writes or
        outcomes waits for a step or rides in one, and ``busy`` says no op needs it. Once one
        is dropped the cache is no longer :attr:`complete`: a key it lacks is read again."""
        excess = len(self._cache) - down_to
        if excess <= 0:
            return 0
        waiting = self._pending | self._answered
        if self._steps_done < self._steps_started:
            waiting |= self._in_flight
        idle = []
        for key in self._cache:
            if key not in waiting and not busy(key):
                idle.append(key)
                if len(idle) == excess:
                    break
        for key in idle:
            del self._cache[key]
        if idle:
            self._cache.complete = False
        return len(idle)

    # -- steps ---------------------------------------------------------------------------------

    def start_step(self) -> tuple[int, list[tuple[str, str]]]:
        """Number a new step and hand it the pending writes (``''`` for a deleted state)."""
        writes = [(key, self._cache[key] or "") for key in self._pending]
        self._in_flight = self._pending | self._answered
        self._pending.clear()
        self._answered.clear()
        self._steps_started += 1
        return self._steps_started, writes

    def step_done(self, step: int) -> None:
        self._steps_done = step
        if self._stepped is not None:
            self._stepped.set()
            self._stepped = None

    def end(self) -> None:
        """No step will come again: whoever waits in :meth:`flush` stops waiting."""
        self._ended = True
        if self._stepped is not None:
            self._stepped.set()

    async def flush(self, keys: Iterable[str]) -> None:
        """Return once every write to ``keys`` made so far, and the outcome of every op on them
        that finished, has committed: the next step takes a pending one, the step in flight
        carries the rest (or the runner has ended)."""
        keys = set(keys)
        if not self._pending.isdisjoint(keys) or not self._answered.isdisjoint(keys):
            target = self._steps_started + 1
            self._request_step()
        elif not self._in_flight.isdisjoint(keys):
            target = self._steps_started
        else:
            return
        while self._steps_done < target and not self._ended:
            if self._stepped is None:
                self._stepped = anyio.Event()
            await self._stepped.wait()
