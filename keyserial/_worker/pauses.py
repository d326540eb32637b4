"""The keys an operator paused on one shard (``keyserial keys pause``): each held on its chain,
behind the ops already queued on it, so its ops wait and the shard's other keys flow."""

from __future__ import annotations

import logging

from .chains import Chains, Hold

log = logging.getLogger("keyserial.worker")


class PausedKeys:
    """One shard's paused keys, each held on its chain until it is resumed."""

    def __init__(self, chains: Chains, shard: int) -> None:
        self._chains = chains
        self._shard = shard
        self._held: dict[str, Hold] = {}
        #: An operator paused or resumed some key of the namespace since they were last read.
        self.stale = False

    def keys(self) -> set[str]:
        return set(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def follow(self, paused: set[str]) -> None:
        """Hold the keys of ``paused`` not held yet, and let go of the others held."""
        for key in sorted(paused - self._held.keys()):
            self._held[key] = self._chains.hold((key,))
            log.info("shard %d: key %r paused: its ops wait until it is resumed", self._shard, key)
        for key in sorted(self._held.keys() - paused):
            self._chains.release(self._held.pop(key))
            log.info("shard %d: key %r resumed", self._shard, key)
