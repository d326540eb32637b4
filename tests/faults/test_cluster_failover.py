"""A real 3-master / 3-replica Redis Cluster with one master paused past its failover.

One worker process serves every shard and a client submits to keys on every master while the
master of the second slot range is stopped (SIGSTOP) until its replica has been promoted, then
resumed (it comes back stale and rejoins as a replica). The master of slot 0 is left alone: it is
the node both redis-py cluster clients subscribe through, a separate concern.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import redis
from anyio.abc import TaskGroup
from redis.crc import key_slot

import keyserial
from keyserial import KeyserialError, Settings
from keyserial.testing import LocalCluster, LocalServer, ShardKeys
from tests import apps
from tests.helpers import WorkerProcess, eventually, keys_on_shard

# A 3-master / 3-replica cluster per test, and failovers.
pytestmark = pytest.mark.slow

SHARDS = 6
LEASE_TTL = 1.0
#: How long an op on a healthy master may take while another master is paused.
HEALTHY_REPLY = 3.0


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(node_timeout_ms=1500) as cluster:
        yield cluster


@dataclass
class Placement:
    """Which shards live on the paused master and which on the healthy ones."""

    victim: LocalServer
    stalled: list[int]
    healthy: list[int]


def placement(cluster: LocalCluster, namespace: str) -> Placement:
    first, _ = cluster.ranges[1]
    victim = cluster.master_of(first)
    assert victim is not None
    on_victim = [
        shard
        for shard in range(SHARDS)
        if cluster.master_of(key_slot(ShardKeys(namespace, shard).tag.encode())) is victim
    ]
    healthy = [shard for shard in range(SHARDS) if shard not in on_victim]
    assert on_victim and healthy, f"namespace {namespace!r} puts no shard on one side"
    return Placement(victim, on_victim, healthy)


@dataclass
class Traffic:
    """Appends submitted in a loop per shard; what each learned."""

    acknowledged: dict[str, list[str]] = field(default_factory=dict)  # key -> tags
    failed: list[tuple[int, float, str]] = field(default_factory=list)  # shard, at, error
    during_pause: dict[int, int] = field(default_factory=dict)  # shard -> acks
    paused_at: float | None = None
    resumed_at: float | None = None

    def in_pause(self, began: float) -> bool:
        return (
            self.paused_at is not None
            and began >= self.paused_at
            and (self.resumed_at is None or began < self.resumed_at)
        )


async def submit_loop(
    ks: keyserial.Client, shard: int, traffic: Traffic, stop: anyio.Event, timeout: float
) -> None:
    key = keys_on_shard(shard, SHARDS, 1, "acct")[0]
    traffic.acknowledged.setdefault(key, [])
    number = 0
    while not stop.is_set():
        number += 1
        tag = f"{shard}-{number}"
        began = time.monotonic()
        try:
            await ks.submit(key, apps.append(tag), op_id=tag, timeout=timeout)
        except KeyserialError as error:
            traffic.failed.append(
                (
                    shard,
                    round(began - (traffic.paused_at or began), 2),
                    f"{type(error).__name__}: {error}"[:200],
                )
            )
            continue
        traffic.acknowledged[key].append(tag)
        if traffic.in_pause(began):
            traffic.during_pause[shard] = traffic.during_pause.get(shard, 0) + 1
        await anyio.sleep(0.05)


async def pause_past_failover(cluster: LocalCluster, victim: LocalServer, traffic: Traffic) -> None:
    """SIGSTOP the victim until another node serves its slots, plus a second; then SIGCONT
    and wait until the cluster is whole again (the victim a replica in sync)."""
    first = next(low for low, high in cluster.ranges if cluster.master_of(low) is victim)
    others = [node for node in cluster.nodes if node is not victim]
    traffic.paused_at = time.monotonic()
    cluster.pause(victim)
    with anyio.fail_after(20):
        while cluster.master_of(first, asking=others) in (victim, None):
            await anyio.sleep(0.1)
    await anyio.sleep(1.0)
    cluster.resume(victim)
    traffic.resumed_at = time.monotonic()
    await anyio.to_thread.run_sync(cluster.wait_healthy, 30)


async def run_failover(
    cluster: LocalCluster, start: Callable[..., WorkerProcess], namespace: str, **settings: Any
) -> tuple[Placement, Traffic, WorkerProcess]:
    where = placement(cluster, namespace)
    worker = start(
        cluster.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=LEASE_TTL
    )
    traffic = Traffic()
    async with keyserial.connect(cluster.url, shards=SHARDS, namespace=namespace, **settings) as ks:
        for shard in range(SHARDS):  # every shard owned and answering before the fault
            await ks.submit(
                keys_on_shard(shard, SHARDS, 1, "warm")[0], apps.append("w"), timeout=20
            )
        stop = anyio.Event()
        async with anyio.create_task_group() as group:
            for shard in range(SHARDS):
                timeout = HEALTHY_REPLY if shard in where.healthy else 10.0
                group.start_soon(submit_loop, ks, shard, traffic, stop, timeout)
            await anyio.sleep(0.5)
            await pause_past_failover(cluster, where.victim, traffic)
            await anyio.sleep(1.0)
            stop.set()
    return where, traffic, worker


async def test_a_paused_master_stalls_only_the_shards_it_serves(
    cluster: LocalCluster, start: Callable[..., WorkerProcess]
) -> None:
    where, traffic, worker = await run_failover(cluster, start, "failover-live")
    healthy_failures = [failure for failure in traffic.failed if failure[0] in where.healthy]
    assert not healthy_failures, (
        f"ops on healthy masters' shards {where.healthy} failed during the pause of"
        f" {where.victim.port} (shard, seconds after the pause, error): {healthy_failures};"
        f" worker log: {worker.log()[-3000:]}"
    )
    starved = [shard for shard in where.healthy if traffic.during_pause.get(shard, 0) < 3]
    assert not starved, (
        f"healthy shards {starved} committed < 3 ops during the pause: {traffic.during_pause}"
    )


def durable_settings() -> dict[str, Any]:
    try:
        Settings(durable_replicas=1)  # type: ignore[call-arg]
    except TypeError:
        pytest.skip(
            "Settings has no durable_replicas yet (the durability setting): this test"
            " runs once it lands"
        )
    return {"durable_replicas": 1}


async def test_with_durable_replicas_no_acknowledged_op_is_lost_in_a_failover(
    cluster: LocalCluster, start: Callable[..., WorkerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = durable_settings()
    monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")  # the worker process's setting
    _, traffic, _ = await run_failover(cluster, start, "failover-durable", **settings)
    async with keyserial.connect(
        cluster.url, shards=SHARDS, namespace="failover-durable", **settings
    ) as ks:
        lost = {}
        for key, tags in traffic.acknowledged.items():
            final = await ks.submit(key, apps.peek(), timeout=20) or []
            missing = [tag for tag in tags if tag not in final]
            if missing:
                lost[key] = missing
    assert sum(map(len, traffic.acknowledged.values())) > 0, "nothing was acknowledged"
    assert not lost, f"acknowledged ops lost in the failover: {lost}"


def stored_on(node: LocalServer, keys: ShardKeys, op_ids: list[str]) -> list[str]:
    with redis.Redis(port=node.port) as client:
        return [op_id for op_id in op_ids if client.hexists(keys.results, op_id)]


def replica_has(replica: LocalServer, keys: ShardKeys, op_id: str) -> bool:
    with redis.Redis(port=replica.port) as client:
        client.execute_command("READONLY")
        return bool(client.hexists(keys.results, op_id))


@dataclass
class CommitsAhead:
    """Six appends to ``key`` that ``master`` commits while its replicas are cut off (paused,
    and their links dropped: what the master had sent before would wait in a paused replica's
    socket and reach it as it resumes), so no WAIT can confirm them; then the master is lost
    for good and a replica without them takes over."""

    cluster: LocalCluster
    master: LocalServer
    keys: ShardKeys
    ks: keyserial.Client
    key: str
    tags: list[str] = field(default_factory=lambda: [f"op-{number}" for number in range(6)])
    acknowledged: list[str] = field(default_factory=list)
    replicas: list[LocalServer] = field(default_factory=list)

    async def committed(self, group: TaskGroup) -> None:
        """Cut the replicas off, submit every append in ``group``, and wait until the master
        has committed them all."""
        self.replicas = self.cluster.cut_off_replicas(self.master)
        for tag in self.tags:
            group.start_soon(self._submit, tag)
        await eventually(
            lambda: len(stored_on(self.master, self.keys, self.tags)) == len(self.tags), timeout=20
        )

    async def master_lost(self) -> LocalServer:
        """Kill the master (none of the appends acknowledged yet); its first replica, resumed,
        takes over at once without them. The new master."""
        assert not self.acknowledged, f"acknowledged with no replica: {self.acknowledged}"
        self.master.kill()
        for replica in self.replicas:
            self.cluster.resume(replica)
        successor = self.replicas[0]
        await anyio.to_thread.run_sync(self.cluster.take_over, successor)
        assert stored_on(successor, self.keys, self.tags) == [], (
            "the new master has the ops already"
        )
        return successor

    async def _submit(self, tag: str) -> None:
        await self.ks.submit(self.key, apps.append(tag), op_id=tag, timeout=60)
        self.acknowledged.append(tag)


async def test_with_durable_replicas_a_master_lost_ahead_of_its_replica_loses_no_ack(
    cluster: LocalCluster,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window durability is for: a master commits ops its stopped replica lacks, then dies
    (kill -9) and the replica takes over. Without the setting those ops were acknowledged and
    are gone; with it none of them was acknowledged before the replica had it, and each submit
    is answered once the op applied (its entry appended again by the client) on the new master."""
    namespace = "failover-lagging"
    where = placement(cluster, namespace)
    shard = where.stalled[0]
    keys = ShardKeys(namespace, shard)
    monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")
    start(cluster.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=LEASE_TTL)
    key = keys_on_shard(shard, SHARDS, 1, "acct")[0]
    async with keyserial.connect(
        cluster.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.3
    ) as ks:
        await ks.submit(key, apps.append("warm"), op_id="warm", timeout=20)
        ahead = CommitsAhead(cluster, where.victim, keys, ks, key)
        async with anyio.create_task_group() as group:
            await ahead.committed(group)
            await ahead.master_lost()
            # The old master restarts empty (no persistence here): back before the takeover, it
            # would still own its slots, and the replica would resync from it and come out
            # empty too. It rejoins as the new master's replica: WAITs can succeed again.
            where.victim.start()
            await anyio.to_thread.run_sync(cluster.wait_healthy, 30)
        final = await ks.submit(key, apps.peek(), timeout=20)
    assert sorted(ahead.acknowledged) == ahead.tags
    assert final[0] == "warm" and sorted(final[1:]) == ahead.tags, f"lost or applied twice: {final}"


async def test_with_durable_replicas_an_owner_never_builds_on_commits_a_failover_lost(
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner whose lease outlives a failover must not go on from its cache: the master
    replied to commits its replicas never got (the WAIT behind them timed out, so no caller was
    answered), then died, and a replica without them took over. The owner's cache still holds
    those commits; building on it, it would apply every such op a second time once its client
    appends it again. An unconfirmed commit breaks the owner's write chain instead: it gives the
    shard up, and the next owner starts from what the new master has."""
    with LocalCluster(replicas=2, node_timeout_ms=1500) as cluster:
        for node in cluster.nodes:
            with redis.Redis(port=node.port) as client:
                # No spare replica may move over to the stripped master, and no replica may
                # elect itself: the successor is the one replica the test promotes (a second
                # one, resumed with it, could otherwise win an election and take the slots).
                client.config_set("cluster-allow-replica-migration", "no")
                client.config_set("cluster-replica-no-failover", "yes")
        namespace = "failover-built-on"
        where = placement(cluster, namespace)
        shard = where.stalled[0]
        keys = ShardKeys(namespace, shard)
        monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")
        # A lease longer than the failover: the owner keeps the shard across it.
        worker = start(
            cluster.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=8.0
        )
        key = keys_on_shard(shard, SHARDS, 1, "acct")[0]
        async with keyserial.connect(
            cluster.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.3
        ) as ks:
            await ks.submit(key, apps.append("warm"), op_id="warm", timeout=20)
            replicas = cluster.replicas_of(where.victim)
            await eventually(lambda: all(replica_has(each, keys, "warm") for each in replicas))
            ahead = CommitsAhead(cluster, where.victim, keys, ks, key)
            async with anyio.create_task_group() as group:
                await ahead.committed(group)
                # The master's replies, each with a WAIT that timed out, reached the owner.
                await eventually(lambda: "not confirmed" in worker.log(), timeout=20)
                successor = await ahead.master_lost()  # for good
            final = await ks.submit(key, apps.peek(), timeout=20)
        # Each op has its outcome where the shard lives now: a resubmit returns it, not a run.
        assert stored_on(successor, keys, ahead.tags) == ahead.tags, (
            "ops acknowledged with no stored outcome"
        )
    assert sorted(ahead.acknowledged) == ahead.tags
    assert final[0] == "warm" and sorted(final[1:]) == ahead.tags, f"lost or applied twice: {final}"


#: Polls this slow leave pub/sub alone to wake owners and answer callers within a few seconds.
SLOW_POLL = "30"


async def test_shard_messages_follow_the_nodes_through_a_failover(
    cluster: LocalCluster, start: Callable[..., WorkerProcess]
) -> None:
    """Sharded pub/sub on 3 masters: wake-ups and replies travel on shard channels, subscribed
    on the master of each shard's slot, and after a master fails over to its replica they are
    subscribed on the new master. With polls of 30 s, only those messages can wake the owners
    and answer the callers within seconds, before and after the failover; two workers split
    the shards, so transfers between them take the grant path (coordination channels)."""
    namespace = "sharded-failover"
    where = placement(cluster, namespace)
    env = {"KEYSERIAL_IDLE_POLL": SLOW_POLL}
    for shards in ("0-2", "3-5"):
        start(
            cluster.url, namespace, shards=shards, shard_count=SHARDS, lease_ttl=LEASE_TTL, env=env
        )
    accounts = [keys_on_shard(shard, SHARDS, 1, "acct")[0] for shard in range(SHARDS)]
    async with keyserial.connect(
        cluster.url, shards=SHARDS, namespace=namespace, idle_poll=float(SLOW_POLL)
    ) as ks:
        for account in accounts:  # every shard owned and answering (the first may wait a lease)
            await ks.submit(account, keyserial.call("deposit", 100), timeout=20)
        subscribed = _shard_subscribers(cluster, ks._reply_for(ks.layout.keys(where.stalled[0])))
        assert subscribed == 1, "the client's reply channel of the shard is a shard channel"

        async def every_shard_answers_at_once() -> None:
            for account in accounts:
                with anyio.fail_after(3):
                    await ks.submit(account, keyserial.call("deposit", 1), timeout=3)
            for source, target in zip(accounts, accounts[3:], strict=False):  # across workers
                with anyio.fail_after(3):
                    await ks.transfer(source, target, 1, timeout=3)

        await every_shard_answers_at_once()
        # (Without durable_replicas a failover may lose acknowledged writes the replica had not
        # received yet: this test is about messages, so the sum must not depend on that race.)
        await _replicated(where.victim)
        await pause_past_failover(cluster, where.victim, Traffic())
        with anyio.fail_after(30):  # (the paused master's shards: their leases are taken again)
            for shard in where.stalled:
                await ks.submit(accounts[shard], keyserial.call("balance"), timeout=30)
        await every_shard_answers_at_once()
        balances = [await ks.read(account) for account in accounts]
    assert sum(balances) == SHARDS * 102, balances


async def _replicated(master: LocalServer) -> None:
    """Until every replica of ``master`` has received all it wrote."""
    with redis.Redis(port=master.port) as client, anyio.fail_after(10):
        while True:
            info = client.info("replication")
            offsets = [
                value["offset"]
                for name, value in info.items()
                if name.startswith("slave") and isinstance(value, dict)
            ]
            if offsets and min(offsets) >= info["master_repl_offset"]:
                return
            await anyio.sleep(0.05)


def _shard_subscribers(cluster: LocalCluster, channel: str) -> int:
    """Subscribers of a shard channel on the master of its slot."""
    master = cluster.master_of(key_slot(channel.encode()))
    assert master is not None
    with redis.Redis(port=master.port) as client:
        _, count = client.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    return int(count)
