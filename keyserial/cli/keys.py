"""``keyserial call``, ``read`` and ``result``: an operator's view of one key, through the same
client an app uses (so the client ACL user is enough). ``keyserial keys pause|resume|paused``:
an operator's hold on a key, recorded in the shard's ``paused`` hash (the worker ACL user: a
client user may not write it). A paused key's ops queue and none runs, whoever owns the shard,
until it is resumed; its shard's other keys flow.

``call KEY OP [ARG...]`` submits an op by name: each ARG is taken as JSON if it parses as JSON
(``5``, ``"5"``, ``[1,2]``, ``null``), else as a string (``hello``); ``--kw NAME=ARG`` passes a
keyword argument the same way. The value is printed as JSON on stdout. An op that fails prints
its error on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._backend.backend import Backend
from .._client.api import Client
from .._client.connect import connect, default_url
from .._ops import call as named_call
from .._wire.layout import Layout, ShardKeys
from .._wire.resharding import LayoutRecord
from .._wire.routing import shard_for
from ..errors import OperationFailed, ResultNotFound, SubmitTimeout
from .arguments import Subcommands, connection_options, run_connected, seconds
from .status import layout_record, recorded_layout

COMMANDS = ("call", "read", "result", "keys")


def add_commands(commands: Subcommands) -> None:
    common = connection_options()
    call = commands.add_parser(
        "call", parents=[common], help="submit an op on a key and print its value"
    )
    call.add_argument("key")
    call.add_argument("op", help="the op's registered name (deposit, myapp's reserve, ...)")
    call.add_argument("args", nargs="*", type=_json_or_text, metavar="ARG")
    call.add_argument(
        "--kw",
        action="append",
        type=_keyword,
        default=[],
        metavar="NAME=ARG",
        help="a keyword argument (repeatable)",
    )
    call.add_argument("--op-id", default=None, help="its op id: sent again, it never runs twice")
    call.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="how long to wait for its outcome (default: $KEYSERIAL_SUBMIT_TIMEOUT or 30)",
    )
    read = commands.add_parser(
        "read", parents=[common], help="print a key's committed state as JSON"
    )
    read.add_argument("key")
    result = commands.add_parser(
        "result", parents=[common], help="print the stored outcome of an op by its id"
    )
    result.add_argument("op_id")
    result.add_argument(
        "--key",
        action="append",
        required=True,
        metavar="KEY",
        help="the op's key (repeat it for each key of a multi-key op, in order)",
    )

    keys = commands.add_parser(
        "keys", help="pause or resume a key's ops, or list the paused keys"
    ).add_subparsers(dest="keys_command", required=True, metavar="{pause,resume,paused}")
    for name, what in (
        ("pause", "hold a key's ops: they queue, and none runs until it is resumed"),
        ("resume", "let a paused key's queued ops run, in order"),
    ):
        keys.add_parser(name, parents=[common], help=what).add_argument("key")
    keys.add_parser("paused", parents=[common], help="list the paused keys, as JSON")


def run(args: argparse.Namespace) -> int:
    if args.command == "keys":
        return run_connected(args, _pause_command)
    commands: dict[str, Callable[[Client, argparse.Namespace], Awaitable[Any]]] = {
        "call": _call,
        "read": _read,
        "result": _result,
    }
    return anyio.run(_connected, args, commands[args.command])


async def _connected(
    args: argparse.Namespace, command: Callable[[Client, argparse.Namespace], Awaitable[Any]]
) -> int:
    async with connect(args.redis or default_url(), namespace=args.namespace) as ks:
        try:
            value = await command(ks, args)
        except OperationFailed as failed:
            print(f"keyserial: {failed.error_type}: {failed.message}", file=sys.stderr)
            return 1
        except (ResultNotFound, SubmitTimeout) as missing:
            print(f"keyserial: {missing}", file=sys.stderr)
            return 1
    print(json.dumps(value, ensure_ascii=False))
    return 0


async def _call(ks: Client, args: argparse.Namespace) -> Any:
    op = named_call(args.op, *args.args, **dict(args.kw))
    return await ks.submit(args.key, op, timeout=args.timeout, op_id=args.op_id)


async def _read(ks: Client, args: argparse.Namespace) -> Any:
    return await ks.read(args.key)


async def _result(ks: Client, args: argparse.Namespace) -> Any:
    key: str | list[str] = args.key[0] if len(args.key) == 1 else args.key
    return await ks.result(args.op_id, key=key)


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text  # (NaN and Infinity are not JSON: taken as the words they are)
    return value


def _keyword(text: str) -> tuple[str, Any]:
    name, equals, value = text.partition("=")
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=ARG")
    return name, _json_or_text(value)


async def pause(backend: Backend, namespace: str, key: str, *, pausing: bool) -> tuple[int, bool]:
    """Pause ``key`` (or resume it, ``pausing`` False), for the CLI and the dashboard alike; its
    shard in the live layout, and whether it was paused there.

    A reshard copies the paused keys to the new layout before its flip, so a pause written only
    to the layout that was live when it was read is lost if it lands after that copy. So the
    record is written to the key's shard of the live layout and then, while a move is under
    way, of the move's target; then the layout record is read again, and, while the live layout
    or the move differs from the reading written by, written again by the new reading. The
    writes of the last round thus fall between two readings that find the same layouts:

    - no move under way: the writes precede any move's record, so its copy, which reads the
      live shards after the record, carries them;
    - a move under way: the writes precede its flip. The mover's copy ends with a round that
      writes the target's paused hashes from one reading of the source's and then finds the
      source's unchanged (``_reshard.mover._copy_paused``). If this target write followed that
      round's writes, it stands (nothing else writes the target before the flip). If it
      preceded them, so did this source write, which came first: so it preceded the round's
      second reading, and, that finding nothing changed, its first, and the round wrote this
      value;
    - the move's target live: the writes are in the live layout.

    Each write wakes its shard's owner, as a pause always did.
    """
    record = json.dumps({"at": int(time.time() * 1000)}) if pausing else None
    layouts = await layout_record(backend, namespace)
    was = await _write_pause(backend, layouts, key, record)
    while True:
        again = await layout_record(backend, namespace)
        if (again.live, again.move) == (layouts.live, layouts.move):
            return shard_for(key, again.live.shards), was
        layouts = again
        await _write_pause(backend, layouts, key, record)


async def _write_pause(
    backend: Backend, layouts: LayoutRecord, key: str, record: str | None
) -> bool:
    """Write ``key``'s pause ``record`` (None: resume it) to its shard of the live layout, then,
    if a move is under way, of the move's target; whether it was paused in the live one."""
    was = await backend.set_paused(_shard_keys(layouts.live, key), key, record)
    if layouts.move is not None:
        await backend.set_paused(_shard_keys(layouts.move.target, key), key, record)
    return was


def _shard_keys(layout: Layout, key: str) -> ShardKeys:
    return layout.keys(shard_for(key, layout.shards))


async def _pause_command(backend: Backend, args: argparse.Namespace) -> int:
    if args.keys_command == "paused":
        shards = (await recorded_layout(backend, args.namespace)).all_keys()
        paused = [
            {"key": key.decode(), "shard": keys.shard, **json.loads(found)}
            for keys, records in zip(shards, await backend.all_paused(shards), strict=True)
            for key, found in records.items()
        ]
        print(json.dumps(paused, ensure_ascii=False))
        return 0
    pausing = args.keys_command == "pause"
    shard, was_paused = await pause(backend, args.namespace, args.key, pausing=pausing)
    if pausing:
        again = " (it was paused already)" if was_paused else ""
        print(
            f"paused {args.key!r} (shard {shard}){again}: its ops queue until"
            f" `keyserial keys resume {args.key}`"
        )
    else:
        was = "" if was_paused else " (it was not paused)"
        print(f"resumed {args.key!r} (shard {shard}){was}: its queued ops run, in order")
    return 0
