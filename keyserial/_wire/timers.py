"""A shard's timers, as Redis keeps them (``ShardKeys.timers`` and ``ShardKeys.timed``): delayed
ops waiting for their due time. Each timer's item is an inbox item, ``<version>[ fresh]\\n<ops>``,
and its id its inbox place, 16 digits wide (``lib.lua``); a reshard moves each one's ops to their
home shards in the new layout, under an id that names the old shard (``<old shard>.<id>``).
"""

from __future__ import annotations

from typing import Any

from .codec import keys_named
from .json_text import dumps, parse
from .layout import ShardKeys, shard_name
from .routing import home_shard


def moved_timer_id(old: ShardKeys, timer_id: bytes) -> str:
    """A timer's id in the new layout: unique there, since the old shard's name prefixes it,
    and the same at every run of the mover (a rerun writes the same timers again)."""
    return f"{shard_name(old.shard, old.generation)}.{timer_id.decode()}"


def split_by_home(item: bytes, shards: int, fallback: int) -> dict[int, str]:
    """The items a timer's ``item`` becomes in a layout of ``shards`` shards: its ops grouped by
    their home shard there, in order, each group an item of its own. None is marked fresh: a
    moved op's id is looked up before it runs. An item that cannot be read goes whole to
    ``fallback``, where it fires and is dead-lettered as it would have been."""
    header, _, ops = item.decode(errors="surrogateescape").partition("\n")
    version = header.split(" ")[0]
    try:
        envelopes = parse(ops)
        homes = [home_shard(_keys(envelope), shards) for envelope in envelopes]
    except (ValueError, TypeError, AttributeError, KeyError):
        return {fallback: item.decode(errors="surrogateescape")}
    grouped: dict[int, list[str]] = {}
    for envelope, home in zip(envelopes, homes, strict=True):
        grouped.setdefault(home, []).append(dumps(envelope))
    return {home: f"{version}\n[{','.join(group)}]" for home, group in grouped.items()}


def _keys(envelope: Any) -> list[str]:
    """An envelope's keys: TypeError if it names none to route by."""
    keys = keys_named(envelope)
    if keys is None:
        raise TypeError("an envelope without keys")
    return keys
