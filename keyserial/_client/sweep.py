"""The client's sweep: outcomes of ops whose reply is overdue (a lost pub/sub message, a
reconnect, a server restart) are looked up where they are stored, so that no waiter depends on
pub/sub alone; an op whose entry a failover lost is appended again.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from .._backend.backend import Backend
from .._scripts.refusals import Refused
from .._settings import Settings
from .._wire.layout import ShardKeys
from ..errors import BackendUnavailable, OutcomeUnknown
from .outcomes import StoredOutcomes
from .pending import Pending

log = logging.getLogger("keyserial.client")


@dataclass(slots=True, eq=False)
class Sweep:
    """Every ``idle_poll`` seconds, settles the ops of ``waiting`` (op id -> its submits) whose
    outcome is stored, and hands those whose entry is gone to ``requeue``; :meth:`run` in a
    task of the client's. :meth:`now` sweeps every waiting op at once (replies may have been
    lost)."""

    _backend: Backend
    _settings: Settings
    _waiting: Mapping[str, list[Pending]]
    _settle: Callable[[str, dict[str, Any] | BaseException], None]
    _outcomes: StoredOutcomes
    _requeue: Callable[[list[Pending]], None]
    #: Set by :meth:`now`; made in :meth:`run` (an event needs the running loop).
    _early: anyio.Event | None = None

    def now(self) -> None:
        """Sweep every waiting op now, not only overdue ones: after the reply subscription was
        lost, replies published meanwhile never arrive."""
        if self._early is not None:
            self._early.set()

    async def run(self) -> None:
        """Fetch stored results for ops whose reply is overdue, until cancelled."""
        interval = self._settings.idle_poll
        self._early = anyio.Event()
        while True:
            with anyio.move_on_after(interval):
                await self._early.wait()
            woken = self._early.is_set()
            self._early = anyio.Event()  # (before the sweep: a call of now() during it counts)
            cutoff = time.monotonic() - (0.0 if woken else interval)
            overdue: dict[ShardKeys, list[str]] = defaultdict(list)
            for op_id, waiters in self._waiting.items():
                if waiters and waiters[0].since < cutoff:
                    overdue[waiters[0].shard].append(op_id)
            failed: dict[ShardKeys, Exception] = {}
            async with anyio.create_task_group() as group:
                for shard, op_ids in overdue.items():
                    group.start_soon(self._sweep_bounded, shard, op_ids, interval, failed)
            if failed:  # one line per sweep, not one per shard
                shard, error = next(iter(failed.items()))
                message = "looking up overdue replies of shards %s: %s"
                shards = ",".join(str(keys.shard) for keys in sorted(failed))
                if isinstance(error, BackendUnavailable):
                    self._backend.outage.warn(log, message, shards, error)
                else:
                    log.warning(message, shards, error)

    async def _sweep_bounded(
        self,
        shard: ShardKeys,
        op_ids: list[str],
        interval: float,
        failed: dict[ShardKeys, Exception],
    ) -> None:
        """:meth:`_sweep_shard`, given up after a few intervals (tried again at the next
        sweep): a node that stalls, or fails over meanwhile, must not hold up the sweep of the
        other shards, nor this shard's next sweep, which may reach its new master."""
        durability = self._settings.durability
        waits = 0.0 if durability is None else 2 * durability.wait_ms / 1000  # (two lookups)
        with anyio.move_on_after(max(3 * interval, 1.0) + waits):
            try:
                await self._sweep_shard(shard, op_ids)
            except (BackendUnavailable, Refused) as exc:
                failed[shard] = exc

    async def _sweep_shard(self, keys: ShardKeys, op_ids: list[str]) -> None:
        """Settle overdue ops whose outcome is stored. Append again those whose entry is gone
        with no outcome: a failover lost it (the op id makes a second append harmless: an op
        that did commit meanwhile is answered from its stored outcome, never run again)."""
        unsettled = await self._outcomes.settle(keys, op_ids)
        unanswered = [
            waiters[0]
            for op_id in unsettled
            if (waiters := self._waiting.get(op_id)) and waiters[0].entry is not None
        ]
        if not unanswered:
            return
        present = await self._backend.entries_present(
            keys, [pending.entry for pending in unanswered if pending.entry is not None]
        )
        gone = {p.op_id: p for p, there in zip(unanswered, present, strict=True) if not there}
        if not gone:
            return
        # Looked up again: the op may have committed, and its entry left the stream, between
        # the first lookup and the check above (an entry leaves only after its outcome is
        # stored, so gone with no outcome now means lost).
        still = await self._outcomes.settle(keys, list(gone))
        lost = [gone[op_id] for op_id in still if not self._expired(gone[op_id])]
        for pending in lost:
            log.warning(
                "op %s: its entry (inbox place %s) is gone with no outcome (a failover?);"
                " appending it again",
                pending.op_id,
                pending.entry.place if pending.entry is not None else "?",
            )
            pending.lost()
        if lost:
            self._requeue(lost)

    def _expired(self, pending: Pending) -> bool:
        """Whether the op waited so long that its outcome may have expired: gone with no
        outcome then no longer means lost, so it fails with ``OutcomeUnknown``. (An outcome is
        stored after its submit began, and kept at least ``result_ttl``.)"""
        waited = time.monotonic() - pending.since
        if waited < self._settings.result_ttl:
            return False
        log.warning(
            "op %s: its entry is gone with no outcome, after %.0fs: not appended again",
            pending.op_id,
            waited,
        )
        self._settle(
            pending.op_id,
            OutcomeUnknown(
                key=pending.key,
                op_id=pending.op_id,
                waited=waited,
                result_ttl=self._settings.result_ttl,
            ),
        )
        return True
