"""Cross-shard ops under faults: kill -9 and SIGSTOP of the coordinator and of a participant.

Layout: four shards; the op pays from A (shard 0, its home) to B (shard 1) and C (shard 2).
Worker W0 owns shard 0, W1 shard 1, W2 shards 2-3, and a standby lists all four, so it takes
over whatever a fault frees. After every fault:

* the op ends fully applied (the home stream keeps it, so a successor finishes it): each
  account logs it exactly once and the balances are 80/110/110 (money conserved);
* the caller hears the outcome, or times out and then reads it by op id;
* new ops on A, B and C all complete within two lease TTLs of the fault.

The last tests use one worker that owns every shard: on a standalone server its cross-shard
ops hold keys in process and commit all their shards in one script. They kill it, freeze it,
and restart Redis under it, with an async op (a task per op) and a sync one (idle keys: no task,
the commit queued for the next pipeline).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial.testing import LocalServer, ShardKeys
from tests import apps
from tests.cross_shard_bank import (
    SHARDS,
    TTL,
    A,
    B,
    Bank,
    C,
    bank,
    check_after_fault,
    lost_its_shard,
    standby_took,
)
from tests.helpers import (
    Starter,
    WorkerProcess,
    check_bank,
    eventually,
    freeze,
    freeze_mid_ops,
    keys_on_shard,
    noted,
    pay_once,
    wait_for_log,
)

# Fault injection: kill -9 and SIGSTOP, waiting out leases.
pytestmark = pytest.mark.slow


async def test_coordinator_killed_after_the_first_grant(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    held = tmp_path / "held"
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.ks.submit, C, apps.hold(1.0, str(held)))  # C's grant comes later
        await eventually(held.exists, message="C held")
        group.start_soon(b.pay, 0)
        await eventually(lambda: b.granted(1), message="B granted", timeout=15, interval=0.005)
        assert not await b.granted(2)
        b.w0.kill()
        await check_after_fault(b, b.fault(group))


async def test_coordinator_killed_after_the_decision_record(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """The coordinator dies once its decision is recorded, before any participant learnt it:
    both participants are frozen (within their leases) from the moment the op's body runs. On a
    cluster neither can apply its part until after the kill; on one server the decision's step
    wrote their keys already (their grants were lent). They learn the decision and apply it, or
    take its writes into their caches."""
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.2)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        for participant in (b.w1, b.w2):
            await freeze(participant)
        await eventually(
            lambda: b.recorded(0, "victim#1#d"),
            message="the decision recorded",
            timeout=15,
            interval=0.005,
        )
        b.w0.kill()
        fault_at = b.fault(group)
        for shard, account in ((1, B), (2, C)):  # not yet applied by either participant
            assert not await b.recorded(shard, "victim#0.1")
            assert await b.applied(account) == b.lent  # (lent: written with the decision)
        for participant in (b.w1, b.w2):
            participant.signal(signal.SIGCONT)
        await check_after_fault(b, fault_at)


async def test_coordinator_killed_after_part_of_the_apply(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """On a cluster, B has applied its part and C (frozen) not yet when the coordinator dies.
    On one server the decision's step writes both (their grants were lent), so the kill comes
    after a commit that neither participant has heard of."""
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.3)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        b.w2.signal(signal.SIGSTOP)  # C cannot apply yet
        await eventually(lambda: b.applied(B), message="B applied", timeout=15, interval=0.005)
        assert ("victim" in (await b.ks.read(C))["ops"]) == b.lent
        b.w0.kill()
        fault_at = b.fault(group)
        b.w2.signal(signal.SIGCONT)
        await check_after_fault(b, fault_at)


async def test_participant_killed_while_holding_keys(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.5)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        b.w1.kill()
        fault_at = b.fault(group)
        assert not await b.recorded(1, "victim#0.1"), "B's part was applied before the kill"
        await standby_took(b, 1)
        await check_after_fault(b, fault_at)


async def test_a_participant_s_next_owner_holds_its_keys_again_before_anything_runs(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """The standby that takes B's shard over from a killed participant never runs an op on B
    as it was before the op: on a cluster it finds the op's hold in the shard's held hash and
    holds B again before it runs anything; on one server the grant was lent, and the
    coordinator's step, fenced by the killed owner's epoch, wrote B before the standby took
    over (or is refused, and the op runs again, asking the standby: see the test below). An op
    on B appended after the kill sees the op's part applied."""
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.5)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        assert await b.holds(1, "victim#0.1") != b.lent
        b.w1.kill()
        fault_at = b.fault(group)
        seen = await b.ks.submit(B, apps.peek(), timeout=20)
        assert seen == {"balance": 110, "ops": ["victim"]}, seen
        await check_after_fault(b, fault_at)


@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_participant_that_lost_its_shard_after_a_lent_grant_refuses_the_home_s_step(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """B's owner lends B and is frozen past its lease while the op's body runs; the standby
    takes B's shard over. The home's step, which writes B fenced by the epoch B's grant named,
    is refused as a whole: nothing of the op lands, the home's owner gives its shard up, and
    the op runs again, asking the standby. Paid exactly once; the zombie, resumed, changes
    nothing."""
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 2.5)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        assert await b.granted(1) and await b.granted(2)
        await freeze(b.w1)
        fault_at = b.fault(group)
        await standby_took(b, 1)
        await wait_for_log(
            b.w0, "shard 1 changed hands during a cross-shard op of this shard's next step"
        )
        assert not await b.applied(A) and not await b.applied(B) and not await b.applied(C)
        b.w1.signal(signal.SIGCONT)
        await lost_its_shard(b.w1, 1)
        await check_after_fault(b, fault_at, within=None)
        assert len(b.note.read_text().split()) >= 2, "the op ran once: its step was not refused"


async def test_a_grant_request_waiting_for_busy_keys_dies_with_its_owner_and_is_asked_again(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """B's owner has the payment's grant request waiting behind a busy op on B: nothing of it is
    in Redis until its grant is recorded. Killed then, it takes the request with it; the standby
    takes B over with no hold to restore, so only the coordinator's poll, asking the shard's new
    owner, gets B granted. Paid exactly once."""
    held, gate = tmp_path / "held", tmp_path / "gate"
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        await _meet(b)
        group.start_soon(b.ks.submit, B, apps.gated_hold(str(gate), str(held)))
        await eventually(held.exists, message="B busy on its owner")
        group.start_soon(b.pay, 0)
        await wait_for_log(  # (its request sent to B's owner, and no grant yet)
            b.w0, "no grant of shard 1 for victim#1 yet; asking its owner again", timeout=15
        )
        assert not await b.holds(1, "victim#0.1"), "B is still busy: no grant yet"
        b.w1.kill()
        gate.touch()  # (the standby's rerun of the busy op ends at once)
        fault_at = b.fault(group)
        assert await b.redis.hlen(ShardKeys(b.namespace, 1).held) == 0
        await check_after_fault(b, fault_at)


async def _meet(b: Bank) -> None:
    """A transfer between two other accounts of shards 0 and 1: B's owner meets the signer of
    the coordinator's worker, and then takes its grant requests as they come (one from a worker
    not met yet is dropped until asked again, a poll later)."""
    first, second = (keys_on_shard(shard, SHARDS, 2, "acct")[1] for shard in (0, 1))
    await b.ks.submit_many([first, second], apps.slow_move(0), op_id="meet", timeout=10)


async def test_zombie_coordinator_changes_nothing(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """Frozen mid-op past its lease, the coordinator's successor finishes the op; resumed, the
    zombie finishes its own run of the op body, and none of it lands."""
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.3)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        b.w0.signal(signal.SIGSTOP)
        fault_at = b.fault(group)
        await standby_took(b, 0)
        await eventually(
            lambda: b.recorded(0, "victim"),
            message="the standby finished the op",
            timeout=15,
            interval=0.005,
        )
        b.w0.signal(signal.SIGCONT)
        await lost_its_shard(b.w0, 0)
        await check_after_fault(b, fault_at)
        ran_by = b.note.read_text().split()
        assert ran_by[0] == str(b.w0.pid) and str(b.standby.pid) in ran_by[1:]


async def test_zombie_participant_changes_nothing(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        group.start_soon(b.pay, 0.3)
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        b.w1.signal(signal.SIGSTOP)
        fault_at = b.fault(group)
        await standby_took(b, 1)
        await eventually(
            lambda: b.applied(B), message="the standby applied B's part", timeout=15, interval=0.005
        )
        b.w1.signal(signal.SIGCONT)  # it still holds B's grant and the decision is waiting
        await lost_its_shard(b.w1, 1)
        await check_after_fault(b, fault_at)


@pytest.mark.parametrize("pay", [apps.pay, apps.pay_now], ids=["async", "sync"])
async def test_kill_9_of_a_worker_owning_every_shard_mid_transfers(
    redis_url: str, namespace: str, start: Starter, pay: Any
) -> None:
    """One worker owns all the shards (on a standalone server each cross-shard op commits in
    one script: queued from a task, or, for a sync op on idle keys, with none); killed while
    it has fetched cross-shard payments both ways and not committed them, its standby finishes
    them: each is applied exactly once on every key, and the money adds up."""

    async def kill(owner: WorkerProcess, standby_holds: Callable[[], Awaitable[None]]) -> None:
        owner.kill()
        await standby_holds()

    await owner_fault_mid_payments(redis_url, namespace, start, kill, pay, seed=9)


async def owner_fault_mid_payments(
    url: str,
    namespace: str,
    start: Starter,
    fault: Callable[[WorkerProcess, Callable[[], Awaitable[None]]], Awaitable[None]],
    pay: Any,
    *,
    seed: int,
) -> None:
    """Payments between 8 accounts through a worker owning every shard, with a standby. Once
    some have committed, the owner is frozen at a moment when it has fetched payments it has
    not committed (their entries past progress, no outcome stored), and ``fault(owner,
    standby_holds)`` strikes the frozen owner (``standby_holds()`` returns once the standby
    owns every shard). Then the bank must add up."""
    accounts = [f"acct:{n}" for n in range(8)]
    plans = payment_plans(accounts, seed=seed)
    payments = {op_id for op_id, _, _ in plans}
    unapplied: list[str] = []
    client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
    try:
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            owner, standby = await owner_and_standby(start, client, url, namespace)

            async def standby_holds() -> None:
                await eventually(
                    lambda: all_held_by(client, namespace, standby.pid),
                    message="the standby holds every shard",
                    timeout=15,
                    interval=0.005,
                )

            async def strike() -> None:
                window = await freeze_mid_ops(
                    owner, client, namespace, range(SHARDS), ops=payments.__contains__
                )
                unapplied.extend(
                    op for found in window.values() for op in found.ops if op in payments
                )
                await fault(owner, standby_holds)

            with anyio.fail_after(60):
                outcomes = await pay_through_a_fault(
                    ks, client, namespace, accounts, plans, strike, pay
                )
                await standby_holds()
                states = {account: await ks.submit(account, apps.peek()) for account in accounts}
    finally:
        await client.aclose()
    assert unapplied, "the fault found payments in flight"
    check_bank(states, plans, outcomes, 100)


async def owner_and_standby(
    start: Starter, client: Any, url: str, namespace: str
) -> tuple[WorkerProcess, WorkerProcess]:
    """A worker holding every shard, then a standby listing them all."""
    owner = start(url, namespace, shards="0-3", shard_count=SHARDS, lease_ttl=TTL)
    await eventually(
        lambda: all_held_by(client, namespace, owner.pid),
        message="the owner holds every shard",
        timeout=15,
        interval=0.005,
    )
    standby = start(url, namespace, shards="0-3", shard_count=SHARDS, lease_ttl=TTL)
    await wait_for_log(standby, "serving shards", timeout=15)
    return owner, standby


async def all_held_by(client: Any, namespace: str, pid: int) -> bool:
    """Worker ``pid`` holds the lease of every shard."""
    leases = [await client.get(ShardKeys(namespace, shard).lease) for shard in range(SHARDS)]
    return [int(t.decode().split(":")[1]) if t else None for t in leases] == [pid] * SHARDS


def payment_plans(accounts: list[str], *, seed: int) -> list[tuple[str, list[str], int]]:
    """60 payments between random accounts, both ways; every third pays two others."""
    rng = random.Random(seed)
    return [
        (f"p{n}", rng.sample(accounts, 3 if n % 3 == 0 else 2), rng.randint(1, 30))
        for n in range(60)
    ]


async def pay_through_a_fault(
    ks: keyserial.Client,
    client: Any,
    namespace: str,
    accounts: list[str],
    plans: list[tuple[str, list[str], int]],
    fault: Callable[[], Awaitable[None]],
    pay_op: Any = apps.pay,
    outcomes: dict[str, str] | None = None,
) -> dict[str, str]:
    """Open the accounts with 100 each, submit every payment at once, run ``fault`` once some
    have committed, and return how each one settled (``outcomes``, filled as they do). Each
    payment is submitted once and waited for (see :func:`tests.helpers.submit_once`)."""
    for account in accounts:
        await ks.submit(account, apps.open_account(100), timeout=10)
    outcomes = {} if outcomes is None else outcomes

    async def pay(op_id: str, keys: list[str], amount: int) -> None:
        outcomes[op_id] = await pay_once(
            ks, op_id, keys, amount, pay_op, inspect=(client, namespace)
        )

    async with anyio.create_task_group() as group:
        for op_id, keys, amount in plans:
            group.start_soon(pay, op_id, keys, amount)
        await eventually(
            lambda: ks_results_exist(client, namespace),
            message="payments landing",
            timeout=15,
            interval=0.005,
        )
        await fault()
    assert len(outcomes) == len(plans)
    return outcomes


async def ks_results_exist(client: Any, namespace: str) -> bool:
    """Some payment has committed on some shard (so the kill lands mid-stream)."""
    for shard in range(SHARDS):
        fields = await client.hkeys(ShardKeys(namespace, shard).results)
        if any(field.startswith(b"p") for field in fields):
            return True
    return False


async def test_zombie_worker_owning_every_shard_changes_nothing(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """One worker owns every shard, so (on a standalone server) the op commits all its shards in
    one script. Frozen mid-op past its lease, its standby takes every shard over and finishes the
    op; resumed, the zombie finishes its own run of the body, and its commit is fenced out."""
    note = tmp_path / "paying"
    outcome: list[Any] = []
    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=2)
    try:
        async with keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks:
            owner, standby = await owner_and_standby(start, client, redis_url, namespace)
            for account in (A, B, C):
                await ks.submit(account, apps.open_account(100), timeout=10)

            async def pay() -> None:
                outcome.append(
                    await ks.submit_many(
                        [A, B, C], apps.pay(10, 0.3, str(note)), op_id="victim", timeout=30
                    )
                )

            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    group.start_soon(pay)
                    await eventually(
                        lambda: noted(note), message="the op running with every key held"
                    )
                    owner.signal(signal.SIGSTOP)
                    await eventually(
                        lambda: all_held_by(client, namespace, standby.pid),
                        message="the standby holds every shard",
                        timeout=15,
                        interval=0.005,
                    )
                    owner.signal(signal.SIGCONT)
                await lost_its_shard(owner, 0)
                states = {account: await ks.submit(account, apps.peek()) for account in (A, B, C)}
    finally:
        await client.aclose()
    assert outcome == [80]
    assert states == {
        A: {"balance": 80, "ops": ["victim"]},
        B: {"balance": 110, "ops": ["victim"]},
        C: {"balance": 110, "ops": ["victim"]},
    }
    ran_by = note.read_text().split()
    assert ran_by[0] == str(owner.pid) and str(standby.pid) in ran_by[1:]


async def test_zombie_worker_owning_every_shard_mid_sync_transfers_changes_nothing(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """Frozen past its lease while sync cross-shard payments stream through it (commits queued
    with no task), the owner's standby takes every shard over and finishes them; resumed, the
    zombie's queued commits are fenced out: every payment lands once, and the money adds up."""

    async def past_the_lease(
        owner: WorkerProcess, standby_holds: Callable[[], Awaitable[None]]
    ) -> None:
        await standby_holds()  # the owner stays frozen until then
        owner.signal(signal.SIGCONT)
        await lost_its_shard(owner, 0)

    await owner_fault_mid_payments(
        redis_url, namespace, start, past_the_lease, apps.pay_now, seed=13
    )


@pytest.mark.parametrize("pay", [apps.pay, apps.pay_now], ids=["async", "sync"])
async def test_a_redis_restart_mid_transfers_loses_no_payment_and_applies_none_twice(
    durable_server: LocalServer, namespace: str, start: Starter, pay: Any
) -> None:
    """Redis killed (-9; every write on disk before its reply) and restarted while cross-shard
    payments both ways are in flight through a worker owning every shard: each caller waits
    for its one submit (one refused with Redis down is looked up by op id, and submitted again
    only if it never reached Redis), and every payment lands exactly once on every key."""
    url = durable_server.url
    accounts = [f"acct:{n}" for n in range(8)]
    plans = payment_plans(accounts, seed=11)
    client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
    try:
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            worker = start(url, namespace, shards="0-3", shard_count=SHARDS, lease_ttl=TTL)
            await wait_for_log(worker, "shard 3: acquired", timeout=15)

            outcomes: dict[str, str] = {}

            async def restart_redis() -> None:
                await anyio.to_thread.run_sync(durable_server.kill)
                # Payments the kill caught unanswered: their callers wait on through it.
                assert len(outcomes) < len(plans)
                await anyio.sleep(0.5)
                await anyio.to_thread.run_sync(durable_server.start)

            with anyio.fail_after(90):
                await pay_through_a_fault(
                    ks, client, namespace, accounts, plans, restart_redis, pay, outcomes
                )
                states = {
                    account: await ks.submit(account, apps.peek(), timeout=10)
                    for account in accounts
                }
            assert worker.process.poll() is None, "the worker survived the restart"
    finally:
        await client.aclose()
    check_bank(states, plans, outcomes, 100)
