"""A payment from A (shard 0) to B (shard 1) and C (shard 2), one worker on each of their
shards and a standby on all four: the setting of the cross-shard fault tests
(tests/crossshard/test_cross_shard_faults.py, tests/crossshard/test_zombie_writes.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import redis.asyncio

import keyserial
from keyserial import SubmitTimeout
from keyserial._wire.layout import worker_channel
from keyserial._wire.signing import without_signature
from keyserial.testing import ShardKeys
from tests import apps
from tests.helpers import (
    Starter,
    WorkerProcess,
    eventually,
    keys_on_shard,
    lends,
    wait_for_log,
)

SHARDS = 4
#: Every worker's lease TTL: short, so a fault's takeover comes quickly.
TTL = 1.5
A, B, C = (keys_on_shard(shard, SHARDS, 1, "acct")[0] for shard in (0, 1, 2))


@dataclass
class Bank:
    """The setting of one test: its clients, its workers, and what the payment and the probes
    started at the fault saw."""

    url: str
    namespace: str
    ks: keyserial.Client
    redis: Any
    w0: WorkerProcess
    w1: WorkerProcess
    w2: WorkerProcess
    standby: WorkerProcess
    note: Path
    outcome: list[Any] = field(default_factory=list)
    recovered_at: list[float] = field(default_factory=list)
    #: (op id, participant shard) of every grant published on a worker's channel.
    grants: list[tuple[str, int]] = field(default_factory=list)
    #: Whether grants are lent (one server), not recorded (a cluster).
    lent: bool = False

    async def holder(self, shard: int) -> int | None:
        value = await self.redis.get(ShardKeys(self.namespace, shard).lease)
        return int(value.decode().split(":")[1]) if value else None

    async def applied(self, key: str) -> bool:
        """The op under test is in the key's committed log."""
        return "victim" in ((await self.ks.read(key)) or {}).get("ops", [])

    async def recorded(self, shard: int, name: str) -> bool:
        return bool(await self.redis.hexists(ShardKeys(self.namespace, shard).results, name))

    async def holds(self, shard: int, attempt: str) -> bool:
        """Whether ``shard`` holds keys for a cross-shard attempt, by its part id
        (``<op id>#<home>.<attempt>``)."""
        return bool(await self.redis.hexists(ShardKeys(self.namespace, shard).held, attempt))

    async def granted(self, shard: int) -> bool:
        """Whether ``shard`` has granted its keys to the op under test: its hold recorded (a
        cluster), or its lent grant published to the coordinator (one server: nothing is
        recorded)."""
        if self.lent:
            return ("victim", shard) in self.grants
        return await self.holds(shard, "victim#0.1")

    async def pay(self, delay: float) -> None:
        """The op under test: A pays 10 to B and to C (its body notes its pid, then waits)."""
        await self.submit_payment(apps.pay(10, delay, str(self.note)))

    async def submit_payment(self, payment: keyserial.Call[int]) -> None:
        """Submit the op under test (A pays 10 to B and to C) as ``payment``."""
        try:
            value = await self.ks.submit_many([A, B, C], payment, op_id="victim", timeout=30)
        except SubmitTimeout as exc:
            value = exc
        self.outcome.append(value)

    async def probe(self) -> None:
        """Started at the fault: ops on every key of the op; notes when all have completed."""
        async with anyio.create_task_group() as group:
            for account in (A, B, C):
                group.start_soon(self.ks.submit, account, apps.peek())
        self.recovered_at.append(time.monotonic())

    def fault(self, group: Any) -> float:
        """Mark the moment of the fault (and start probing the keys)."""
        group.start_soon(self.probe)
        return time.monotonic()


@asynccontextmanager
async def bank(url: str, namespace: str, start: Starter, tmp_path: Path) -> AsyncIterator[Bank]:
    def worker(shards: str) -> WorkerProcess:
        return start(url, namespace, shards=shards, shard_count=SHARDS, lease_ttl=TTL)

    client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
    try:
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            w0, w1, w2 = worker("0"), worker("1"), worker("2-3")
            expected = [w0.pid, w1.pid, w2.pid, w2.pid]

            async def all_owned() -> bool:
                leases = [ShardKeys(namespace, shard).lease for shard in range(SHARDS)]
                tokens = [await client.get(lease) for lease in leases]
                return [int(t.decode().split(":")[1]) if t else None for t in tokens] == expected

            await eventually(all_owned, message="every shard owned", timeout=15, interval=0.005)
            standby = worker("0-3")
            await wait_for_log(standby, "serving shards", timeout=15)
            the_bank = Bank(url, namespace, ks, client, w0, w1, w2, standby, tmp_path / "paying")
            the_bank.lent = lends(url)
            for account in (A, B, C):
                await ks.submit(account, apps.open_account(100), timeout=10)
            async with anyio.create_task_group() as watching:
                await watching.start(_watch_grants, client, namespace, the_bank.grants)
                with anyio.fail_after(60):
                    yield the_bank
                watching.cancel_scope.cancel()
    finally:
        await client.aclose()


async def _watch_grants(
    client: Any,
    namespace: str,
    grants: list[tuple[str, int]],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Note each grant published on a worker's coordination channel."""
    async with client.pubsub() as pubsub:
        await pubsub.psubscribe(worker_channel(namespace, "*"))
        task_status.started()
        while True:
            got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if got is None:
                continue
            decoded = json.loads(without_signature(got["data"]))
            items = decoded["m"] if decoded.get("t") == "b" else [decoded]
            grants.extend((item["op"], item["s"]) for item in items if item.get("t") == "g")


async def check_after_fault(b: Bank, fault_at: float, *, within: float | None = 2 * TTL) -> None:
    """New ops on every key ``within`` seconds of the fault (None: once the op has run again,
    however long its body takes); the op applied exactly once everywhere; the caller told the
    truth (or timed out and reads it by op id)."""
    await eventually(
        lambda: b.recovered_at and b.outcome, message="the probes and the answer", timeout=20
    )
    recovered = b.recovered_at[0] - fault_at
    if within is not None:
        assert recovered < within, f"keys accepted new ops only {recovered:.2f}s after the fault"
    [answer] = b.outcome
    assert answer == 80 or isinstance(answer, SubmitTimeout), answer
    assert await b.ks.result("victim", key=[A, B, C]) == 80
    # (Through a queued op: read() of a participant may trail the reply, a documented limit.)
    states = {account: await b.ks.submit(account, apps.peek(), timeout=10) for account in (A, B, C)}
    expected = {
        A: {"balance": 80, "ops": ["victim"]},
        B: {"balance": 110, "ops": ["victim"]},
        C: {"balance": 110, "ops": ["victim"]},
    }
    assert states == expected, f"{states} != {expected}"  # (a task group hides pytest's diff)


async def lost_its_shard(worker: WorkerProcess, shard: int) -> None:
    """Wait until a resumed zombie has noticed that it no longer owns ``shard``."""
    await eventually(
        lambda: (
            f"shard {shard}: stopping at once" in worker.log()
            or f"lost the lease on shard {shard}" in worker.log()
        ),
        message=f"worker {worker.pid} noticing it lost shard {shard}",
    )


async def standby_took(b: Bank, shard: int) -> None:
    """Wait until the standby owns ``shard`` (taken over from a faulted owner)."""
    await eventually(
        lambda: _holder_is(b, shard, b.standby),
        message=f"the standby owns shard {shard}",
        timeout=15,
        interval=0.005,
    )


async def _holder_is(b: Bank, shard: int, worker: WorkerProcess) -> bool:
    return await b.holder(shard) == worker.pid
