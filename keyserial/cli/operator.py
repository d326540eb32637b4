"""The operator's subcommands of ``keyserial``: ``status`` and ``dead-letters``.

Both only read Redis, except ``dead-letters replay`` (appends through the submit script) and
``dead-letters drop`` (deletes dead letters). ``cli.py`` registers them with
:func:`add_operator_commands` and hands their parsed arguments to :func:`run_operator_command`.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from typing import Any

import anyio

from .._backend.backend import Backend
from .._client.connect import default_url
from .._settings import Settings
from ..errors import KeyserialError
from . import deadletters as _deadletters
from . import status as _status
from .argtypes import positive, seconds

OPERATOR_COMMANDS = ("status", "dead-letters")
_LETTER_ID = re.compile(r"[0-9]+-[0-9]+")
_CLEAR_SCREEN = "\x1b[2J\x1b[H"


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="Redis URL (default: $KEYSERIAL_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    common.add_argument(
        "--namespace", default=None, help="(default: $KEYSERIAL_NAMESPACE or default)"
    )
    common.set_defaults(log_level="WARNING")
    return common


def add_operator_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _connection_options()
    status = commands.add_parser(
        "status",
        parents=[common],
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

    dead = commands.add_parser("dead-letters", help="list, show, replay or drop dead letters")
    actions = dead.add_subparsers(dest="action", required=True)
    shard = argparse.ArgumentParser(add_help=False, parents=[common])
    shard.add_argument(
        "--shard",
        type=int,
        default=None,
        metavar="N",
        help="only this shard (default: every shard)",
    )
    listing = actions.add_parser("list", parents=[shard], help="dead letters, oldest first")
    listing.add_argument(
        "--count",
        type=positive,
        default=100,
        metavar="N",
        help="at most N per shard (default: %(default)s)",
    )
    listing.add_argument("--json", action="store_true")
    show = actions.add_parser("show", parents=[shard], help="one dead letter in full")
    show.add_argument("id", type=_letter_id, help="its id, as `list` shows it")
    show.add_argument("--json", action="store_true")
    for name, what in (
        ("replay", "append the ops again under their op ids"),
        ("drop", "delete dead letters"),
    ):
        action = actions.add_parser(name, parents=[shard], help=what)
        chosen = action.add_mutually_exclusive_group(required=True)
        chosen.add_argument("ids", nargs="*", type=_letter_id, default=[], metavar="ID")
        chosen.add_argument("--all", action="store_true", help="every dead letter selected")


def _letter_id(text: str) -> str:
    """A whole dead-letter id: a part of one would match other letters (all of them, if
    empty)."""
    if not _LETTER_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dead-letter id (`list` shows them: 1700000000000-0)"
        )
    return text


def run_operator_command(args: argparse.Namespace) -> int:
    """Run ``status`` or ``dead-letters``; the exit code. Settings the flags leave out come
    from their ``KEYSERIAL_*`` variables, as the worker's do."""
    try:
        args.settings = Settings.resolve(namespace=args.namespace)
        args.namespace = args.settings.namespace
        if args.command == "status":
            return anyio.run(_run_status, args)
        return anyio.run(_run_dead_letters, args)
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


# -- dead-letters ------------------------------------------------------------------------------


async def _run_dead_letters(args: argparse.Namespace) -> int:
    backend = await Backend.connect(args.redis or default_url())
    try:
        shard_count = await _status.shard_count(backend, args.namespace)
        if args.shard is not None and not 0 <= args.shard < shard_count:
            print(
                f"keyserial: error: --shard {args.shard} is not a shard of namespace"
                f" {args.namespace!r} (0-{shard_count - 1})",
                file=sys.stderr,
            )
            return 2
        shards = range(shard_count) if args.shard is None else [args.shard]
        if args.action == "list":
            letters = await _deadletters.read(backend, args.namespace, shards, count=args.count)
            _print_letters(letters, as_json=args.json)
            return 0
        selected = await _selected(backend, args, shards)
        if selected is None:
            return 1
        if args.action == "show":
            _print_letters(selected, as_json=args.json, full=True)
            return 0
        if args.action == "replay":
            max_backlog = args.settings.max_backlog
            return await _replay(backend, args.namespace, shard_count, selected, max_backlog)
        dropped = sum([await _deadletters.drop(backend, args.namespace, one) for one in selected])
        print(f"dropped {dropped} dead letter(s)")
        return 0
    finally:
        await backend.aclose()


async def _selected(
    backend: Backend, args: argparse.Namespace, shards: range | list[int]
) -> list[_deadletters.DeadLetter] | None:
    """The dead letters the arguments name; None (after saying why) if one is missing or is on
    more than one shard."""
    if getattr(args, "all", False):
        return await _deadletters.read(backend, args.namespace, shards)
    wanted = [args.id] if args.action == "show" else args.ids
    letters = []
    for letter_id in wanted:
        found = await _deadletters.read(backend, args.namespace, shards, letter_id=letter_id)
        if len(found) != 1:
            problem = "no dead letter" if not found else "more than one shard has a dead letter"
            print(
                f"keyserial: error: {problem} with id {letter_id!r}"
                + (" (pass --shard)" if found else ""),
                file=sys.stderr,
            )
            return None
        letters += found
    return letters


def _print_letters(
    letters: list[_deadletters.DeadLetter], *, as_json: bool, full: bool = False
) -> None:
    if as_json:
        for letter in letters:
            print(json.dumps(letter.as_json()))
        return
    for letter in letters:
        ops = ", ".join(letter.op_ids()) or "(no op id)"
        print(f"shard {letter.shard}  {letter.letter_id}  entry {letter.entry}  ops {ops}")
        print(f"    {letter.reason}")
        if full:
            print(f"    raw: {_pretty(letter.raw)}")
    if not letters:
        print("no dead letters")


def _pretty(raw: str) -> str:
    try:
        value: Any = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(value, ensure_ascii=False, indent=2).replace("\n", "\n    ")


async def _replay(
    backend: Backend,
    namespace: str,
    shard_count: int,
    letters: list[_deadletters.DeadLetter],
    max_backlog: int,
) -> int:
    for letter in letters:
        try:
            replayed, skipped = await _deadletters.replay(
                backend, namespace, shard_count, letter, max_backlog=max_backlog
            )
        except _deadletters.ReplayStopped as stopped:
            _print_replayed(stopped.replayed)
            appended = "the ops above were" if stopped.replayed else "nothing of it was"
            print(
                f"keyserial: error: dead letter {letter.letter_id}: {stopped}: ops"
                f" {', '.join(map(repr, stopped.refused))} and any after them were not"
                f" appended, {appended} (replaying the letter again never runs an op twice)",
                file=sys.stderr,
            )
            return 1
        _print_replayed(replayed)
        for reason in skipped:
            print(f"skipped from dead letter {letter.letter_id}: {reason}")
    return 0


def _print_replayed(replayed: list[_deadletters.Replayed]) -> None:
    for op in replayed:
        note = (
            " (it has a stored outcome: the worker answers with it and does not run it)"
            if op.had_outcome
            else ""
        )
        print(f"replayed op {op.op_id!r} to shard {op.shard} as entry {op.entry}{note}")
