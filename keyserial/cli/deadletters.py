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

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._scripts.refusals import BacklogRefused
from .._scripts.submit import SubmitArgs, submit
from .._wire.codec import WIRE_VERSION, pack_entry
from .._wire.json_text import dumps
from .._wire.layout import ShardKeys
from .._wire.routing import home_shard as routed_home


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
        return [envelope["id"] for envelope in envelopes(self.raw)[0]]


@dataclass(frozen=True, slots=True)
class Replayed:
    """One op appended again: where, and whether it had an outcome already (then it will not
    run: the worker answers with that outcome)."""

    op_id: str
    shard: int
    entry: str
    had_outcome: bool


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _letter(shard: int, letter_id: bytes | str, fields: Any) -> DeadLetter:
    if isinstance(fields, list):  # a RESP flat list of field, value
        fields = dict(zip(fields[::2], fields[1::2], strict=True))
    got = {_text(name): _text(value) for name, value in fields.items()}
    return DeadLetter(
        shard, _text(letter_id), got.get("entry", ""), got.get("reason", ""), got.get("raw", "")
    )


async def read(
    backend: Backend,
    namespace: str,
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
        letters = await backend.dead_letters(ShardKeys(namespace, shard), first, last, count)
        found += [_letter(shard, entry_id, fields) for entry_id, fields in letters]
    return found


def envelopes(raw: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The op envelopes in a dead letter's ``raw`` that can be appended again, and why each
    other element cannot."""
    try:
        value = json.loads(raw)
    except ValueError:
        return [], ["raw is not JSON"]
    items: list[Any] = [value]
    if isinstance(value, dict) and "id" not in value and isinstance(value.get("ops"), str):
        try:
            ops = json.loads(value["ops"])  # an unreadable entry's fields
        except ValueError:
            return [], ["the entry's ops are not JSON"]
        items = ops if isinstance(ops, list) else [ops]
    found, skipped = [], []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            skipped.append(f"no op id: {_short(item)}")
        elif item.get("args") == {}:  # cjson writes an empty Lua table as an object
            found.append({**item, "args": []})
        else:
            found.append(item)
    return found, skipped


def _short(item: Any) -> str:
    shown = json.dumps(item)
    return shown if len(shown) <= 60 else shown[:57] + "..."


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
    backend: Backend, namespace: str, shard_count: int, letter: DeadLetter, *, max_backlog: int
) -> tuple[list[Replayed], list[str]]:
    """Append the letter's ops again (one entry per shard they route to); what was appended,
    and what was skipped and why.

    :raises ReplayStopped: when a shard's backlog is full (nothing of that shard appended,
        nor of the shards after it; the ops appended before are in the error).
    """
    found, skipped = envelopes(letter.raw)
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for envelope in found:
        shard = home_shard(envelope, shard_count)
        if shard is None:
            skipped.append(f"op {envelope['id']!r}: no key to route by")
        else:
            by_shard.setdefault(shard, []).append(envelope)
    replayed: list[Replayed] = []
    for shard, ops in sorted(by_shard.items()):
        keys = ShardKeys(namespace, shard)
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
                        keys.wake_channel,
                    ),
                )
            )
        except BacklogRefused as exc:
            raise ReplayStopped(shard, ids, replayed, exc) from exc
        replayed += [
            Replayed(op_id, shard, _text(entry), outcome is not None)
            for op_id, outcome in zip(ids, stored, strict=True)
        ]
    return replayed, skipped


async def drop(backend: Backend, namespace: str, letter: DeadLetter) -> int:
    """Delete one dead letter; 1 if it was there."""
    return int(await backend.drop_dead_letter(ShardKeys(namespace, letter.shard), letter.letter_id))
