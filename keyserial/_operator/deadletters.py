"""A namespace's dead letters, as an operator reads, replays and drops them.

A dead letter (``ks:{<ns>:<shard>}:dead``, its record in ``_wire.deadletters``) is one of:

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

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._scripts.refusals import BacklogRefused
from .._scripts.submit import SubmitArgs, submit
from .._wire.codec import WIRE_VERSION, dead_letter_envelopes, keys_named, pack_entry
from .._wire.deadletters import DeadLetterRecord
from .._wire.json_text import dumps
from .._wire.layout import Layout
from .._wire.routing import home_shard

#: A dead letter's id, as its stream names it (a part of one would match other letters).
LETTER_ID = re.compile(r"[0-9]+-[0-9]+")


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
    #: Its entry's place in the shard's inbox.
    entry: str
    had_outcome: bool
    #: With ``--new-id``: the op id it had in the letter (``op_id`` is the new one).
    was: str | None = None


def _letter(shard: int, letter_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    record = DeadLetterRecord.decode(fields)
    return DeadLetter(
        shard, letter_id.decode(errors="replace"), record.entry, record.reason, record.raw
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


def _home(envelope: dict[str, Any], shard_count: int) -> int | None:
    """The shard an envelope belongs on (a multi-key op's: the lowest of its keys'), or None
    if it names no key to route by."""
    keys = keys_named(envelope)
    return None if keys is None else home_shard(keys, shard_count)


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
        shard = _home(envelope, layout.shards)
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
            Replayed(op_id, shard, entry.place, outcome is not None, was.get(op_id))
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
