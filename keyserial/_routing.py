"""Which shard a key belongs to, and the shard lists that workers accept on the command line."""

from __future__ import annotations

import re
import zlib

from ._codec import Envelope
from .errors import ConfigError

_RANGE_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def shard_for(key: str, shard_count: int) -> int:
    """``crc32(utf-8 key) % shard_count``: the same in every language with a crc32."""
    return zlib.crc32(key.encode()) % shard_count


def route(envelope: Envelope, shard_count: int) -> tuple[int, ...]:
    """The shard of each of the envelope's keys, computed once per envelope: a worker routes a
    cross-shard op at several steps of its way (the misroute check, its barrier, its split,
    its writes)."""
    if not envelope.shards:
        envelope.shards = tuple(shard_for(key, shard_count) for key in envelope.keys)
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
