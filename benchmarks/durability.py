"""Durability's cost: keyserial with ``durable_replicas=1`` (``keyserial-durable``) next to plain
keyserial, in the same suite run, on the same master with the same replica attached.

A replica costs the master work of its own (it streams every write to it), and plain keyserial
pays that too while the replica is attached. Measuring both systems against one master that has
the replica for the whole run leaves the difference between them to what ``durable_replicas``
adds: the barrier write and ``WAIT`` behind each worker pipeline, and the replies held meanwhile.

On the suite's private server the suite starts the replica (and stops it at the end). On a
server of the user's (``--redis``) it uses the replicas it finds; with none online,
``keyserial-durable`` is skipped with the reason (no submit would ever be answered).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
from redis.asyncio import Redis

from keyserial.testing import LocalServer

from .config import DURABLE
from .targets import find

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Replication:
    """The replicas ``keyserial-durable`` runs against, as the suite found them."""

    replicas_online: int
    #: Whether the suite started the (one) replica for its private server.
    started_by_suite: bool
    #: The suite's own replica process (its CPU is counted as the run's, not as noise).
    replica_pid: int | None
    #: Why ``keyserial-durable`` cannot run here (``None``: it can).
    unavailable: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas_online": self.replicas_online,
            "started_by_suite": self.started_by_suite,
            "unavailable": self.unavailable,
        }


async def replicas_online(admin: Redis) -> int:
    """Replicas the master lists as ``online`` (``INFO replication``)."""
    info = await admin.info("replication")
    return sum(
        1
        for name, value in info.items()
        if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )


async def start_replica(master: LocalServer, admin: Redis, timeout: float = 20.0) -> LocalServer:
    """A replica of the private ``master``, returned once both sides say it is in sync."""
    # The master would wait 5 s (the default) for more replicas before its first full sync.
    await admin.config_set("repl-diskless-sync-delay", 0)
    replica = LocalServer(
        binary=master.binary, extra_args=["--replicaof", "127.0.0.1", str(master.port)]
    )
    replica.start()
    try:
        async with Redis(host="127.0.0.1", port=replica.port) as client:
            deadline = time.monotonic() + timeout
            while not await _in_sync(client, admin):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the suite's replica did not sync in {timeout:g} s")
                await anyio.sleep(0.02)
    except BaseException:
        replica.stop()
        raise
    return replica


async def _in_sync(replica: Redis, master: Redis) -> bool:
    link = (await replica.info("replication")).get("master_link_status")
    return link == "up" and await replicas_online(master) >= 1


async def replication(admin: Redis, url: str, replica: LocalServer | None) -> Replication:
    """What ``keyserial-durable`` finds on the server: the suite's replica, or the user's."""
    online = await replicas_online(admin)
    unavailable = None
    if online < 1:
        unavailable = (
            f"needs a replica: {url} has none online, so with durable_replicas=1 no submit"
            " would be answered (run without --redis: the suite starts one)"
        )
    pid = replica.process.pid if replica is not None and replica.process is not None else None
    return Replication(online, replica is not None, pid, unavailable)


def on_cluster() -> Replication:
    """``keyserial-durable`` is not run on a cluster: the suite's replica is a standalone
    server's, and a cluster's replicas belong to its own failover."""
    return Replication(
        0,
        False,
        None,
        "not run on a cluster (the suite attaches its replica to a standalone server only)",
    )


def cost(results: list[Record]) -> list[Record]:
    """Per workload variant where both ran: ``keyserial-durable`` ÷ ``keyserial``, throughput
    and p99 (each system's median round where the workload ran in rounds)."""
    rows = []
    for durable in results:
        if durable["system"] != DURABLE or durable["status"] != "ok":
            continue
        plain = find(results, durable["workload"], "keyserial", **durable["variant"])
        if plain is None or not plain["throughput"] or not plain["latency_ms"]["p99"]:
            continue
        rows.append(
            {
                "workload": durable["workload"],
                "variant": durable["variant"],
                "keyserial": _summary(plain),
                "durable": _summary(durable),
                "throughput_ratio": durable["throughput"] / plain["throughput"],
                "p99_ratio": durable["latency_ms"]["p99"] / plain["latency_ms"]["p99"],
            }
        )
    return rows


def _summary(record: Record) -> Record:
    return {
        "run_id": record["run_id"],
        "throughput": record["throughput"],
        "p99_ms": record["latency_ms"]["p99"],
    }
