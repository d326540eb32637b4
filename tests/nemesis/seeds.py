"""Seeds the test suite runs, and seeds known to fail (kept out of CI until their cause is
fixed; each with its profile and one line: the checker that failed and what it found)."""

from __future__ import annotations

from typing import NamedTuple


class KnownFailure(NamedTuple):
    seed: int
    profile: str
    description: str


#: Short-profile seeds ``tests/test_nemesis.py`` runs (each passed when it was added).
DEFAULT_SEEDS: tuple[int, ...] = ()

#: Reproduce one with ``python -m tests.nemesis --seeds 1 --seed-start SEED --profile PROFILE``.
KNOWN_FAILING: list[KnownFailure] = []
