"""The roster: every running worker of a namespace lists itself in one hash, ``ks:<ns>:workers``
(field: the worker's token, value: the JSON below), and renews its entry every
:data:`ROSTER_RENEW` seconds. ``keyserial status`` reads it to show standby workers and each
worker's op set; a worker reads it to warn when a worker serving the same shards runs another
set of ops (an op one of them lacks fails with ``UnknownOperation`` while that one owns the
shard); ``status`` also shows how long ago each renewed its entry. Only workers write it;
nothing in it is an authority over a shard (the leases are).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .json_text import dumps
from .routing import format_shards

#: How often a worker renews its roster entry.
ROSTER_RENEW = 5.0
#: An entry not renewed for this long is a worker that stopped without a word (kill -9): it is
#: left out, and dropped by the next worker that renews its own.
ROSTER_STALE = 30.0
#: An entry not renewed for this long missed two renewals in a row: ``keyserial status`` still
#: lists the worker (until :data:`ROSTER_STALE`), but says it may be gone.
ROSTER_SILENT = 2 * ROSTER_RENEW + 2.0


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One worker, as the roster lists it."""

    token: str
    #: The shards it serves (owns or stands by for), as ``--shards`` spells them.
    shards: tuple[int, ...]
    ops: tuple[str, ...]
    #: When it last renewed its entry (its own clock, seconds since the epoch).
    renewed_at: float
    #: The layout generation whose shards it serves; None from a worker of a version that
    #: cannot follow a reshard (``keyserial reshard`` refuses to start while one runs).
    generation: int | None = None
    #: How long it keeps results (``result_ttl``, seconds); None from a worker that does not
    #: say. A reshard keeps the layouts it leaves in the history at least twice that long.
    result_ttl: float | None = None

    def encode(self) -> str:
        return dumps(
            {
                "shards": list(self.shards),
                "ops": list(self.ops),
                "at": round(self.renewed_at, 3),
                "g": self.generation,
                "r": self.result_ttl,
            }
        )

    @classmethod
    def decode(cls, token: str, raw: str | bytes) -> WorkerEntry | None:
        """The entry, or None if it is not one (a foreign or damaged value)."""
        try:
            value = json.loads(raw)
            shards, ops, at = value["shards"], value["ops"], value["at"]
            generation, result_ttl = value.get("g"), value.get("r")
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if (
            not isinstance(shards, list)
            or not all(type(shard) is int for shard in shards)
            or not isinstance(ops, list)
            or not all(isinstance(op, str) for op in ops)
            or not isinstance(at, int | float)
            or (generation is not None and type(generation) is not int)
            or not (result_ttl is None or isinstance(result_ttl, int | float))
        ):
            return None
        ttl = None if result_ttl is None else float(result_ttl)
        return cls(token, tuple(shards), tuple(ops), float(at), generation, ttl)

    def stale(self, now: float | None = None) -> bool:
        return self.renewed_at < (time.time() if now is None else now) - ROSTER_STALE


def live_entries(listed: Mapping[bytes, bytes]) -> tuple[list[WorkerEntry], list[bytes]]:
    """The roster's live entries, by token; and the fields to drop (stale or unreadable)."""
    now = time.time()
    live, dropped = [], []
    for field, raw in listed.items():
        entry = WorkerEntry.decode(field.decode(errors="replace"), raw)
        if entry is None or entry.stale(now):
            dropped.append(field)
        else:
            live.append(entry)
    return sorted(live, key=lambda entry: entry.token), dropped


@dataclass(frozen=True, slots=True)
class OpSetMismatch:
    """Two workers that serve a shard in common and run different op sets."""

    other: str
    shards: tuple[int, ...]
    #: Ops the other worker runs and this one lacks, and the reverse.
    missing: tuple[str, ...]
    extra: tuple[str, ...]

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"it runs {', '.join(self.missing)}, which this worker lacks")
        if self.extra:
            parts.append(f"it lacks {', '.join(self.extra)}, which this worker runs")
        return (
            f"worker {self.other} also serves shards {format_shards(self.shards)}, with other ops:"
            f" {'; '.join(parts)}. An op that the shard's owner lacks fails with"
            " UnknownOperation: give every worker of these shards the same --app modules"
        )


def mismatches(mine: WorkerEntry, others: Sequence[WorkerEntry]) -> list[OpSetMismatch]:
    """The workers that serve some of ``mine``'s shards with another op set."""
    found: list[OpSetMismatch] = []
    for other in others:
        shared = tuple(sorted(set(mine.shards) & set(other.shards)))
        if other.token == mine.token or not shared or set(other.ops) == set(mine.ops):
            continue
        missing = tuple(sorted(set(other.ops) - set(mine.ops)))
        extra = tuple(sorted(set(mine.ops) - set(other.ops)))
        found.append(OpSetMismatch(other.token, shared, missing, extra))
    return found
