"""``keyserial call``, ``read`` and ``result``: an operator's view of one key, through the same
client an app uses (so the client ACL user is enough). ``keyserial keys pause|resume|paused``:
an operator's hold on a key (``_operator.pauses``).

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
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._backend.backend import Backend
from .._client.api import Client
from .._client.connect import connect
from .._operator.pauses import list_paused, pause
from .._ops import call as named_call
from .._settings import default_url
from ..errors import OperationFailed, ResultNotFound, SubmitTimeout
from .arguments import Subcommands, connection_options, run_connected, seconds

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


async def _pause_command(backend: Backend, args: argparse.Namespace) -> int:
    if args.keys_command == "paused":
        paused = await list_paused(backend, args.namespace)
        print(json.dumps([key.as_json() for key in paused], ensure_ascii=False))
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
