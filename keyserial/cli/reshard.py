"""``keyserial reshard --to M``: move a live namespace to M shards (see ``_reshard.mover``)."""

from __future__ import annotations

import argparse

from .._backend.backend import Backend
from .._reshard.mover import move_namespace
from .arguments import Subcommands, connection_options, positive, run_connected

COMMANDS = ("reshard",)


def add_commands(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "reshard",
        parents=[connection_options()],
        help="move a live namespace to another shard count (run it again to finish a move)",
    )
    parser.add_argument(
        "--to", type=positive, required=True, metavar="M", help="the shard count to move to"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``reshard``; the exit code."""
    return run_connected(args, _run_reshard)


async def _run_reshard(backend: Backend, args: argparse.Namespace) -> int:
    done = await move_namespace(backend, args.settings, args.to, progress=_say)
    if done is not None:
        _say(
            f"done: the old shards drained in {done.drained_s:.2f}s, {done.states} states"
            f" copied in {done.copied_s:.2f}s"
        )
    return 0


def _say(line: str) -> None:
    print(f"keyserial reshard: {line}", flush=True)
