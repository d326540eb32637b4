"""Faults of the cluster profiles: a master killed or paused past its failover, a master lost
ahead of its replica that takes over at once, and a worker whose wall clock is off by minutes.
Registered in ``faults.INJECTORS`` like the others.

A node fault targets the master serving one slot range when it fires, and ends only once the
cluster is whole again (the old master a replica in sync), so node faults never overlap: two
masters down at once leave no majority to elect a replica.
"""

from __future__ import annotations

import glob
import signal
import time
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio

from keyserial.testing import LocalCluster, LocalServer

if TYPE_CHECKING:
    from tests.nemesis.cluster_system import ClusterSystem
    from tests.nemesis.faults import Faults
    from tests.nemesis.schedule import FaultEvent

#: Seconds a failover or a rejoin may take before the fault gives up waiting (healing goes on).
_WAIT = 30.0
#: Where Debian's ``libfaketime`` package puts the library (``apt-get install faketime``).
_FAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def faketime_library() -> str | None:
    for pattern in _FAKETIME_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def _cluster_of(faults: Faults) -> ClusterSystem:
    from tests.nemesis.cluster_system import ClusterSystem

    assert isinstance(faults.system, ClusterSystem), "a cluster fault in a cluster run only"
    return faults.system


async def _master(cluster: LocalCluster, slot_range: int) -> tuple[int, LocalServer]:
    first, _ = cluster.ranges[slot_range]
    victim = await anyio.to_thread.run_sync(lambda: cluster.master_of(first))
    if victim is None:
        raise RuntimeError(f"slot range {slot_range} has no master")
    return first, victim


async def _failed_over(
    faults: Faults, cluster: LocalCluster, slot: int, victim: LocalServer
) -> None:
    others = [node for node in cluster.nodes if node is not victim]
    with anyio.move_on_after(_WAIT):
        while True:
            master = await anyio.to_thread.run_sync(lambda: cluster.master_of(slot, asking=others))
            if master not in (None, victim):
                assert master is not None
                faults.note(f"replica {master.port} promoted in place of {victim.port}")
                last = next(end for start, end in cluster.ranges if start == slot)
                faults.promotions.append((time.monotonic(), slot, last))
                return
            await anyio.sleep(0.1)
    faults.note(f"no replica promoted in place of {victim.port} within {_WAIT}s")


async def _whole(faults: Faults, cluster: LocalCluster) -> None:
    try:
        await anyio.to_thread.run_sync(cluster.wait_healthy, _WAIT)
        faults.note("cluster whole again")
    except RuntimeError as error:
        faults.note(f"cluster not whole: {error}")


async def master_kill9(faults: Faults, number: int, event: FaultEvent) -> None:
    """kill -9 a master; after its failover (and ``restart_after``), restart it: it rejoins as
    a replica of the master that took its place."""
    cluster = _cluster_of(faults).cluster
    slot, victim = await _master(cluster, event.params["slot_range"])
    await anyio.to_thread.run_sync(victim.kill)
    faults.note(f"kill -9 master {victim.port} (slot range {event.params['slot_range']})")
    await _failed_over(faults, cluster, slot, victim)
    await anyio.sleep(event.params["restart_after"])
    await anyio.to_thread.run_sync(victim.start)
    faults.note(f"old master {victim.port} restarted")
    await _whole(faults, cluster)


async def master_pause(faults: Faults, number: int, event: FaultEvent) -> None:
    """SIGSTOP a master until its replica is promoted and ``past_failover`` seconds more; then
    SIGCONT: it comes back believing it is a master, stale, until it learns it was replaced."""
    cluster = _cluster_of(faults).cluster
    slot, victim = await _master(cluster, event.params["slot_range"])
    cluster.pause(victim)
    faults.note(f"SIGSTOP master {victim.port} (slot range {event.params['slot_range']})")
    await _failed_over(faults, cluster, slot, victim)
    await anyio.sleep(event.params["past_failover"])
    cluster.resume(victim)
    faults.note(f"SIGCONT old master {victim.port}")
    await _whole(faults, cluster)


async def master_lost_ahead(faults: Faults, number: int, event: FaultEvent) -> None:
    """Lose a master ahead of its replica: the replica is stopped and the master drops its link,
    so for ``lag`` seconds the master commits what no replica gets (its WAITs time out and its
    owners see their commits unconfirmed); then the master is killed, the replica resumes and
    takes over at once (CLUSTER FAILOVER TAKEOVER, within a lease), and the old master is
    restarted ``restart_after`` seconds later: it rejoins as a replica."""
    cluster = _cluster_of(faults).cluster
    slot, victim = await _master(cluster, event.params["slot_range"])
    replicas = await anyio.to_thread.run_sync(cluster.cut_off_replicas, victim)
    replica = replicas[0]
    faults.note(
        f"replica {replica.port} of master {victim.port} stopped and cut off"
        f" (slot range {event.params['slot_range']})"
    )
    await anyio.sleep(event.params["lag"])
    await anyio.to_thread.run_sync(victim.kill)
    for each in replicas:
        cluster.resume(each)
    faults.note(f"kill -9 master {victim.port}; replica {replica.port} told to take over")
    try:
        await anyio.to_thread.run_sync(cluster.take_over, replica, _WAIT)
    except RuntimeError as error:
        faults.note(str(error))
    await _failed_over(faults, cluster, slot, victim)
    await anyio.sleep(event.params["restart_after"])
    await anyio.to_thread.run_sync(victim.start)
    faults.note(f"old master {victim.port} restarted")
    await _whole(faults, cluster)


async def clock_skew(faults: Faults, number: int, event: FaultEvent) -> None:
    """Replace a slot's worker (SIGTERM, a clean stop) by one whose wall clock is off by
    ``skew_minutes`` (libfaketime; monotonic clocks stay true). It serves until the run ends or
    another fault replaces it."""
    library = faketime_library()
    if library is None:
        raise RuntimeError("libfaketime is not installed (apt-get install faketime)")
    system = faults.system
    slot = int(event.target.split(":")[1])
    victim = system.worker(slot)
    system.terminating.add(slot)
    system.ended_by_nemesis.add(victim.pid)
    with suppress(ProcessLookupError):
        victim.signal(signal.SIGTERM)
    with anyio.move_on_after(system.profile.lease_ttl * 3 + 5):
        while victim.process.poll() is None:
            await anyio.sleep(0.05)
    minutes = event.params["skew_minutes"]
    skewed = system.start_worker(
        slot,
        env={
            "LD_PRELOAD": library,
            "FAKETIME": f"{minutes:+d}m",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        },
    )
    faults.note(
        f"{event.target} replaced (pid {victim.pid} -> {skewed.pid}) by a worker whose"
        f" clock is off by {minutes:+d} min"
    )
