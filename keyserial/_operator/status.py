"""What ``keyserial status`` and the dashboard show of a namespace's shards and workers.

Each shard is read in one read-only script (``lua/status.lua``), so its figures are one
consistent snapshot taken on the server's clock. Recent ops/s needs two snapshots: it is the
number of op outcomes the shard stored in between, divided by the server time between them.
The fields are documented for users in ``docs/operations.md``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._backend.commands import raise_errors
from .._scripts.submit import StatusReply
from .._scripts.submit import status as status_call
from .._wire.layout import Layout
from .._wire.resharding import LayoutRecord
from .._wire.roster import ROSTER_SILENT, WorkerEntry, live_entries, mismatches

#: A worker's public key as a lease value ends with it (``_wire.signing.encode_public_key``: 32
#: bytes, unpadded base64url, so never a '.').
_PUBLIC_KEY = re.compile(r"[A-Za-z0-9_-]{43}")


@dataclass(frozen=True, slots=True)
class Owner:
    """The worker holding a shard's lease, from the lease's value ``<token>.<public key>`` (its
    coordination channel less the prefix: ``_wire.layout.owner_channel``), or from a worker's
    token ``host:pid:nonce`` (a roster entry's)."""

    #: The worker's token, ``host:pid:nonce``: what the roster names it by.
    worker: str
    host: str
    pid: int | None

    @property
    def host_pid(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def parse(cls, value: str) -> Owner:
        token, dot, key = value.rpartition(".")  # (a host name may have dots; a key has none)
        if not (dot and _PUBLIC_KEY.fullmatch(key)):
            token = value  # a plain token
        host_pid = token.rpartition(":")[0]  # less the nonce
        host, _, pid = host_pid.rpartition(":")
        return cls(token, host or token, int(pid) if pid.isdigit() else None)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One shard at one moment (server clock)."""

    shard: int
    owner: Owner | None
    lease_ms: int | None
    epoch: int | None
    backlog: int
    oldest_entry_ms: int | None
    dead_letters: int
    results: int
    results_since: str
    time_ms: int
    #: The shard's paused keys (``keyserial keys pause``), longest paused first.
    paused: tuple[str, ...] = ()
    #: Timers waiting on the shard, and when the next is due (ms, server clock; None: none).
    timers: int = 0
    next_timer_ms: int | None = None

    @property
    def next_timer_in_ms(self) -> int | None:
        """How long until the shard's next timer is due (0: overdue, its owner fires it)."""
        if self.next_timer_ms is None:
            return None
        return max(0, self.next_timer_ms - self.time_ms)

    @property
    def oldest_age_ms(self) -> int | None:
        """How long the first entry after the progress marker has waited."""
        if self.oldest_entry_ms is None:
            return None
        return max(0, self.time_ms - self.oldest_entry_ms)


@dataclass(frozen=True, slots=True)
class ShardStatus:
    snapshot: Snapshot
    #: Op outcomes stored per second between two snapshots; None if unmeasurable.
    ops_per_s: float | None

    def as_json(self) -> dict[str, Any]:
        now, owner = self.snapshot, self.snapshot.owner
        return {
            "shard": now.shard,
            "owner": None
            if owner is None
            else {"worker": owner.worker, "host": owner.host, "pid": owner.pid},
            "epoch": now.epoch,
            "lease_expires_in_ms": now.lease_ms,
            "backlog": now.backlog,
            "oldest_waiting_age_ms": now.oldest_age_ms,
            "dead_letters": now.dead_letters,
            "ops_per_s": None if self.ops_per_s is None else round(self.ops_per_s, 1),
            "paused": len(now.paused),
            "paused_keys": list(now.paused[:PAUSED_SHOWN]),
            "timers": now.timers,
            "next_timer_in_ms": now.next_timer_in_ms,
        }


#: The paused keys named per shard (the longest paused); ``keyserial keys paused`` lists all.
PAUSED_SHOWN = 5


async def snapshot(backend: Backend, layout: Layout) -> list[Snapshot]:
    """Every shard of the namespace, read in one pipeline."""
    calls = [status_call(keys) for keys in layout.all_keys()]
    replies = raise_errors(await backend.run_many(calls))
    return [_snapshot(shard, reply) for shard, reply in enumerate(replies)]


def _snapshot(shard: int, reply: StatusReply) -> Snapshot:
    return Snapshot(
        shard=shard,
        owner=None if reply.owner is None else Owner.parse(reply.owner),
        lease_ms=reply.lease_ms,
        epoch=reply.epoch,
        backlog=reply.backlog,
        oldest_entry_ms=int(reply.oldest_entry.partition("-")[0]) if reply.oldest_entry else None,
        dead_letters=reply.dead_letters,
        results=reply.results,
        results_since=reply.results_since,
        time_ms=reply.time_ms,
        paused=tuple(key for key, _ in reply.paused),
        timers=reply.timers,
        next_timer_ms=reply.next_timer_ms,
    )


def compare(before: Sequence[Snapshot], after: Sequence[Snapshot]) -> list[ShardStatus]:
    """Each shard's status at ``after``, with its ops/s since ``before``. A shard whose results
    hash turned over a generation in between (it was renamed) gets no rate."""
    statuses = []
    for old, new in zip(before, after, strict=True):
        elapsed = new.time_ms - old.time_ms
        stored = new.results - old.results
        rate = None
        if elapsed > 0 and stored >= 0 and old.results_since == new.results_since:
            rate = stored * 1000 / elapsed
        statuses.append(ShardStatus(new, rate))
    return statuses


#: The shortest time an ops/s figure is taken over, in server milliseconds: shorter, a busy
#: shard can read as idle (no outcome stored in the last few milliseconds).
RATE_WINDOW_MS = 1000


class Rates:
    """Ops/s for a series of snapshots of one layout, taken by whoever asks (two viewers of the
    dashboard a moment apart): each is compared with the newest earlier one taken at least
    :data:`RATE_WINDOW_MS` before it, or, until there is one, with the oldest kept."""

    def __init__(self) -> None:
        #: Earlier snapshots, oldest first: the newest one at least a window old, and after it
        #: those younger than a window.
        self._kept: list[list[Snapshot]] = []

    def of(self, now: list[Snapshot]) -> list[ShardStatus]:
        if self._kept and len(self._kept[0]) != len(now):
            self._kept = []  # (another layout: a reshard moved the namespace)
        at = now[0].time_ms if now else 0
        while len(self._kept) > 1 and at - self._kept[1][0].time_ms >= RATE_WINDOW_MS:
            del self._kept[0]
        before = self._kept[0] if self._kept else now
        self._kept.append(now)
        return compare(before, now)


def unowned(statuses: Sequence[ShardStatus]) -> list[int]:
    return [status.snapshot.shard for status in statuses if status.snapshot.owner is None]


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker on the roster: the shards it serves, those it owns now, its ops, and how long
    ago it last renewed its entry."""

    entry: WorkerEntry
    owns: tuple[int, ...]
    #: Workers that serve some of the same shards with another op set.
    differs_from: tuple[str, ...]
    #: Since it last renewed its roster entry: its own stamp against this host's clock (the
    #: clock the roster's 30 s staleness is judged by), 0 if that stamp is ahead.
    renewed_ms_ago: int = 0

    @property
    def standby(self) -> tuple[int, ...]:
        return tuple(shard for shard in self.entry.shards if shard not in self.owns)

    @property
    def maybe_gone(self) -> bool:
        """It missed two renewals in a row: stopped without a word (kill -9, a lost host), or
        stalled. Still listed until its entry is :data:`ROSTER_STALE` old."""
        return self.renewed_ms_ago > ROSTER_SILENT * 1000

    def as_json(self) -> dict[str, Any]:
        owner = Owner.parse(self.entry.token)
        return {
            "worker": self.entry.token,
            "host": owner.host,
            "pid": owner.pid,
            "serves": list(self.entry.shards),
            "owns": list(self.owns),
            "standby": list(self.standby),
            "ops": list(self.entry.ops),
            "ops_differ_from": list(self.differs_from),
            "renewed_ms_ago": self.renewed_ms_ago,
            "maybe_gone": self.maybe_gone,
        }


def workers(
    entries: Sequence[WorkerEntry], statuses: Sequence[ShardStatus], now: float | None = None
) -> list[WorkerStatus]:
    """Each live roster entry with the shards it owns in ``statuses``, and the age of its
    entry at ``now`` (seconds since the epoch; default: this host's clock)."""
    now = time.time() if now is None else now
    owners: dict[str, list[int]] = {}
    for status in statuses:
        if status.snapshot.owner is not None:
            owners.setdefault(status.snapshot.owner.worker, []).append(status.snapshot.shard)
    return [
        WorkerStatus(
            entry,
            tuple(owners.get(entry.token, ())),
            tuple(mismatch.other for mismatch in mismatches(entry, entries)),
            max(0, round((now - entry.renewed_at) * 1000)),
        )
        for entry in entries
    ]


async def live_workers(
    backend: Backend, namespace: str, statuses: Sequence[ShardStatus]
) -> list[WorkerStatus]:
    """The workers the namespace's roster lists as live, with the shards each owns in
    ``statuses``."""
    roster, _ = live_entries(await backend.roster(namespace))
    return workers(roster, statuses)


def as_json(
    namespace: str,
    statuses: Sequence[ShardStatus],
    roster: Sequence[WorkerStatus] = (),
    record: LayoutRecord | None = None,
) -> dict[str, Any]:
    move = None if record is None else record.move
    return {
        "namespace": namespace,
        "shard_count": len(statuses),
        "generation": 0 if record is None else record.live.generation,
        "reshard": None if move is None else {"from": move.source.shards, "to": move.target.shards},
        "healthy": not unowned(statuses),
        "shards": [status.as_json() for status in statuses],
        "workers": [worker.as_json() for worker in roster],
    }
