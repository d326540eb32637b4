"""Workloads: which accounts each op touches, and the variants each workload is run at.

Accounts are numbered ``0..keys-1``; every system maps a number to its own key names
(:mod:`benchmarks.state`). Choosers are deterministic for a seed, so every system of a run sees
the same stream of keys.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from keyserial import shard_for

from .config import BenchConfig

#: Picks the accounts of the next op.
Chooser = Callable[[], tuple[int, ...]]


def account_key(account: int) -> str:
    """The keyserial key of an account (lock systems prefix it; see :mod:`benchmarks.state`)."""
    return f"acct:{account}"


@functools.cache
def zipf_cdf(keys: int, s: float) -> tuple[float, ...]:
    """Cumulative weights of ranks ``1..keys`` under Zipf's law with exponent ``s``."""
    return tuple(itertools.accumulate(1.0 / rank**s for rank in range(1, keys + 1)))


@functools.cache
def shard_table(keys: int, shards: int) -> tuple[int, ...]:
    """The keyserial shard of every account."""
    return tuple(shard_for(account_key(n), shards) for n in range(keys))


def shard_range_bounds(shards: int, ranges: int, index: int) -> tuple[int, int]:
    """The first and last shard of range ``index`` of ``shards`` split into ``ranges``
    contiguous ranges, as ``--split-shards`` gives them to its workers (the first ranges take
    one more when it does not divide)."""
    size, extra = divmod(shards, ranges)
    first = index * size + min(index, extra)
    return first, first + size + (index < extra) - 1


def shard_range_of(shard: int, shards: int, ranges: int) -> int:
    """Which of :func:`shard_range_bounds`' ranges holds ``shard``."""
    return next(
        index for index in range(ranges) if shard <= shard_range_bounds(shards, ranges, index)[1]
    )


def make_chooser(
    distribution: str,
    keys: int,
    rng: random.Random,
    *,
    zipf_s: float = 1.1,
    shards: int = 16,
    ranges: int = 1,
) -> Chooser:
    """A chooser for ``hot``, ``uniform``, ``zipf`` (one account), ``pairs`` (two, on
    different shards) or ``local-pairs`` (two on different shards of one of ``ranges``
    contiguous ranges: one worker's, where the workers split the shards)."""
    if distribution == "hot":
        return lambda: (0,)
    if distribution == "uniform":
        return lambda: (rng.randrange(keys),)
    if distribution == "zipf":
        cdf = zipf_cdf(keys, zipf_s)
        total = cdf[-1]
        return lambda: (bisect.bisect_left(cdf, rng.random() * total),)
    if distribution == "pairs":
        return _pair_chooser(keys, rng, shards)
    if distribution == "local-pairs":
        return _pair_chooser(keys, rng, shards, ranges)
    raise ValueError(f"unknown key distribution {distribution!r}")


def _pair_chooser(keys: int, rng: random.Random, shards: int, ranges: int = 1) -> Chooser:
    """Two distinct accounts on different keyserial shards (with one shard: just distinct),
    both in the same one of ``ranges`` contiguous ranges of shards (one range: any two)."""
    shard_of = shard_table(keys, shards)
    range_of = [shard_range_of(shard, shards, ranges) for shard in range(shards)]

    def choose() -> tuple[int, ...]:
        while True:
            first, second = rng.randrange(keys), rng.randrange(keys)
            apart = shards == 1 or shard_of[first] != shard_of[second]
            together = range_of[shard_of[first]] == range_of[shard_of[second]]
            if first != second and apart and together:
                return first, second

    return choose


@dataclass(frozen=True, slots=True)
class Cell:
    """One workload variant; every selected system runs it once (the tuned lock once per sleep)."""

    workload: str
    op: str
    distribution: str
    keys: int
    clients: int
    callers: int
    shards: int
    duration: float
    variant: dict[str, Any] = field(default_factory=dict)


def cells(config: BenchConfig, workload: str) -> list[Cell]:
    """The variants ``workload`` runs at under ``config``."""
    if workload == "hot":
        return [_main_cell(config, "hot", "deposit", "hot", 1)]
    if workload in ("zipf", "uniform"):
        return [_main_cell(config, workload, "deposit", workload, config.keys)]
    if workload == "transfer":
        return [_main_cell(config, "transfer", "transfer", "pairs", config.keys)]
    if workload == "local-transfer":
        return [_main_cell(config, workload, "transfer", "local-pairs", config.keys)]
    if workload == "slow":
        return [_slow_cell(config, keys) for keys in config.slow_keys]
    if workload == "sweep":
        return [_sweep_cell(config, total) for total in config.sweep_callers]
    raise ValueError(f"unknown workload {workload!r}")


def _main_cell(config: BenchConfig, workload: str, op: str, distribution: str, keys: int) -> Cell:
    return Cell(
        workload,
        op,
        distribution,
        keys,
        clients=config.clients,
        callers=config.callers,
        shards=config.shards,
        duration=config.duration,
    )


def _slow_cell(config: BenchConfig, keys: int) -> Cell:
    return Cell(
        "slow",
        "slow",
        "uniform",
        keys,
        clients=config.clients,
        callers=config.callers,
        shards=config.slow_shards,
        duration=config.variant_duration,
        variant={"keys": keys, "shards": config.slow_shards},
    )


def _sweep_cell(config: BenchConfig, total: int) -> Cell:
    """``total`` callers on the hot key, spread over up to ``config.clients`` processes."""
    clients = max(1, min(config.clients, total))
    return Cell(
        "sweep",
        "deposit",
        "hot",
        1,
        clients=clients,
        callers=max(1, total // clients),
        shards=config.shards,
        duration=config.variant_duration,
        variant={"callers": clients * max(1, total // clients)},
    )
