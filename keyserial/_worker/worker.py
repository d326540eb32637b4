"""A worker process's runtime: own shards through leases, serve each with a :class:`ShardRunner`.

Several workers may list the same shards: one owns each shard, the others stand by and acquire
it when its lease expires (a crash) or is released (a clean shutdown). Leases (``_worker.leases``)
are renewed every ``min(lease_ttl / 4, 0.5 s)``; a shard whose lease cannot be renewed before it
would expire is dropped at once, with its cache. Correctness does not depend on that timing:
every step script checks the epoch before it writes, so a frozen-then-resumed worker can never
write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .._backend import durability as _durability
from .._backend.backend import AnyRedis, Backend
from .._backoff import Backoff
from .._logfields import fields
from .._ops import Registry
from .._scripts.lease import LeaseGrant
from .._settings import Settings
from .._wire.codec import GRANT_OP, parse_push
from .._wire.layout import PAUSES_CHANGED, Layout, shard_name, worker_channel
from .._wire.resharding import LayoutRecord, layout_channel
from .._wire.roster import ROSTER_RENEW, OpSetMismatch, WorkerEntry, live_entries, mismatches
from .._wire.routing import format_shards, parse_shards, scale_shards
from .._wire.signing import SIGNER_RENEW, SIGNER_TTL, ReplySigner, signer_renewed_at
from ..errors import BackendUnavailable, ConfigError, LeaseLost
from ..ledger import LEDGER_OPS
from .activity import POST_EVERY
from .crossshard.mailbox import Mailbox
from .leases import Held, Leases
from .metrics import Metrics
from .pipeline import Pipeliner
from .runner import ShardRunner
from .strays import forward_strays
from .writes import WriteChainBroken

log = logging.getLogger("keyserial.worker")
_PAUSES_CHANGED = PAUSES_CHANGED.encode()


class Worker:
    """Serve ``shards`` of a namespace until :meth:`stop` is called (or the task is cancelled).

    ``apps`` names modules whose ``@keyserial.op`` functions are served besides the built-in
    ledger ops (or besides the ops of ``registry``, which then replaces them, and which the
    apps' ops are added to). ``shards`` is a list or a spec like ``"0-15"``; ``None`` means all
    shards.
    ``metrics_port``: serve Prometheus metrics there while running (docs/metrics.md).
    """

    def __init__(
        self,
        redis: str | AnyRedis,
        *,
        shards: Sequence[int] | str | None = None,
        settings: Settings | None = None,
        apps: Sequence[str] = (),
        registry: Registry | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.registry = registry or Registry(LEDGER_OPS)
        for app in apps:
            self.registry.add_module(app)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._redis = redis
        self._shard_spec = shards
        self._owned: dict[int, Held[ShardRunner]] = {}
        self._mailbox = Mailbox(worker_channel(self.settings.namespace, self.token), self._runner)
        #: What this worker's leases hold: its coordination channel less the namespace's prefix,
        #: ``<token>.<public key>``, so that another worker reads the channel of a shard's owner
        #: off the shard's lease (``_wire.layout.owner_channel``). The roster and the activity
        #: hash name the worker by its plain :attr:`token`.
        self.lease_value = self._mailbox.channel.removeprefix(
            worker_channel(self.settings.namespace, "")
        )
        self._stop = anyio.Event()
        self._record = LayoutRecord(Layout(self.settings.namespace, 0))
        self._started = anyio.Event()
        #: Set by ``stop(at_once=True)``; the drain of a stop under way, to cut short.
        self._at_once = False
        self._draining: anyio.CancelScope | None = None
        self.shards: list[int] = []
        #: The shard list given, as read against the first layout served, and its shard count.
        self._spec_shards: tuple[list[int], int] | None = None
        #: Set by a wake-up on the namespace's layout channel: read the layout record now.
        self._layout_wake = asyncio.Event()
        #: Served over HTTP when ``metrics_port`` is given (0: any free port).
        self.metrics = Metrics(
            self.settings.namespace,
            [*self.registry.names(), GRANT_OP],
            lambda: {shard: holder.runner for shard, holder in self._owned.items()},
            metrics_port,
        )

    @property
    def _layout(self) -> Layout:
        """The layout this worker serves (or, before it connected, generation 0)."""
        return self._record.live

    def stop(self, *, at_once: bool = False) -> None:
        """Finish in-flight work (for at most a lease TTL), release every lease, and return from
        :meth:`run`. ``at_once``: abandon the ops in flight now instead (uncommitted: the next
        owner runs them again, as after a crash); the leases are still released, so it takes
        the shards over at once. (Also while a stop already drains.)"""
        if at_once:
            self._at_once = True
            if self._draining is not None:
                self._draining.cancel()
        self._stop.set()

    @property
    def owned_shards(self) -> list[int]:
        return sorted(self._owned)

    async def wait_started(self) -> None:
        await self._started.wait()

    async def run(self) -> None:
        """Serve until :meth:`stop`; while Redis is unreachable, retry with backoff and resume.

        :raises ConfigError: for a shard list or shard count that does not fit the namespace.
        """
        backend = await self._connect_unless_stopped()
        if backend is None:
            return
        try:
            self.shards = self._resolve_shards(self._layout)  # (a bad spec fails here, first)
            self._pipeliner = Pipeliner(
                backend, self.settings.durability, ReplySigner(), on_batch=self.metrics.pipelined
            )
            async with anyio.create_task_group() as task_group:
                # (Metrics first: a port that cannot be bound stops the worker before it has
                # subscribed or taken a shard.)
                await task_group.start(self.metrics.serve)
                await task_group.start(self._keep_signer_listed, backend)
                task_group.start_soon(self._keep_on_roster, backend)
                task_group.start_soon(self._post_activity, backend)
                task_group.start_soon(self._pipeliner.serve)
                task_group.start_soon(
                    self._mailbox.signers.learn,
                    partial(backend.signer_records, self.settings.namespace),
                    backend.outage,
                )
                record: LayoutRecord | None = self._record
                while record is not None:
                    record = await self._serve_layout(backend, record)
                with contextlib.suppress(Exception):  # (else it drops out when stale)
                    await backend.drop_workers(self.settings.namespace, [self.token])
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await backend.aclose()

    async def _keep_signer_listed(
        self, backend: Backend, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the public key of this worker's reply signer in the namespace's signers hash
        (clients read it there to check the replies it signs), and drop the keys of workers that
        stopped renewing theirs. Started once listed: a participant takes no grant request from
        a signer it cannot find there, so this worker coordinates nothing before."""
        signer = self._pipeliner.signer
        assert signer is not None
        backoff = Backoff(0.1, 5.0)
        while True:
            listed = await _list_signer(backend, self.settings.namespace, signer)
            if listed:
                task_status.started()
                task_status = anyio.TASK_STATUS_IGNORED
                backoff = Backoff(0.1, 5.0)
                await anyio.sleep(SIGNER_RENEW)
            else:
                await backoff.sleep()

    async def _keep_on_roster(self, backend: Backend) -> None:
        """Keep this worker on the namespace's roster (``_wire.roster``), drop the entries of
        workers that stopped renewing theirs, and warn, once each, of a worker that serves some
        of the same shards with another op set."""
        warned: set[OpSetMismatch] = set()
        failing = False
        while True:
            entry = WorkerEntry(
                self.token,
                tuple(self.shards),
                tuple(self.registry.names()),
                time.time(),
                self._layout.generation,
                self.settings.result_ttl,
            )
            try:
                live = await self._renew_roster_entry(backend, entry)
            except Exception as exc:
                if not failing:  # (once per outage: the leases' warnings say the rest)
                    log.warning("listing this worker on the roster: %s (retrying)", exc)
                failing = True
            else:
                failing = False
                for mismatch in set(mismatches(entry, live)) - warned:
                    warned.add(mismatch)
                    log.warning("%s", mismatch.describe())
            await anyio.sleep(ROSTER_RENEW)

    async def _post_activity(self, backend: Backend) -> None:
        """Post what this worker ran lately, for ``keyserial dashboard`` (see ``_activity``)."""
        while True:
            await anyio.sleep(POST_EVERY)
            record = self.metrics.activity.take_record(self.token)
            if record is None:
                continue
            try:
                await backend.post_activity(self.settings.namespace, self.token, record)
            except Exception as exc:  # (an outage: the leases' warnings say it)
                log.debug("posting this worker's activity: %s", exc)

    async def _renew_roster_entry(self, backend: Backend, entry: WorkerEntry) -> list[WorkerEntry]:
        """Write ``entry``, drop the stale ones; the live entries."""
        namespace = self.settings.namespace
        live, dropped = live_entries(
            await backend.list_worker(namespace, self.token, entry.encode())
        )
        if dropped:
            await backend.drop_workers(namespace, dropped)
        return live

    async def _connect_unless_stopped(self) -> Backend | None:
        """:meth:`_connect`, given up (None) as soon as :meth:`stop` is called: a worker told
        to stop while Redis is unreachable has nothing to drain."""
        backend: Backend | None = None
        error: Exception | None = None
        async with anyio.create_task_group() as task_group:

            async def connect() -> None:
                nonlocal backend, error
                try:
                    backend = await self._connect()
                except Exception as exc:  # raised below as it is, not in an exception group
                    error = exc
                task_group.cancel_scope.cancel()

            task_group.start_soon(connect)
            await self._stop.wait()
            task_group.cancel_scope.cancel()
        if error is not None:
            raise error
        return backend

    async def _connect(self) -> Backend:
        """Connect and check the namespace's shard count, retrying with backoff while Redis is
        unreachable or not ready (a restart still loading its data), as a worker should."""
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                backend = await Backend.connect(self._redis)
                try:
                    await backend.ensure_layout(self.settings.namespace, self.settings.shard_count)
                    record = await backend.layout_record(self.settings.namespace)
                    assert record is not None, "ensured just now"
                    self._record = record
                    await _durability.check_durability(backend, self.settings.durability)
                except BaseException:
                    await backend.aclose()
                    raise
                return backend
            except BackendUnavailable as exc:
                log.warning("%s; retrying in %.1fs", exc, backoff.delay)
                await backoff.sleep()

    def _resolve_shards(self, layout: Layout) -> list[int]:
        """The shards of ``layout`` this worker serves: every one without a shard list; else
        the list, read against the first layout the worker served, and after a reshard the
        same fraction of the new layout (:func:`scale_shards`)."""
        if self._shard_spec is None:
            return list(range(layout.shards))
        if self._spec_shards is None:
            self._spec_shards = (self._parse_spec(self._shard_spec, layout.shards), layout.shards)
        chosen, of = self._spec_shards
        return scale_shards(chosen, of, layout.shards)

    def _parse_spec(self, spec: Sequence[int] | str, shard_count: int) -> list[int]:
        if isinstance(spec, str):
            return parse_shards(spec, shard_count)
        if not spec:
            raise ConfigError("shards is empty: name at least one shard, or None for all")
        bad = [
            shard for shard in spec if type(shard) is not int or not 0 <= shard < shard_count
        ]  # (not True, not 1.5)
        if bad:
            raise ConfigError(f"shards {bad!r} are not shards of 0-{shard_count - 1}")
        return sorted(set(spec))

    # -- serving -----------------------------------------------------------------------------

    async def _serve_layout(self, backend: Backend, record: LayoutRecord) -> LayoutRecord | None:
        """Serve this worker's shards of ``record``'s live layout until :meth:`stop` (then
        None), or until a reshard flips the namespace to the next layout (then its record, once
        every shard of this one is drained and released)."""
        self._record = record
        layout = record.live
        self.shards = self._resolve_shards(layout)
        if backend.sharded_pubsub:
            self._mailbox.use_shard_channels(layout)
        log.info(
            "worker %s serving shards %s of %d in namespace %r on %s at %s (ops: %s)",
            self.token,
            format_shards(self.shards) or "none",
            layout.shards,
            self.settings.namespace,
            _event_loop_name(),
            backend.url,
            ", ".join(self.registry.names()),
        )
        async with anyio.create_task_group() as task_group:
            self._leases = Leases(
                backend,
                self.settings,
                layout,
                self.lease_value,
                self.metrics,
                self._owned,
                partial(self._start, backend, record, task_group),
            )
            task_group.start_soon(self._poll, backend)
            await task_group.start(self._listen_for_wakeups, backend)
            task_group.start_soon(self._leases.keep, self.shards, self._stop)
            if record.history:
                task_group.start_soon(
                    forward_strays, backend, self.settings, record, self._owned.__contains__
                )
            self._started.set()
            flipped = await self._until_stopped_or_flipped(backend, layout)
            await self._shut_down()
            task_group.cancel_scope.cancel()
        return flipped

    async def _until_stopped_or_flipped(
        self, backend: Backend, layout: Layout
    ) -> LayoutRecord | None:
        """None once :meth:`stop` is called; the namespace's new layout once a reshard flips it.
        Meanwhile, hand each runner of a shard that a reshard seals its seal."""
        flipped: LayoutRecord | None = None
        async with anyio.create_task_group() as group:

            async def follow() -> None:
                nonlocal flipped
                flipped = await self._follow_layout(backend, layout)
                group.cancel_scope.cancel()

            group.start_soon(follow)
            await self._stop.wait()
            group.cancel_scope.cancel()
        return flipped

    async def _follow_layout(self, backend: Backend, layout: Layout) -> LayoutRecord:
        """Read the namespace's layout record every ``idle_poll`` (at once on a wake-up of its
        channel, which only says to look) until it names another live layout."""
        while True:
            with anyio.move_on_after(self.settings.idle_poll):
                await self._layout_wake.wait()
            self._layout_wake.clear()
            try:
                record = await backend.layout_record(self.settings.namespace)
            except BackendUnavailable:
                continue
            if record is None:
                continue
            if record.live.generation > layout.generation:
                log.info(
                    "namespace %r resharded to %d shards (layout generation %d)",
                    self.settings.namespace,
                    record.live.shards,
                    record.live.generation,
                )
                return record
            if record.move is not None and record.move.source.generation == layout.generation:
                await self._hand_out_seals(backend, layout)

    async def _hand_out_seals(self, backend: Backend, layout: Layout) -> None:
        """Give each runner whose shard a reshard sealed its seal."""
        runners = [held.runner for held in self._owned.values() if not held.runner.sealed]
        if not runners:
            return
        try:
            seals = await backend.seals([runner.keys for runner in runners])
        except BackendUnavailable:
            return
        for runner, seal in zip(runners, seals, strict=True):
            if seal is not None:
                runner.seal(seal)

    def _start(
        self,
        backend: Backend,
        record: LayoutRecord,
        task_group: TaskGroup,
        shard: int,
        grant: LeaseGrant,
        renewed_at: float,
    ) -> None:
        """Serve a shard just acquired."""
        if grant.careful_until and grant.suspect:
            log.warning(
                "shard %d: previous owner died with entries up to %s in flight;"
                " running the suspect op %s alone first",
                shard,
                grant.careful_until,
                grant.suspect,
                extra=fields(shard=shard, epoch=grant.epoch, op_id=grant.suspect),
            )
        elif grant.careful_until:
            log.warning(
                "shard %d: previous owner died with entries up to %s in flight, each of their"
                " ops answered already: none is suspected",
                shard,
                grant.careful_until,
                extra=fields(shard=shard, epoch=grant.epoch),
            )
        if grant.poisoned:
            log.error(
                "shard %d: op %s killed its worker %d times; dead-lettered",
                shard,
                grant.poisoned,
                self.settings.max_strikes,
                extra=fields(shard=shard, epoch=grant.epoch, op_id=grant.poisoned),
            )
        runner = ShardRunner(
            self._pipeliner,
            self.settings,
            self.registry,
            shard=shard,
            layout=record.live,
            history=record.history,
            grant=grant,
            backend=backend,
            mailbox=self._mailbox,
            metrics=self.metrics.acquired(shard, grant),
        )
        holder = self._owned[shard] = Held(runner, renewed_at)
        extra = fields(shard=shard, epoch=grant.epoch)
        # (Named with its layout generation after a reshard: shard 3 of generation 2 is "3@2",
        # whose epochs count from 1 again.)
        name = shard_name(shard, record.live.generation)
        log.info("shard %s: acquired (epoch %d)", name, grant.epoch, extra=extra)
        task_group.start_soon(self._serve, shard, holder)

    async def _serve(self, shard: int, holder: Held[ShardRunner]) -> None:
        try:
            with holder.scope:
                try:
                    await holder.runner.run()
                except* LeaseLost as group:
                    log.warning("shard %d: %s", shard, group.exceptions[0])
                    self._owned.pop(shard, None)
                except* WriteChainBroken as group:
                    # Its cache may hold a write a failover lost: the next owner (perhaps this
                    # worker again) starts from what Redis has. Not the ops' fault: no strike.
                    log.warning(
                        "shard %d: %s; giving the shard up to be taken over from what Redis has",
                        shard,
                        group.exceptions[0],
                    )
                    await self._leases.release([shard], clean=True)
                except* Exception as group:
                    log.error(
                        "shard %d: runner failed; releasing the shard for %gs",
                        shard,
                        self.settings.lease_ttl,
                        exc_info=group,
                    )
                    self._leases.rest(shard)
                    await self._leases.release([shard], clean=False)
        finally:
            holder.done.set()

    async def _poll(self, backend: Backend) -> None:
        """Every ``idle_poll``, have each runner fetch, in case a wake-up was lost; for the
        dormant ones (``ShardRunner.dormant``), look for new entries in their streams first,
        in one pipeline, and wake only those that have some (all of them if Redis does not
        answer: their steps then meet the outage). One timer for the worker: a timeout on every
        sleep cost visibly under spread-out load, and a timer per runner at 1024 shards."""
        pauses: int | None = None
        while True:
            await anyio.sleep(self.settings.idle_poll)
            pauses = await self._follow_pause_count(backend, pauses)
            dormant = []
            for held in list(self._owned.values()):
                if held.runner.dormant:
                    dormant.append(held.runner)
                else:
                    held.runner.entries_waiting()
            if not dormant:
                continue
            try:
                found = await backend.entries_after([(r.keys, r.cursor) for r in dormant])
            except BackendUnavailable:
                found = [True] * len(dormant)
            for runner, has_entries in zip(dormant, found, strict=True):
                if has_entries:
                    runner.entries_waiting()

    async def _follow_pause_count(self, backend: Backend, seen: int | None) -> int | None:
        """The namespace's count of pauses and resumes; if it moved since ``seen``, every
        runner reads its shard's paused keys again (a lost wake-up costs a poll)."""
        try:
            count = await backend.pauses_changed(self.settings.namespace)
        except BackendUnavailable:
            return seen
        if seen is not None and count != seen:
            for held in list(self._owned.values()):
                held.runner.pauses_changed()
        return count

    def _runner(self, shard: int) -> ShardRunner | None:
        holder = self._owned.get(shard)
        return None if holder is None else holder.runner

    async def _listen_for_wakeups(self, backend: Backend, *, task_status: Any) -> None:
        """Wake a shard's runner when its stream gets an entry (runners also poll every
        ``idle_poll`` seconds, so a wake-up lost while reconnecting costs latency, not ops), and
        hand coordination messages (grants, decisions) to the mailbox (whose waiters poll too)."""
        shard_of = {}
        for shard in self.shards:
            keys = self._layout.keys(shard)
            # (Both wake channels: a client of a foreign library may publish on the classic one.)
            shard_of[keys.wake_channel] = shard_of[keys.wake(backend.sharded_pubsub)] = shard
        mailbox = self._mailbox
        layout_changes = layout_channel(self.settings.namespace)

        def receive(channel: str, data: bytes) -> None:
            if mailbox.is_mine(channel):
                mailbox.receive(channel, data)
            elif channel == layout_changes:
                self._layout_wake.set()
            else:
                self._wake_up(shard_of.get(channel, -1), data)

        # Serving starts at once: until the first subscription succeeds (Redis may be going
        # down again right after the worker connected), the runners' polling stands in for it.
        task_status.started()
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                await backend.listen(
                    [*shard_of, *mailbox.channels, layout_changes],
                    receive,
                    health_interval=self.settings.health_interval,
                    on_resubscribed=self._wake_every_runner,
                )
            except BackendUnavailable as exc:
                message = "subscribing to wake-ups: %s; retrying in %.1fs"
                backend.outage.warn(log, message, exc, backoff.delay)
                await backoff.sleep()

    def _wake_up(self, shard: int, data: bytes) -> None:
        """A wake-up on ``shard``'s channel (-1: none of this worker's)."""
        holder = self._owned.get(shard)
        if holder is None and shard >= 0:
            self._leases.try_soon(shard)  # (a standby: its owner may have released it)
        elif holder is not None and data == _PAUSES_CHANGED:
            holder.runner.pauses_changed()
        elif holder is not None:
            pushed = parse_push(data)
            if pushed is None:
                holder.runner.entries_waiting()
            else:
                holder.runner.push(pushed)

    def _wake_every_runner(self) -> None:
        """After a gap in the subscription, whose wake-ups are lost: every owned shard reads
        its stream now, not at its next idle poll."""
        for holder in self._owned.values():
            holder.runner.entries_waiting()

    # -- shutdown ----------------------------------------------------------------------------

    async def _shut_down(self) -> None:
        """Drain every runner (bounded by one lease TTL), then release the leases."""
        holders = dict(self._owned)
        for holder in holders.values():
            holder.runner.stop()
        with anyio.move_on_after(0 if self._at_once else self.settings.lease_ttl) as scope:
            self._draining = scope
            for holder in holders.values():
                await holder.done.wait()
        self._draining = None
        if scope.cancelled_caught:
            log.warning(
                "shutdown: in-flight ops %s; abandoning them (the next owner runs them)",
                "stopped at once"
                if self._at_once
                else f"did not finish in {self.settings.lease_ttl:g}s",
            )
        for holder in holders.values():
            holder.scope.cancel()
        await self._leases.release(
            [s for s in holders if self._owned.get(s) is holders[s]], clean=True
        )
        self._owned.clear()


async def _list_signer(backend: Backend, namespace: str, signer: ReplySigner) -> bool:
    """One renewal of ``signer``'s entry, the stale entries dropped; False if Redis refused or
    did not answer (an outage, OOM: meanwhile clients look outcomes up)."""
    try:
        listed = await backend.list_signer(namespace, signer.signer_id, signer.record())
        stale = [
            field
            for field, record in listed.items()
            if signer_renewed_at(record) < time.time() - SIGNER_TTL
        ]
        if stale:
            await backend.drop_signers(namespace, stale)
    except Exception as exc:
        log.warning("listing this worker's reply signer: %s (retrying)", exc)
        return False
    return True


def _event_loop_name() -> str:
    """The event loop this worker runs on, as ``keyserial worker --event-loop`` names it."""
    loop = type(asyncio.get_running_loop())
    return "uvloop" if loop.__module__.startswith("uvloop") else "asyncio"
