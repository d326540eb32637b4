"""Typed calls of the lease scripts: ``acquire``, ``renew`` and ``release`` a shard's lease.

Each call's reply becomes what the worker acts on: a :class:`LeaseGrant` (or :class:`LeaseHeld`),
whether a lease was renewed or released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._wire.layout import ShardKeys
from .._wire.resharding import sealed_key
from .calls import ScriptArgs, ScriptCall, script_args, text


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """What acquiring a shard's lease returned."""

    epoch: int
    progress: str
    careful_until: str | None
    poisoned: str | None
    #: When (ms) the shard's current results generation began; None: none has.
    results_since: int | None
    #: The last entry the previous owner fetched, if it is past progress: up to it, stored
    #: outcomes are looked up before any op runs again (some may have committed).
    replay_until: str | None = None
    #: The op that took a strike when this owner was granted the shard: it runs alone.
    suspect: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseHeld:
    """What acquiring a lease someone else holds returned: how long it lives unless renewed."""

    expires_in_ms: int


@script_args("acquire")
class AcquireArgs(ScriptArgs):
    """Who asks for a shard's lease, for how long, and how many strikes dead-letter an op."""

    token: str
    lease_ttl_ms: int
    max_strikes: int
    #: Unique per attempt, and the same when a call whose reply was lost is sent again.
    attempt: str


def _grant(reply: list[Any]) -> LeaseGrant | LeaseHeld:
    if len(reply) == 1:
        return LeaseHeld(int(reply[0]))  # the lease is someone else's
    epoch, progress, careful, poisoned, results_since, replay, suspect = map(text, reply)
    return LeaseGrant(
        epoch=int(epoch),
        progress=progress,
        careful_until=careful or None,
        poisoned=poisoned or None,
        results_since=int(results_since) if results_since else None,
        replay_until=replay or None,
        suspect=suspect or None,
    )


def acquire(shard: ShardKeys, args: AcquireArgs) -> ScriptCall[LeaseGrant | LeaseHeld]:
    """Take the shard's lease if it is free: the grant, or how long the holder's lives."""
    k = shard
    keys = [
        k.lease,
        k.epoch,
        k.progress,
        k.horizon,
        k.suspect,
        k.stream,
        k.results,
        k.results_old,
        k.dead,
        k.results_since,
        k.handover,
        k.last_grant,
        k.pushes,
        k.inbox,
        k.inbox_taken,
        sealed_key(k),
    ]
    return args.call(keys, _grant)


@script_args("renew")
class RenewArgs(ScriptArgs):
    """Who extends a lease, and by how long."""

    token: str
    lease_ttl_ms: int


def _one(reply: Any) -> bool:
    return bool(reply == 1)


def renew(shard: ShardKeys, args: RenewArgs) -> ScriptCall[bool]:
    """Extend the lease: whether the caller still held it."""
    return args.call([shard.lease], _one)


@script_args("release")
class ReleaseArgs(ScriptArgs):
    """Who gives a lease up, and whether its first unfinished op takes a strike."""

    token: str
    #: A drained shutdown (True), or a failed runner, whose first unfinished op takes a strike.
    clean: bool


def release(shard: ShardKeys, args: ReleaseArgs) -> ScriptCall[bool]:
    """Give the lease up, fencing the caller's late writes out: whether it was the caller's."""
    keys = [
        shard.lease,
        shard.horizon,
        shard.handover,
        shard.pushes,
        shard.stream,
        shard.epoch,
        shard.inbox,
        shard.inbox_taken,
        sealed_key(shard),
    ]
    return args.call(keys, _one)
