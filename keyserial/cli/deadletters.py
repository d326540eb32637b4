"""``keyserial dead-letters``: read, replay and drop a namespace's dead letters.

A dead letter (``ks:{<ns>:<shard>}:dead``, fields ``entry``, ``reason``, ``raw``) is one of:

* a poison op: ``raw`` is its envelope (re-encoded by the server's Lua ``cjson``, which writes an
  empty array as ``{}``);
* an unreadable stream entry: ``raw`` is the entry's fields, ``{"v": ..., "ops": "<text>"}``;
* an element of an entry that is not an op envelope with an id: ``raw`` is that element.

Replay appends the ops found in ``raw`` again, each under its own op id, through the submit
script the client uses, not marked fresh: so the worker looks up each id's stored outcome first,
and an op that already has one (it ran, or was refused, poison ops included) is answered from it
and never runs again. Only an op with no stored outcome runs, once.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._scripts.refusals import BacklogRefused
from .._scripts.submit import SubmitArgs, submit
from .._wire.codec import WIRE_VERSION, dead_letter_envelopes, pack_entry
from .._wire.json_text import dumps
from .._wire.layout import Layout
from .._wire.routing import home_shard as routed_home
from .arguments import Subcommands, connection_options, positive, run_connected
from .status import recorded_layout


@dataclass(frozen=True, slots=True)
class DeadLetter:
    shard: int
    #: Its id in the dead-letter stream (not the stream entry it came from).
    letter_id: str
    #: The id of the shard stream's entry it came from.
    entry: str
    reason: str
    raw: str

    def as_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "id": self.letter_id,
            "entry": self.entry,
            "reason": self.reason,
            "raw": self.raw,
            "op_ids": self.op_ids(),
        }

    def op_ids(self) -> list[str]:
        return [envelope["id"] for envelope in dead_letter_envelopes(self.raw)[0]]


@dataclass(frozen=True, slots=True)
class Replayed:
    """One op appended again: where, and whether it had an outcome already (then it will not
    run: the worker answers with that outcome)."""

    op_id: str
    shard: int
    entry: str
    had_outcome: bool
    #: With ``--new-id``: the op id it had in the letter (``op_id`` is the new one).
    was: str | None = None


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _letter(shard: int, letter_id: bytes | str, fields: dict[bytes, bytes]) -> DeadLetter:
    got = {_text(name): _text(value) for name, value in fields.items()}
    return DeadLetter(
        shard, _text(letter_id), got.get("entry", ""), got.get("reason", ""), got.get("raw", "")
    )


async def read(
    backend: Backend,
    layout: Layout,
    shards: Sequence[int],
    *,
    count: int | None = None,
    letter_id: str | None = None,
) -> list[DeadLetter]:
    """The dead letters of ``shards``, oldest first: all (up to ``count`` per shard), or the one
    with ``letter_id`` (each shard's ids are its own, so it may be on more than one)."""
    found = []
    first, last = (letter_id, letter_id) if letter_id else ("-", "+")
    for shard in shards:
        letters = await backend.dead_letters(layout.keys(shard), first, last, count)
        found += [_letter(shard, entry_id, fields) for entry_id, fields in letters]
    return found


def home_shard(envelope: dict[str, Any], shard_count: int) -> int | None:
    """The shard an envelope belongs on (a multi-key op's: the lowest of its keys'), or None
    if it names no key to route by."""
    keys = envelope.get("keys", [envelope.get("key")])
    if (
        not isinstance(keys, list)
        or not keys
        or not all(isinstance(key, str) and key for key in keys)
    ):
        return None
    return routed_home(keys, shard_count)


class ReplayStopped(Exception):
    """A shard's backlog was full: its ops (``refused``) were not appended; ``replayed`` were,
    to shards before it (replaying the letter again later never runs them twice)."""

    def __init__(
        self, shard: int, refused: list[str], replayed: list[Replayed], refusal: BacklogRefused
    ) -> None:
        super().__init__(f"shard {shard}'s backlog is full ({refusal})")
        self.shard = shard
        self.refused = refused
        self.replayed = replayed


async def replay(
    backend: Backend,
    layout: Layout,
    letter: DeadLetter,
    *,
    max_backlog: int,
    new_ids: bool = False,
) -> tuple[list[Replayed], list[str]]:
    """Append the letter's ops again (one entry per shard they route to); what was appended,
    and what was skipped and why. ``new_ids``: each under a new op id (and no reply channel:
    its caller is long gone), so that it runs again even if it has an outcome.

    :raises ReplayStopped: when a shard's backlog is full (nothing of that shard appended,
        nor of the shards after it; the ops appended before are in the error).
    """
    found, skipped = dead_letter_envelopes(letter.raw)
    was: dict[str, str] = {}
    if new_ids:
        renamed = [_renamed(envelope) for envelope in found]
        was = {new["id"]: old["id"] for new, old in zip(renamed, found, strict=True)}
        found = renamed
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for envelope in found:
        shard = home_shard(envelope, layout.shards)
        if shard is None:
            skipped.append(f"op {envelope['id']!r}: no key to route by")
        else:
            by_shard.setdefault(shard, []).append(envelope)
    replayed: list[Replayed] = []
    for shard, ops in sorted(by_shard.items()):
        keys = layout.keys(shard)
        ids = [envelope["id"] for envelope in ops]
        stored = await backend.stored(keys, ids)
        try:
            entry = await backend.run_call(
                submit(
                    keys,
                    SubmitArgs(
                        max_backlog,
                        WIRE_VERSION,
                        pack_entry([dumps(op) for op in ops]),
                        keys.wake(backend.sharded_pubsub),
                    ),
                )
            )
        except BacklogRefused as exc:
            raise ReplayStopped(shard, ids, replayed, exc) from exc
        replayed += [
            Replayed(op_id, shard, _text(entry), outcome is not None, was.get(op_id))
            for op_id, outcome in zip(ids, stored, strict=True)
        ]
    return replayed, skipped


def _renamed(envelope: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` under a new op id, derived from its own, with no reply channel."""
    renamed = {name: value for name, value in envelope.items() if name != "reply"}
    renamed["id"] = f"{envelope['id']}.replay-{secrets.token_hex(8)}"
    return renamed


async def drop(backend: Backend, layout: Layout, letter: DeadLetter) -> int:
    """Delete one dead letter; 1 if it was there."""
    return int(await backend.drop_dead_letter(layout.keys(letter.shard), letter.letter_id))


# -- the command -------------------------------------------------------------------------------

COMMANDS = ("dead-letters",)
LETTER_ID = re.compile(r"[0-9]+-[0-9]+")


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
    layout = await recorded_layout(backend, args.namespace)
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
                f"replayed op {op.was!r} under the new op id {op.op_id!r} to shard {op.shard} as"
                f" entry {op.entry} (it runs again; its outcome is stored under the new id)"
            )
            continue
        note = (
            " (it has a stored outcome: the worker answers with it and does not run it)"
            if op.had_outcome
            else ""
        )
        print(f"replayed op {op.op_id!r} to shard {op.shard} as entry {op.entry}{note}")
