"""Typed calls of the scripts anyone may run on a shard, owner or not: ``submit`` (clients, a
dead letter's replay, a coordinator's grant request) and ``status`` (operators).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._wire.layout import ShardKeys
from .calls import Script, ScriptArgs, ScriptCall, pairs, script_args, text


@script_args("submit")
class SubmitArgs(ScriptArgs):
    """One entry of packed ops to append; the script refuses it with ``BacklogRefused``."""

    #: Entries past progress at most (0: unbounded).
    max_backlog: int
    wire_version: str
    #: The entry's ops: a JSON array of op envelopes.
    ops: str
    #: The shard's wake channel, or '' (a worker appending to a shard it owns wakes it itself).
    wake_channel: str
    #: Every op id in the entry is appended for the first time: its owner looks none up, and the
    #: entry travels to it in its wake-up (a push).
    fresh: bool = False
    #: Append even to a shard a reshard sealed: a grant request of an op appended before it.
    past_seal: bool = False


def _entry_id(reply: bytes) -> bytes:
    return reply


def submit(shard: ShardKeys, args: SubmitArgs) -> ScriptCall[bytes]:
    """Append one entry of packed ops to the shard's stream; its entry id."""
    return args.call([shard.stream], _entry_id)


@dataclass(frozen=True, slots=True)
class StatusReply:
    """One shard at one moment, as ``status.lua`` reads it (the server's clock)."""

    #: The lease's value (its holder's ``<token>.<public key>``: see ``_operator.status.Owner``),
    #: or None.
    owner: str | None
    #: Until the lease expires, if it is held.
    lease_ms: int | None
    epoch: int | None
    #: Stream entries past progress (committed ones behind an uncommitted one included).
    backlog: int
    #: The first entry past progress, if any.
    oldest_entry: str | None
    dead_letters: int
    #: Results in the current generation.
    results: int
    #: When the current results generation began ('' if none has).
    results_since: str
    time_ms: int
    #: The keys an operator paused on the shard, each with when it was paused (ms since the
    #: epoch; None for a record that does not say), longest paused first.
    paused: tuple[tuple[str, int | None], ...] = ()


STATUS = Script.load("status")


def _status_reply(reply: list[Any]) -> StatusReply:
    *fields, paused = reply
    token, pttl, epoch, _, backlog, oldest, dead, results, since, secs, micros = map(text, fields)
    return StatusReply(
        owner=token or None,
        lease_ms=int(pttl) if token and int(pttl) >= 0 else None,
        epoch=int(epoch) if epoch else None,
        backlog=int(backlog),
        oldest_entry=oldest or None,
        dead_letters=int(dead),
        results=int(results),
        results_since=since,
        time_ms=int(secs) * 1000 + int(micros) // 1000,
        paused=_paused(paused),
    )


def _paused(flat: list[Any]) -> tuple[tuple[str, int | None], ...]:
    """The paused hash's keys with their pause times (``{"at": ms}``), longest paused first
    (a record without a time last)."""
    found = [(_key(key), _paused_at(record)) for key, record in pairs(flat)]
    return tuple(sorted(found, key=lambda item: (item[1] is None, item[1] or 0, item[0])))


def _key(key: Any) -> str:
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


def _paused_at(record: Any) -> int | None:
    try:
        at = json.loads(record)["at"]
    except (ValueError, TypeError, KeyError):
        return None
    return at if type(at) is int else None


def status(shard: ShardKeys) -> ScriptCall[StatusReply]:
    """Read the shard's health in one snapshot; writes nothing."""
    k = shard
    keys = [k.lease, k.epoch, k.progress, k.stream, k.dead, k.results, k.results_since, k.paused]
    return ScriptCall(STATUS, keys, [], _status_reply)
