"""Which shard a key belongs to, and the shard lists that workers accept on the command line."""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Sequence

from ..errors import ConfigError
from .codec import Envelope

_RANGE_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def shard_for(key: str, shard_count: int) -> int:
    """``crc32(utf-8 key) % shard_count``: the same in every language with a crc32."""
    return zlib.crc32(key.encode()) % shard_count


def home_shard(keys: Sequence[str], shard_count: int) -> int:
    """The shard an op on ``keys`` is appended to, and whose results hold its outcome (see
    :func:`home_of`)."""
    return home_of([shard_for(key, shard_count) for key in keys])


def home_of(shards: Sequence[int]) -> int:
    """The home of an op whose keys are on ``shards``: the lowest, which coordinates the
    others for a multi-key op."""
    return min(shards)


def route(envelope: Envelope, shard_count: int) -> tuple[int, ...]:
    """The shard of each of the envelope's keys, computed once per envelope: a worker routes a
    cross-shard op at several steps of its way (the misroute check, its barrier, its split,
    its writes)."""
    if not envelope.shards:
        envelope.shards = tuple([shard_for(key, shard_count) for key in envelope.keys])
    return envelope.shards


def parse_shards(spec: str, shard_count: int) -> list[int]:
    """Parse ``"0-15"``, ``"0,3,7"`` or ``"0-3,8-11"`` into sorted, distinct shard numbers.

    :raises ConfigError: for malformed items, reversed ranges, or shards outside ``0..N-1``.
    """
    shards: set[int] = set()
    for item in spec.split(","):
        match = _RANGE_ITEM.match(item)
        if match is None:
            raise ConfigError(
                f"bad shard list {spec!r}: {item.strip()!r} is not a number or a range like 0-15"
            )
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise ConfigError(f"bad shard list {spec!r}: range {low}-{high} is reversed")
        if high >= shard_count:
            raise ConfigError(
                f"bad shard list {spec!r}: shard {high} does not exist with {shard_count} shards"
                f" (valid: 0-{shard_count - 1})"
            )
        shards.update(range(low, high + 1))
    return sorted(shards)


def scale_shards(shards: Sequence[int], of: int, to: int) -> list[int]:
    """``shards`` of ``of`` shards as the same fraction of ``to`` shards: shard ``i`` covers
    ``[i·to/of, (i+1)·to/of)`` (rounded down). Ranges that cover every shard of ``of`` cover
    every shard of ``to``, each once; a lone shard may cover none when shrinking."""
    return sorted({new for old in shards for new in range(old * to // of, (old + 1) * to // of)})


def format_shards(shards: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted input): :func:`parse_shards` reads it back."""
    runs = [
        [shard for _, shard in run]
        for _, run in itertools.groupby(enumerate(shards), lambda pair: pair[1] - pair[0])
    ]
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
