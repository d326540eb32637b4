"""A worker's shard leases, kept in rounds: each round renews the leases the worker holds and tries
to acquire the free shards it serves, in one pipeline per Redis node (each master of a cluster),
so that a node that does not answer holds up the leases of its own shards only. A shard whose
lease could not be renewed before it would expire is dropped at once (its runner cancelled):
another worker may own it by then. Leases are given up when a runner fails, and at shutdown.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._backend import durability as _durability
from .._backend.backend import Backend
from .._backend.commands import publish_command
from .._logfields import fields
from .._scripts.calls import ScriptCall
from .._scripts.lease import (
    AcquireArgs,
    LeaseGrant,
    LeaseHeld,
    ReleaseArgs,
    RenewArgs,
    acquire,
    release,
    renew,
)
from .._settings import Settings
from .._wire.layout import Layout, ShardKeys
from .._wire.routing import format_shards
from ..errors import BackendUnavailable
from .metrics import Metrics

log = logging.getLogger("keyserial.worker")

#: What runs a held shard (the worker's ``ShardRunner``): kept for the worker, never used here.
Runner = TypeVar("Runner")


@dataclass(slots=True, eq=False)
class Held(Generic[Runner]):
    """A shard this worker holds: its runner, when its lease was last renewed, and the scope
    the runner serves in (cancelled once the lease may have run out). The lease rounds renew,
    drop and cancel what they hold without ever looking at its runner, so they do not depend
    on what a runner is."""

    runner: Runner
    renewed_at: float
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: Set once the runner has stopped.
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(slots=True, eq=False)
class Leases(Generic[Runner]):
    """The leases of one worker (its ``token``). ``held`` is the worker's map of the shards it
    holds, which the rounds renew and drop from; ``start(shard, grant, renewed_at)`` is called
    for each shard acquired (and must add it to ``held``)."""

    _backend: Backend
    _settings: Settings
    #: The layout whose shards these leases are of.
    _layout: Layout
    #: What the worker's leases hold: its ``lease_value`` (``<token>.<public key>``, its
    #: coordination channel less the namespace's prefix: see ``_wire.layout.owner_channel``).
    _token: str
    _metrics: Metrics
    _held: dict[int, Held[Runner]]
    _start: Callable[[int, LeaseGrant, float], None]
    #: Shards whose runner failed, and until when this worker leaves them to others.
    _resting: dict[int, float] = field(default_factory=dict, init=False)
    #: Redis nodes whose round is in flight (one at a time per node).
    _rounds: set[str] = field(default_factory=set, init=False)
    #: Shards whose acquire is in flight. Across a failover a shard's lease key moves to
    #: another node, whose round must not try it again while the stuck node's round still
    #: may: both would send the same attempt, and both be answered with its grant.
    _acquiring: set[int] = field(default_factory=set, init=False)
    #: Each shard's acquire attempt whose answer was lost (see ``acquire.lua``).
    _attempts: dict[int, str] = field(default_factory=dict, init=False)
    #: Shards another worker holds, and when their lease runs out unless renewed: they are not
    #: tried before (a standby listing 1024 shards tried each one every round), unless a
    #: wake-up on the shard's channel says something happened there (:meth:`try_soon`).
    _not_before: dict[int, float] = field(default_factory=dict, init=False)

    async def keep(self, shards: Sequence[int], stopping: anyio.Event) -> None:
        """Renew the held leases and try the free ones of ``shards``, until cancelled. Once
        ``stopping`` is set it acquires nothing more, but keeps renewing while a shutdown
        drains, so draining commits are not fenced off."""
        async with anyio.create_task_group() as task_group:
            while True:
                self._round(shards, stopping.is_set(), task_group)
                await anyio.sleep(self._tick)

    @property
    def _tick(self) -> float:
        """How often a round runs: free shards are tried every round."""
        return min(self._settings.lease_ttl / 4, 0.5)

    def _renewal_due(self, held: Held[Runner], now: float) -> bool:
        """Whether a held lease is renewed in this round: every quarter of its TTL (less a
        round, so that no round falls late), not every round: with a long TTL and hundreds of
        shards, renewals were a large part of an idle worker's Redis traffic."""
        return now - held.renewed_at >= max(self._tick, self._settings.lease_ttl / 4 - self._tick)

    def try_soon(self, shard: int) -> None:
        """Something happened on a shard another worker holds (its owner released it, or an op
        was appended and its owner may be gone): try it at the next round."""
        self._not_before.pop(shard, None)

    def rest(self, shard: int) -> None:
        """Leave ``shard`` to other workers for a lease TTL (its runner failed: a bug would
        fail again at once, in a tight loop)."""
        self._resting[shard] = anyio.current_time() + self._settings.lease_ttl

    async def release(self, shards: list[int], *, clean: bool) -> None:
        """Give leases up. ``clean``: a drained shutdown, whose unfinished ops are not to
        blame; otherwise the runner failed, and its first unfinished op takes a strike."""
        calls = []
        for shard in shards:
            calls.append(release(self._keys(shard), ReleaseArgs(self._token, clean)))
            self._held.pop(shard, None)
        if not calls:
            return
        with anyio.CancelScope(shield=True):
            try:
                await self._backend.run_many(calls)
                log.info("released shards %s", format_shards(shards))
                # (A wake-up on each shard's channel: a standby tries it at once, not when the
                # lease it last saw would have run out.)
                sharded = self._backend.sharded_pubsub
                await self._backend.pipeline(
                    [publish_command(self._keys(s).wake(sharded), "released") for s in shards]
                )
            except BackendUnavailable as exc:
                log.warning(
                    "could not release leases (%s); they expire in %gs",
                    exc,
                    self._settings.lease_ttl,
                )

    def _keys(self, shard: int) -> ShardKeys:
        return self._layout.keys(shard)

    def _round(self, shards: Sequence[int], stopping: bool, task_group: TaskGroup) -> None:
        """Start a round for each Redis node whose last round has ended."""
        now = anyio.current_time()
        rounds: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for shard, held in self._held.items():
            if self._renewal_due(held, now):
                rounds[self._backend.node_of(self._keys(shard).lease)][0].append(shard)
        for shard in shards:
            if self._may_acquire(shard, now, stopping):
                rounds[self._backend.node_of(self._keys(shard).lease)][1].append(shard)
        for node, (owned, free) in rounds.items():
            if node not in self._rounds:
                self._rounds.add(node)
                self._acquiring.update(free)
                task_group.start_soon(self._node_round, node, owned, free)

    def _may_acquire(self, shard: int, now: float, stopping: bool) -> bool:
        return not (
            stopping
            or shard in self._held
            or shard in self._acquiring
            or self._resting.get(shard, 0) > now
            or self._not_before.get(shard, 0) > now
        )

    async def _node_round(self, node: str, owned: list[int], free: list[int]) -> None:
        """Renew ``owned`` and try to acquire ``free``, the shards of one node, in one
        pipeline (two when it acquires with ``durable_replicas``: see :meth:`_send_round`)."""
        try:
            sent_at = anyio.current_time()
            ttl = self._settings.lease_ttl
            try:
                # Bounded: a round that outlives a lease TTL is useless, and cancelling it drops
                # whatever connection it was stuck on.
                with anyio.fail_after(ttl):
                    replies, confirmed = await self._send_round(owned, free)
            except (BackendUnavailable, TimeoutError) as exc:
                # (A TimeoutError from fail_after has no message of its own.)
                reason = str(exc) or f"no reply within the lease TTL ({ttl:g}s)"
                self._backend.outage.warn(
                    log,
                    "cannot renew or acquire leases (shards %s): %s",
                    format_shards(sorted([*owned, *free])),
                    reason,
                )
                self._metrics.renew_failed(owned)
                return
            self._renewed(owned, replies, sent_at)
            for shard, reply in zip(free, replies[len(owned) :], strict=True):
                if isinstance(reply, LeaseGrant) and not confirmed:
                    continue  # (its attempt is kept: sent again, it gets the same grant)
                if isinstance(reply, Exception):
                    # "Not now" (a restart LOADING, a BUSY script) is tried again next round.
                    level = (
                        logging.WARNING if isinstance(reply, BackendUnavailable) else logging.ERROR
                    )
                    log.log(level, "acquiring shard %d failed: %s", shard, reply)
                    continue
                self._attempts.pop(shard, None)  # answered: the next acquire is a new attempt
                if isinstance(reply, LeaseHeld):  # someone else's: tried again once it may end
                    self._not_before[shard] = sent_at + max(0, reply.expires_in_ms) / 1000
                    continue
                self._not_before.pop(shard, None)
                # Never a second runner for a shard held: it would share the first one's
                # epoch, and fencing could not tell them apart.
                if shard not in self._held:
                    self._start(shard, reply, sent_at)
        finally:
            self._rounds.discard(node)
            self._acquiring.difference_update(free)
            self._drop_expired(anyio.current_time())

    async def _send_round(self, owned: list[int], free: list[int]) -> tuple[list[Any], bool]:
        """The replies of the renewals of ``owned`` and the acquires of ``free``, in that order,
        and whether the acquires' grants count.

        With ``durable_replicas``, they count only once the replicas have them (a WAIT behind
        the acquires, on their connection, after the renewals so a lagging replica never
        delays those). A failover could lose an epoch bump they lack, and the new master would
        hand the same epoch out again: two runners under one epoch, which fencing cannot tell
        apart. (Renewals need no WAIT: a lost renewal makes the lease end sooner, and the epoch
        fences its holder off.)"""
        renewal = RenewArgs(self._token, self._settings.lease_ttl_ms)
        renewals: list[ScriptCall[Any]] = [renew(self._keys(shard), renewal) for shard in owned]
        acquires = [self._acquire_call(shard) for shard in free]
        durability = self._settings.durability
        if durability is None or not acquires:
            return await self._backend.run_many([*renewals, *acquires]), True
        replies = await self._backend.run_many(renewals) if renewals else []
        granted, confirmed = await _durability.run_confirmed(self._backend, acquires, durability)
        if not confirmed:
            log.warning(
                "acquiring shards %s: not confirmed by the replicas; trying again",
                format_shards(free),
            )
        return [*replies, *granted], confirmed

    def _renewed(self, owned: list[int], replies: list[Any], sent_at: float) -> None:
        for shard, reply in zip(owned, replies, strict=False):
            held = self._held.get(shard)
            if held is None:
                continue
            if isinstance(reply, Exception):
                # An error reply (BUSY, LOADING) says nothing about the lease: it is tried again
                # next round, and dropped only once it may have expired (_drop_expired).
                log.warning("shard %d: renewing the lease: %s", shard, reply)
                self._metrics.renew_failed([shard])
            elif reply:
                held.renewed_at = sent_at
            else:
                self._metrics.renew_failed([shard])
                self._drop(shard, "the lease expired and another worker may own the shard")

    def _acquire_call(self, shard: int) -> ScriptCall[LeaseGrant | LeaseHeld]:
        return acquire(
            self._keys(shard),
            AcquireArgs(
                self._token,
                self._settings.lease_ttl_ms,
                self._settings.max_strikes,
                # Kept until the server answers: a resend after a lost reply is the same attempt.
                self._attempts.setdefault(shard, uuid.uuid4().hex),
            ),
        )

    def _drop_expired(self, now: float) -> None:
        """Stop serving shards whose lease may have run out: someone else may own them now."""
        for shard, held in list(self._held.items()):
            if now - held.renewed_at >= self._settings.lease_ttl * 0.9:
                self._drop(shard, "the lease could not be renewed in time")

    def _drop(self, shard: int, reason: str) -> None:
        held = self._held.pop(shard, None)
        if held is not None:
            log.warning("shard %d: stopping at once: %s", shard, reason, extra=fields(shard=shard))
            held.scope.cancel()
