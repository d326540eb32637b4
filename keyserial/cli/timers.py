"""``keyserial timers``: list a namespace's pending timers (delayed ops, and timers ops set), and
cancel one (``_operator.timers``)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from .._backend.backend import Backend
from .._operator.namespace import layout_in_use
from .._operator.timers import PendingTimer, cancel, pending
from .arguments import Subcommands, connection_options, positive, run_connected

COMMANDS = ("timers",)


def add_commands(commands: Subcommands) -> None:
    timers = commands.add_parser("timers", help="list or cancel pending timers")
    actions = timers.add_subparsers(dest="action", required=True)
    shard = argparse.ArgumentParser(add_help=False, parents=[connection_options()])
    shard.add_argument(
        "--shard", type=int, default=None, metavar="N", help="only this shard (default: every)"
    )
    listing = actions.add_parser("list", parents=[shard], help="pending timers, soonest first")
    listing.add_argument("key", nargs="?", default=None, help="only the timers of this key")
    listing.add_argument(
        "--count",
        type=positive,
        default=100,
        metavar="N",
        help="at most N (default: %(default)s)",
    )
    listing.add_argument("--json", action="store_true")
    cancelling = actions.add_parser(
        "cancel", parents=[shard], help="cancel pending timers: their ops never run"
    )
    cancelling.add_argument("ids", nargs="+", metavar="ID", help="a timer's id, as `list` shows it")


def run(args: argparse.Namespace) -> int:
    """Run ``timers``; the exit code."""
    return run_connected(args, _run_timers)


async def _run_timers(backend: Backend, args: argparse.Namespace) -> int:
    layout = await layout_in_use(backend, args.namespace)
    if args.shard is not None and not 0 <= args.shard < layout.shards:
        print(
            f"keyserial: error: --shard {args.shard} is not a shard of namespace"
            f" {args.namespace!r} (0-{layout.shards - 1})",
            file=sys.stderr,
        )
        return 2
    shards = range(layout.shards) if args.shard is None else [args.shard]
    if args.action == "list":
        timers = await pending(backend, layout, shards, key=args.key)
        _print_timers(timers[: args.count], as_json=args.json)
        return 0
    found = {timer.timer_id: timer for timer in await pending(backend, layout, shards)}
    failed = 0
    for timer_id in args.ids:
        timer = found.get(timer_id)
        if timer is None or not await cancel(backend, layout, timer):
            print(
                f"keyserial: error: no pending timer {timer_id!r} (it fired, was cancelled, or"
                " never existed; `keyserial timers list` shows the pending ones)",
                file=sys.stderr,
            )
            failed += 1
            continue
        ops = ", ".join(op_id for op_id, _, _ in timer.ops)
        print(f"cancelled timer {timer_id} on shard {timer.shard}: its ops ({ops}) never run")
    return 1 if failed else 0


def _print_timers(timers: list[PendingTimer], *, as_json: bool) -> None:
    if as_json:
        for timer in timers:
            print(json.dumps(timer.as_json()))
        return
    for timer in timers:
        due = datetime.fromtimestamp(timer.due_ms / 1000, UTC).isoformat(timespec="milliseconds")
        ops = ", ".join(f"{name} {op_id} on {', '.join(keys)}" for op_id, name, keys in timer.ops)
        print(f"shard {timer.shard}  {timer.timer_id}  due {due}  {ops or '(no readable op)'}")
    if not timers:
        print("no pending timers")
