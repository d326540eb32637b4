"""``keyserial status``: who owns each shard of a namespace, and how far behind it is (read by
``_operator.status``), as a table or JSON, once or until interrupted."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from .._backend.backend import Backend
from .._operator.namespace import record_in_use
from .._operator.status import (
    PAUSED_SHOWN,
    Owner,
    ShardStatus,
    WorkerStatus,
    as_json,
    compare,
    live_workers,
    snapshot,
    unowned,
)
from .._wire.resharding import LayoutRecord
from .._wire.routing import format_shards
from .arguments import Subcommands, connection_options, run_connected, seconds

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
    "TIMERS",
    "NEXT",
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
                str(now.timers),
                _duration(now.next_timer_in_ms),
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
    record = await record_in_use(backend, args.namespace)
    healthy = True
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            if args.watch:
                await group.start(_cancel_on_signal, scope)
            before = await snapshot(backend, record.live)
            while True:
                await anyio.sleep(args.interval)
                now = await record_in_use(backend, args.namespace)
                if now.live != record.live:  # resharded: compare the new shards from now on
                    before = await snapshot(backend, now.live)
                record = now
                after = await snapshot(backend, record.live)
                statuses = compare(before, after)
                roster = await live_workers(backend, args.namespace, statuses)
                healthy = not unowned(statuses)
                _print_status(args, statuses, roster, record)
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
