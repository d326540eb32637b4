"""``keyserial dead-letters``: list, show, replay and drop a namespace's dead letters (what
each is, and how a replay runs an op at most once: ``_operator.deadletters``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._backend.backend import Backend
from .._operator.deadletters import (
    LETTER_ID,
    DeadLetter,
    Replayed,
    ReplayStopped,
    drop,
    read,
    replay,
)
from .._operator.namespace import layout_in_use
from .._wire.layout import Layout
from .arguments import Subcommands, connection_options, positive, run_connected

COMMANDS = ("dead-letters",)


def add_commands(commands: Subcommands) -> None:
    dead = commands.add_parser("dead-letters", help="list, show, replay or drop dead letters")
    actions = dead.add_subparsers(dest="action", required=True)
    shard = argparse.ArgumentParser(add_help=False, parents=[connection_options()])
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
        if name == "replay":
            action.add_argument(
                "--new-id",
                action="store_true",
                help="under new op ids instead: each op runs again, even one that has an outcome",
            )


def _letter_id(text: str) -> str:
    """A whole dead-letter id: a part of one would match other letters (all of them, if
    empty)."""
    if not LETTER_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dead-letter id (`list` shows them: 1700000000000-0)"
        )
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``dead-letters``; the exit code."""
    return run_connected(args, _run_dead_letters)


async def _run_dead_letters(backend: Backend, args: argparse.Namespace) -> int:
    layout = await layout_in_use(backend, args.namespace)
    shard_count = layout.shards
    if args.shard is not None and not 0 <= args.shard < shard_count:
        print(
            f"keyserial: error: --shard {args.shard} is not a shard of namespace"
            f" {args.namespace!r} (0-{shard_count - 1})",
            file=sys.stderr,
        )
        return 2
    shards = range(shard_count) if args.shard is None else [args.shard]
    if args.action == "list":
        letters = await read(backend, layout, shards, count=args.count)
        _print_letters(letters, as_json=args.json)
        return 0
    selected = await _selected(backend, layout, args, shards)
    if selected is None:
        return 1
    if args.action == "show":
        _print_letters(selected, as_json=args.json, full=True)
        return 0
    if args.action == "replay":
        max_backlog = args.settings.max_backlog
        return await _replay(backend, layout, selected, max_backlog, new_ids=args.new_id)
    dropped = sum([await drop(backend, layout, one) for one in selected])
    print(f"dropped {dropped} dead letter(s)")
    return 0


async def _selected(
    backend: Backend, layout: Layout, args: argparse.Namespace, shards: range | list[int]
) -> list[DeadLetter] | None:
    """The dead letters the arguments name; None (after saying why) if one is missing or is on
    more than one shard."""
    if getattr(args, "all", False):
        return await read(backend, layout, shards)
    wanted = [args.id] if args.action == "show" else args.ids
    letters = []
    for letter_id in wanted:
        found = await read(backend, layout, shards, letter_id=letter_id)
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


def _print_letters(letters: list[DeadLetter], *, as_json: bool, full: bool = False) -> None:
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
    layout: Layout,
    letters: list[DeadLetter],
    max_backlog: int,
    *,
    new_ids: bool,
) -> int:
    for letter in letters:
        try:
            replayed, skipped = await replay(
                backend, layout, letter, max_backlog=max_backlog, new_ids=new_ids
            )
        except ReplayStopped as stopped:
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


def _print_replayed(replayed: list[Replayed]) -> None:
    for op in replayed:
        if op.was is not None:
            print(
                f"replayed op {op.was!r} under the new op id {op.op_id!r} to shard {op.shard} at"
                f" inbox place {op.entry} (it runs again; its outcome is stored under the new id)"
            )
            continue
        note = (
            " (it has a stored outcome: the worker answers with it and does not run it)"
            if op.had_outcome
            else ""
        )
        print(f"replayed op {op.op_id!r} to shard {op.shard} at inbox place {op.entry}{note}")
