"""``keyserial status``: who owns each shard of a namespace, and how far behind it is.

Each shard is read in one read-only script (``lua/status.lua``), so its figures are one
consistent snapshot taken on the server's clock. Recent ops/s needs two snapshots: it is the
number of op outcomes the shard stored in between, divided by the server time between them.
The fields are documented for users in ``docs/operations.md``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus

from .._backend.backend import Backend
from .._backend.commands import raise_errors
from .._scripts.submit import StatusReply
from .._scripts.submit import status as status_call
from .._wire.layout import Layout
from .._wire.resharding import LayoutRecord
from .._wire.roster import ROSTER_SILENT, WorkerEntry, live_entries, mismatches
from .._wire.routing import format_shards
from ..errors import ConfigError
from .arguments import Subcommands, connection_options, run_connected, seconds


@dataclass(frozen=True, slots=True)
class Owner:
    """The worker holding a shard's lease, from its owner token ``host:pid:nonce``."""

    worker: str
    host: str
    pid: int | None

    @property
    def host_pid(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def parse(cls, token: str) -> Owner:
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
        }


#: The paused keys named per shard (the longest paused); ``keyserial keys paused`` lists all.
PAUSED_SHOWN = 5


async def recorded_layout(backend: Backend, namespace: str) -> Layout:
    """The namespace's recorded layout (its shard count).

    :raises ConfigError: if nothing has used the namespace yet (nothing is recorded).
    """
    return (await layout_record(backend, namespace)).live


async def layout_record(backend: Backend, namespace: str) -> LayoutRecord:
    """The namespace's layout record (its layout, and the reshard under way if any).

    :raises ConfigError: if nothing has used the namespace yet (nothing is recorded).
    """
    recorded = await backend.layout_record(namespace)
    if recorded is None:
        raise ConfigError(
            f"namespace {namespace!r} has no shard count recorded in Redis: no worker or client"
            " has used it (check --namespace and --redis)"
        )
    return recorded


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


_COLUMNS = (
    "SHARD",
    "OWNER (host:pid)",
    "EPOCH",
    "LEASE",
    "BACKLOG",
    "OLDEST",
    "DEAD",
    "OPS/S",
    "PAUSED",
)


def render_table(
    namespace: str,
    statuses: Sequence[ShardStatus],
    roster: Sequence[WorkerStatus] = (),
    record: LayoutRecord | None = None,
) -> str:
    """The human view: one row per shard, one per worker, then a verdict line."""
    rows = [_COLUMNS]
    for status in statuses:
        now = status.snapshot
        owner = "-" if now.owner is None else now.owner.host_pid
        rows.append(
            (
                str(now.shard),
                owner,
                "-" if now.epoch is None else str(now.epoch),
                _duration(now.lease_ms),
                str(now.backlog),
                _duration(now.oldest_age_ms),
                str(now.dead_letters),
                "-" if status.ops_per_s is None else f"{status.ops_per_s:.1f}",
                str(len(now.paused)),
            )
        )
    lines = [f"namespace {namespace!r}: {len(statuses)} shards", *_aligned(rows)]
    if roster:
        lines += _aligned([_WORKER_COLUMNS, *(_worker_row(worker) for worker in roster)])
    lines += _paused_lines(statuses)
    if record is not None and record.move is not None:
        move = record.move
        lines.append(
            f"resharding: {move.source.shards} -> {move.target.shards} shards; new ops wait on"
            f" the new shards until the old ones drain (keyserial reshard --to"
            f" {move.target.shards} finishes an interrupted move)"
        )
    missing = unowned(statuses)
    if missing:
        lines.append(f"UNHEALTHY: no worker owns shard(s) {', '.join(map(str, missing))}")
    else:
        lines.append("ok: every shard has an owner")
    return "\n".join(lines)


_WORKER_COLUMNS = ("WORKER (host:pid)", "OWNS", "STANDBY FOR", "OPS", "RENEWED")


def _worker_row(worker: WorkerStatus) -> tuple[str, ...]:
    owner = Owner.parse(worker.entry.token)
    ops = f"{len(worker.entry.ops)} ops"
    if worker.differs_from:
        others = ", ".join(Owner.parse(other).host_pid for other in worker.differs_from)
        ops += f" (NOT THE SAME AS {others})"
    return (
        owner.host_pid,
        format_shards(worker.owns) if worker.owns else "-",
        format_shards(worker.standby) if worker.standby else "-",
        ops,
        f"{_duration(worker.renewed_ms_ago)} ago" + (" (gone?)" if worker.maybe_gone else ""),
    )


def _paused_lines(statuses: Sequence[ShardStatus]) -> list[str]:
    """The paused keys of each shard that has some: their ops wait, so its backlog and oldest
    waiting entry grow, and their callers time out, until the keys are resumed."""
    held = [status.snapshot for status in statuses if status.snapshot.paused]
    if not held:
        return []
    lines = ["paused keys (their ops wait until `keyserial keys resume KEY`):"]
    for now in held:
        shown = ", ".join(repr(key) for key in now.paused[:PAUSED_SHOWN])
        more = len(now.paused) - PAUSED_SHOWN
        if more > 0:
            shown += f" and {more} more (`keyserial keys paused` lists them)"
        lines.append(f"  shard {now.shard}: {shown}")
    return lines


def _aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f}s"
    return f"{ms // 60_000}m"


# -- the command -------------------------------------------------------------------------------

COMMANDS = ("status",)
_CLEAR_SCREEN = "\x1b[2J\x1b[H"


def add_commands(commands: Subcommands) -> None:
    status = commands.add_parser(
        "status",
        parents=[connection_options()],
        help="owners, backlog and dead letters of every shard; exits 1 when a shard has no owner",
    )
    status.add_argument("--json", action="store_true", help="print JSON (docs/operations.md)")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument(
        "--interval",
        type=seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds ops/s is measured over, and between refreshes (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``status``; the exit code (1: a shard has no owner)."""
    return run_connected(args, _run_status)


async def _run_status(backend: Backend, args: argparse.Namespace) -> int:
    record = await layout_record(backend, args.namespace)
    healthy = True
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            if args.watch:
                await group.start(_cancel_on_signal, scope)
            before = await snapshot(backend, record.live)
            while True:
                await anyio.sleep(args.interval)
                now = await layout_record(backend, args.namespace)
                if now.live != record.live:  # resharded: compare the new shards from now on
                    before = await snapshot(backend, now.live)
                record = now
                after = await snapshot(backend, record.live)
                statuses = compare(before, after)
                roster, _ = live_entries(await backend.roster(args.namespace))
                healthy = not unowned(statuses)
                _print_status(args, statuses, workers(roster, statuses), record)
                if not args.watch:
                    break
                before = after
            group.cancel_scope.cancel()
    return 0 if healthy else 1


async def _cancel_on_signal(
    scope: anyio.CancelScope, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM (``--watch`` then exits with the code of
    its last report). Reports started once the handlers are set: no snapshot's script goes out
    before them, so a signal sent once the watch has begun to work is the watch's, never left to
    asyncio's handler (exit 130) or, where SIGINT was inherited ignored, to none."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            scope.cancel()
            return


def _print_status(
    args: argparse.Namespace,
    statuses: list[ShardStatus],
    roster: list[WorkerStatus],
    record: LayoutRecord,
) -> None:
    if args.json:
        print(json.dumps(as_json(args.namespace, statuses, roster, record)), flush=True)
        return
    table = render_table(args.namespace, statuses, roster, record)
    if args.watch and sys.stdout.isatty():
        table = _CLEAR_SCREEN + table
    elif args.watch:
        table += "\n"
    print(table, flush=True)
