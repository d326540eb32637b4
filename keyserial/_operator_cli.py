"""The operator's subcommands of ``keyserial``: ``status``, which only reads Redis.

``cli.py`` registers them with :func:`add_operator_commands` and hands their parsed arguments to
:func:`run_operator_command`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import anyio

from . import _status
from ._backend import Backend
from ._connect import default_url
from .errors import KeyserialError

OPERATOR_COMMANDS = ("status",)
_CLEAR_SCREEN = "\x1b[2J\x1b[H"


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default: $KEYSERIAL_REDIS_URL or"
                        " redis://127.0.0.1:6379/0)")
    common.add_argument("--namespace", default="default", help="(default: %(default)s)")
    common.set_defaults(log_level="WARNING")
    return common


def add_operator_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _connection_options()
    status = commands.add_parser(
        "status", parents=[common], help="owners, backlog and dead letters of every shard;"
        " exits 1 when a shard has no owner",
    )
    status.add_argument("--json", action="store_true", help="print JSON (docs/operations.md)")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument("--interval", type=_interval, default=1.0, metavar="SECONDS",
                        help="seconds ops/s is measured over, and between refreshes"
                        " (default: %(default)s)")


def run_operator_command(args: argparse.Namespace) -> int:
    """Run ``status`` or ``dead-letters``; the exit code."""
    try:
        return anyio.run(_run_status, args)
    except KeyserialError as exc:
        print(f"keyserial: error: {exc}", file=sys.stderr)
        return 2


# -- status ------------------------------------------------------------------------------------


async def _run_status(args: argparse.Namespace) -> int:
    backend = await Backend.connect(args.redis or default_url())
    try:
        shards = await _status.shard_count(backend, args.namespace)
        healthy = True
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                if args.watch:
                    group.start_soon(_cancel_on_signal, scope)
                before = await _status.snapshot(backend, args.namespace, shards)
                while True:
                    await anyio.sleep(args.interval)
                    after = await _status.snapshot(backend, args.namespace, shards)
                    statuses = _status.compare(before, after)
                    healthy = not _status.unowned(statuses)
                    _print_status(args, statuses)
                    if not args.watch:
                        break
                    before = after
                group.cancel_scope.cancel()
        return 0 if healthy else 1
    finally:
        await backend.aclose()


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


def _print_status(args: argparse.Namespace, statuses: list[_status.ShardStatus]) -> None:
    if args.json:
        print(json.dumps(_status.as_json(args.namespace, statuses)), flush=True)
        return
    table = _status.render_table(args.namespace, statuses)
    if args.watch and sys.stdout.isatty():
        table = _CLEAR_SCREEN + table
    elif args.watch:
        table += "\n"
    print(table, flush=True)
