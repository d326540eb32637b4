"""Typed calls of the scripts anyone may run on a shard, owner or not: ``submit`` (clients, a
dead letter's replay, a forwarded op), ``present`` (clients) and ``status`` (operators).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._wire.layout import ShardKeys
from .calls import Script, ScriptArgs, ScriptCall, pairs, script_args, text


@script_args("submit")
class SubmitArgs(ScriptArgs):
    """One entry of packed ops to push to a shard's inbox; the script refuses it with
    ``BacklogRefused`` or ``ShardSealed``."""

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
    #: When its ops are due, by the server's clock: ``+<ms>`` from now, or ``<ms>`` since the
    #: Unix epoch; '' for now. One due later waits in the shard's timers until then.
    due: str = ""


@dataclass(frozen=True, slots=True)
class Pushed:
    """Where an entry was pushed: its place in the shard's inbox (the entry a signed reply
    names), the server's clock then and how many items were ahead of it (where the client's
    sweep looks for it once it has been moved into the stream: see ``present.lua``), and when
    it is due (None: at once)."""

    place: str
    at_ms: int
    ahead: int
    due_ms: int | None = None

    @property
    def delayed(self) -> bool:
        return self.due_ms is not None and self.due_ms > self.at_ms

    @property
    def since_ms(self) -> int:
        """When it was moved into the stream at the earliest: when it was pushed, or due."""
        return self.due_ms if self.due_ms is not None and self.delayed else self.at_ms


def _pushed(reply: list[int]) -> Pushed:
    if len(reply) == 4:
        place, at_ms, ahead, due_ms = reply
        return Pushed(str(place), at_ms, ahead, due_ms)
    place, at_ms, ahead = reply
    return Pushed(str(place), at_ms, ahead)


def submit(shard: ShardKeys, args: SubmitArgs) -> ScriptCall[Pushed]:
    """Push one entry of packed ops to the shard's inbox; where it went."""
    return args.call([shard.inbox], _pushed)


PRESENT = Script.load("present")


def present(shard: ShardKeys, pushed: Sequence[Pushed]) -> ScriptCall[list[bool]]:
    """Whether each pushed entry is still in the shard's inbox, timers or stream (not lost to
    a failover; one that has committed and left counts as gone too)."""
    args = [value for entry in pushed for value in (entry.place, entry.since_ms, entry.ahead)]
    return ScriptCall(PRESENT, [shard.inbox], args, lambda reply: [bool(found) for found in reply])


@dataclass(frozen=True, slots=True)
class StatusReply:
    """One shard at one moment, as ``status.lua`` reads it (the server's clock)."""

    #: The lease's value (its holder's ``<token>.<public key>``: see ``_operator.status.Owner``),
    #: or None.
    owner: str | None
    #: Until the lease expires, if it is held.
    lease_ms: int | None
    epoch: int | None
    #: Stream entries past progress (committed ones behind an uncommitted one included), and
    #: entries in the inbox not moved into the stream yet.
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
    #: Timers waiting on the shard (delayed ops, and timers ops set), and when the next is due
    #: (ms since the epoch, by the server's clock; None if none waits).
    timers: int = 0
    next_timer_ms: int | None = None


STATUS = Script.load("status")


def _status_reply(reply: list[Any]) -> StatusReply:
    *fields, paused = reply
    token, pttl, epoch, _, backlog, oldest, dead, results, since, secs, micros, timers, due = map(
        text, fields
    )
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
        timers=int(timers),
        next_timer_ms=int(float(due)) if due else None,
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
    keys += [k.inbox, k.timers]
    return ScriptCall(STATUS, keys, [], _status_reply)
