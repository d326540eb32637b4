"""Multi-key ops across shards (G4): atomic, isolated, deadlock-free, only involved keys wait.

Fault tests (kill -9, SIGSTOP of coordinator and participants) are in test_cross_shard_faults.py.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as sync_redis
import redis.asyncio

import keyserial
from keyserial import InsufficientFunds
from keyserial._scripts.calls import Script
from keyserial.ledger import balance, deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests import apps
from tests.helpers import (
    check_bank,
    eventually,
    holder_pid,
    keys_on_shard,
    lease_holder,
    lends,
    monitored,
    noted,
    pay_once,
    worker_processes,
)

SHARDS = 16


async def test_transfer_across_shards_is_atomic_refuses_overdrafts_and_is_idempotent(
    redis_url: str, namespace: str
) -> None:
    source, target = keys_on_shard(3, SHARDS, 1, "acct")[0], keys_on_shard(9, SHARDS, 1, "acct")[0]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        await ks.submit(source, deposit(100))
        # Either direction: the home shard is the lower one whichever key comes first.
        assert await ks.transfer(source, target, 30, op_id="t1") == {source: 70, target: 30}
        assert await ks.transfer(target, source, 5) == {target: 25, source: 75}
        with pytest.raises(InsufficientFunds) as refused:
            await ks.transfer(target, source, 26)
        assert (refused.value.balance, refused.value.amount) == (25, 26)
        # Resubmitting an op id returns its stored outcome; the money moves once.
        assert await ks.transfer(source, target, 30, op_id="t1") == {source: 70, target: 30}
        assert await ks.result("t1", key=[source, target]) == {source: 70, target: 30}
        assert [await ks.submit(source, balance()), await ks.submit(target, balance())] == [75, 25]


async def test_an_op_on_three_shards_sees_and_writes_every_key(
    redis_url: str, namespace: str
) -> None:
    keys = [keys_on_shard(shard, SHARDS, 1, "acct")[0] for shard in (12, 2, 7)]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        await ks.submit(keys[0], apps.open_account(50))
        assert await ks.submit_many(keys, apps.pay(20), op_id="split") == 10
        with pytest.raises(InsufficientFunds):
            await ks.submit_many(keys, apps.pay(6), op_id="too-much")
        states = {key: await ks.read(key) for key in keys}
        assert states == {
            keys[0]: {"balance": 10, "ops": ["split"]},
            keys[1]: {"balance": 20, "ops": ["split"]},
            keys[2]: {"balance": 20, "ops": ["split"]},
        }


async def test_random_ops_across_shards_in_both_directions_never_deadlock(
    redis_url: str, namespace: str
) -> None:
    """Overlapping key sets in random orders across shards, each op reading, waiting and
    writing all its keys: all complete, and every key lists exactly the ops that touched it."""
    shards = 8
    keys = [f"acct:{n}" for n in range(10)]
    assert len({keyserial.shard_for(key, shards) for key in keys}) >= 5
    async with (
        running_worker(redis_url, namespace, shard_count=shards, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=shards, namespace=namespace) as ks,
    ):
        rng = random.Random(5)
        plans = [(f"op-{n}", rng.sample(keys, rng.randint(2, 4))) for n in range(80)]
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for op_id, op_keys in plans:
                    group.start_soon(
                        lambda i=op_id, k=op_keys: ks.submit_many(k, apps.slow_move(0.002), op_id=i)
                    )
        for key in keys:
            applied = await ks.read(key) or []
            assert sorted(applied) == sorted(op_id for op_id, k in plans if key in k), key


@pytest.mark.parametrize("owners", ["one worker", "two workers"])
async def test_only_the_involved_keys_wait_while_an_op_waits_on_another_shard(
    redis_url: str, namespace: str, tmp_path: Path, owners: str, request: pytest.FixtureRequest
) -> None:
    """The op holds its key on the home shard and waits for a busy key on a participant shard:
    ops on other keys of both shards complete meanwhile; ops on its keys wait for it. With one
    worker owning both shards (on a standalone server) the participant's key is held in process;
    with two (or on a cluster), through a grant request, queued behind the busy op."""
    home, participant = 1, 5
    held, other_home, met_home = keys_on_shard(home, SHARDS, 3, "h")
    busy, other_participant, met_participant = keys_on_shard(participant, SHARDS, 3, "p")
    note = tmp_path / "busy"
    split = owners == "two workers"
    requested = split or "cluster" in request.node.callspec.id
    async with AsyncExitStack() as stack:
        alone = None
        if split:
            alone = await stack.enter_async_context(
                running_worker(
                    redis_url,
                    namespace,
                    shard_count=SHARDS,
                    apps=["tests.apps"],
                    shards=[participant],
                )
            )
        worker = await stack.enter_async_context(
            running_worker(
                redis_url,
                namespace,
                shard_count=SHARDS,
                apps=["tests.apps"],
                shards=[s for s in range(SHARDS) if s != participant] if split else None,
            )
        )
        ks = await stack.enter_async_context(
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace)
        )
        if split:  # (The workers meet first: a grant request signed by a worker its receiver
            # has not met yet is dropped until its coordinator asks again, a poll later.)
            await ks.submit_many([met_home, met_participant], apps.slow_move(0), op_id="meet")
        done: list[str] = []

        async def run(name: str, op: Any) -> None:
            await op
            done.append(name)

        async with anyio.create_task_group() as group:
            group.start_soon(run, "busy", ks.submit(busy, apps.hold(1.0, str(note))))
            await eventually(lambda: noted(note), message="the participant key is busy")
            group.start_soon(
                run, "move", ks.submit_many([held, busy], apps.slow_move(0), op_id="move")
            )
            await eventually(
                lambda: fetched(redis_url, namespace, home, "move"),
                message="the home shard's owner fetched the op",
            )
            if requested:
                await eventually(
                    lambda: request_queued(alone or worker, participant, "move"),
                    message="the participant's owner queued the grant request behind the busy op",
                )
            group.start_soon(run, "after-move", ks.submit(held, apps.append("after")))
            started = time.monotonic()
            await ks.submit(other_home, apps.append("x"))
            await ks.submit(other_participant, apps.append("y"))
            waited = time.monotonic() - started
            assert done == [], "the uninvolved ops did not wait for the held keys"
        assert waited < 0.5
        assert done == ["busy", "move", "after-move"]
        assert await ks.read(held) == ["move", "after"]
        # (An op, not read(): the participant may commit its part after the caller's reply.)
        assert await ks.submit(busy, apps.peek()) == ["move"]


@pytest.mark.parametrize("owners", ["one worker", "two workers"])
async def test_an_op_on_a_participant_key_waits_for_the_cross_shard_op_holding_it(
    redis_url: str, namespace: str, owners: str, request: pytest.FixtureRequest
) -> None:
    """The op holds its participant key while its body waits (with one worker on a standalone
    server: a hold on a free key, which no chain task runs). An op appended on that key
    meanwhile runs after it, sees its write, and answers."""
    held, participant_key = keys_on_shard(1, SHARDS, 1, "h")[0], keys_on_shard(5, SHARDS, 1, "p")[0]
    split = owners == "two workers"
    cluster = "cluster" in request.node.callspec.id
    # (Through a grant request, on a cluster too: the op holds the participant's key from its
    # grant, recorded in the shard's held hash, until the decision is applied. Between two
    # workers on one server the grant is lent: nothing is recorded, and the participant logs
    # it.)
    requested = cluster
    caplog = request.getfixturevalue("caplog")
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    async with AsyncExitStack() as stack:
        if split:
            await stack.enter_async_context(
                running_worker(
                    redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"], shards=[5]
                )
            )
        await stack.enter_async_context(
            running_worker(
                redis_url,
                namespace,
                shard_count=SHARDS,
                apps=["tests.apps"],
                shards=[s for s in range(SHARDS) if s != 5] if split else None,
            )
        )
        ks = await stack.enter_async_context(
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace)
        )
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(
                    lambda: ks.submit_many(
                        [held, participant_key], apps.slow_move(0.5), op_id="move"
                    )
                )
                await eventually(
                    lambda: fetched(redis_url, namespace, 1, "move"),
                    message="the home shard's owner fetched the op",
                )
                if requested:
                    await eventually(
                        lambda: granted(redis_url, namespace, 5, "move"),
                        message="the participant shard granted its key to the op",
                    )
                elif split:
                    await eventually(
                        lambda: lent(caplog, 5, "move"),
                        message="the participant shard lent its key to the op",
                    )
                after = await ks.submit(participant_key, apps.append("after"))
        assert after == ["move", "after"]
        assert await ks.read(held) == ["move"]


def fetched(url: str, namespace: str, shard: int, op_id: str) -> bool:
    """The shard's owner has fetched the entry that carries ``op_id`` (the horizon passed it)."""
    client = sync_redis.Redis.from_url(url)
    try:
        keys = ShardKeys(namespace, shard)
        horizon = client.get(keys.horizon)
        carrying = [
            entry_id
            for entry_id, fields in client.xrange(keys.stream)
            if f'"id":"{op_id}"'.encode() in fields[b"ops"]
        ]
        return bool(horizon and carrying) and _id(horizon) >= _id(carrying[0])
    finally:
        client.close()


def _id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.decode().partition("-")
    return int(ms), int(seq)


def request_queued(worker: keyserial.Worker, shard: int, op_id: str) -> bool:
    """``worker``'s owner of ``shard`` has taken in a grant request of ``op_id``: it runs it
    as ``<op id>#<attempt>``, behind the ops taken in on its keys before it."""
    runner = worker._owned[shard].runner
    return any(name.startswith(f"{op_id}#") for name in runner._running)


def lent(caplog: pytest.LogCaptureFixture, shard: int, op_id: str) -> bool:
    """The shard's owner has granted keys to an attempt of ``op_id``, as it logs it (a lent
    grant leaves nothing in Redis)."""
    return any(
        record.getMessage().startswith(f"shard {shard} ")
        and f"to {op_id}#" in record.getMessage()
        and "granting keys" in record.getMessage()
        for record in caplog.records
    )


def granted(url: str, namespace: str, shard: int, op_id: str) -> bool:
    """The shard has granted keys to an attempt of ``op_id``: its hold is recorded in the
    shard's held hash (field ``<op id>#<attempt>``), or, once its part is applied, the
    attempt's outcome is in the shard's results."""
    client = sync_redis.Redis.from_url(url)
    try:
        keys = ShardKeys(namespace, shard)
        fields = [
            *client.hkeys(keys.held),
            *client.hkeys(keys.results),
            *client.hkeys(keys.results_old),
        ]
        return any(field.startswith(f"{op_id}#".encode()) for field in fields)
    finally:
        client.close()


@pytest.mark.slow
async def test_bank_two_workers_32_clients_money_conserved_each_op_applied_once(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """16 shards, 50 accounts, 2,000 random transfers plus 400 three-key payments (same shard
    and across shards, both directions) from 32 clients, two worker processes sharing the
    shards. At the end: money conserved, no negative balance, each account's log of op ids
    holds exactly the acknowledged payments that touched it, and its balance is what those
    payments imply."""
    accounts = [f"bank:{n}" for n in range(50)]
    opening = 1_000
    rng = random.Random(2026)
    plans: list[tuple[str, list[str], int]] = []
    for n in range(2_400):  # 2,000 two-key transfers and 400 three-key payments, interleaved
        keys = rng.sample(accounts, 3 if n % 6 == 5 else 2)
        plans.append((f"pay-{n}", keys, rng.randint(1, 400)))
    cross = sum(len({keyserial.shard_for(k, SHARDS) for k in keys}) > 1 for _, keys, _ in plans)
    assert cross > 1_800 and len(plans) - cross > 50, "both kinds of op are exercised"

    outcomes: dict[str, str] = {}
    with worker_processes(tmp_path) as start, anyio.fail_after(240):
        start(redis_url, namespace, shards="0-11", shard_count=SHARDS, lease_ttl=2.0)
        start(redis_url, namespace, shards="4-15", shard_count=SHARDS, lease_ttl=2.0)
        states = await _pay_all(redis_url, namespace, accounts, opening, plans, outcomes, 32)

    assert len(outcomes) == len(plans)
    assert Counter(outcomes.values())["paid"] > 1_000
    check_bank(states, plans, outcomes, opening)


@pytest.mark.slow
async def test_workers_on_uvloop_pay_across_each_other_s_shards_exactly_once(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """``--event-loop uvloop``: two workers splitting the shards, so most payments take the
    grant protocol between them, conserve money and apply each op once."""
    accounts = [f"uv:{n}" for n in range(20)]
    rng = random.Random(42)
    plans = [(f"uv-pay-{n}", rng.sample(accounts, 2), rng.randint(1, 300)) for n in range(300)]
    outcomes: dict[str, str] = {}
    with worker_processes(tmp_path) as start, anyio.fail_after(120):
        workers = [
            start(
                redis_url,
                namespace,
                shards=shards,
                shard_count=SHARDS,
                lease_ttl=2.0,
                extra_args=["--event-loop", "uvloop"],
            )
            for shards in ("0-7", "8-15")
        ]
        states = await _pay_all(redis_url, namespace, accounts, 500, plans, outcomes, 8)
        assert all(f"namespace {namespace!r} on uvloop" in worker.log() for worker in workers)
    assert Counter(outcomes.values())["paid"] > 200
    check_bank(states, plans, outcomes, 500)


async def _pay_all(
    url: str,
    namespace: str,
    accounts: list[str],
    opening: int,
    plans: list[tuple[str, list[str], int]],
    outcomes: dict[str, str],
    callers: int,
) -> dict[str, Any]:
    """Open ``accounts`` with ``opening`` each, then pay ``plans`` from ``callers`` concurrent
    callers, each with a client of its own, noting each op's outcome in ``outcomes``; the
    accounts' final states. (Read through ops, not read(): a participant applies its part just
    after the caller's reply, and an op on the key is ordered after that apply.)"""
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        for account in accounts:
            await ks.submit(account, apps.open_account(opening), timeout=30)

        async def client(mine: list[tuple[str, list[str], int]]) -> None:
            async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as own:
                for op_id, keys, amount in mine:
                    outcomes[op_id] = await pay_once(own, op_id, keys, amount)

        async with anyio.create_task_group() as group:
            for n in range(callers):
                group.start_soon(client, plans[n::callers])
        return {account: await ks.submit(account, apps.peek()) for account in accounts}


async def test_the_decision_record_is_in_the_home_shard_and_expires_with_results(
    redis_url: str, namespace: str
) -> None:
    """Everything a cross-shard op leaves in Redis sits in the results hashes (one hash tag per
    shard, so nothing spans two slots) and is dropped with the results. (Two workers: on a
    cluster a grant between them is recorded, and the participant stores its part's outcome;
    on one server the grant is lent, and the participant stores nothing.)"""
    source, target = keys_on_shard(0, SHARDS, 1, "acct")[0], keys_on_shard(12, SHARDS, 1, "acct")[0]
    home, there = ShardKeys(namespace, 0), ShardKeys(namespace, 12)
    client = redis.asyncio.Redis.from_url(redis_url)

    async def stored(keys: ShardKeys) -> set[bytes]:
        return set(await client.hkeys(keys.results)) | set(await client.hkeys(keys.results_old))

    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, shards="0-7", result_ttl=0.3),
        running_worker(redis_url, namespace, shard_count=SHARDS, shards="8-15", result_ttl=0.3),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        await ks.submit(source, deposit(10))
        await ks.transfer(source, target, 3, op_id="rec")
        try:
            assert {b"rec", b"rec#1#d"} <= await stored(home)  # 1: the home owner's epoch
            part = f"rec#{home.shard}.1".encode()  # (the participant's part of attempt 1)
            if lends(redis_url):
                assert part not in await stored(there)  # (lent: nothing stored there)
            else:
                assert part in await stored(there)  # (its part applied: the hold is gone)
            assert await client.hlen(there.held) == 0
            records = {b"rec", b"rec#1#d", part}
            with anyio.fail_after(10):
                while records & (await stored(home) | await stored(there)):
                    await ks.submit(source, deposit(1))  # steps on both shards rotate results
                    await ks.submit(target, deposit(1))
                    await anyio.sleep(0.1)
        finally:
            await client.aclose()


async def test_an_unknown_or_single_key_op_across_shards_is_refused_with_nothing_held(
    redis_url: str, namespace: str
) -> None:
    first, second = keys_on_shard(2, SHARDS, 1, "k")[0], keys_on_shard(6, SHARDS, 1, "k")[0]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        with pytest.raises(keyserial.UnknownOperation):
            await ks.submit_many([first, second], keyserial.call("teleport"))
        with pytest.raises(keyserial.MalformedOperation, match=r"takes one key"):
            await ks.submit_many([first, second], deposit(1))
        await ks.submit(second, deposit(1))  # the keys were never held
        assert await ks.transfer(second, first, 1) == {second: 0, first: 1}


async def test_a_refusal_across_shards_is_stored_bound_to_its_op(
    redis_url: str, namespace: str
) -> None:
    """A refused cross-shard op stores its refusal as any op does, bound to the op: the same
    op id submitted with another op is refused as taken, never answered with that refusal."""
    first, second = keys_on_shard(2, SHARDS, 1, "k")[0], keys_on_shard(6, SHARDS, 1, "k")[0]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        with pytest.raises(keyserial.MalformedOperation, match=r"takes one key"):
            await ks.submit_many([first, second], deposit(1), op_id="chosen-1")
        with pytest.raises(keyserial.MalformedOperation, match=r"belongs to another op"):
            await ks.submit_many([first, second], deposit(2), op_id="chosen-1")
        with pytest.raises(keyserial.MalformedOperation, match=r"takes one key"):
            await ks.submit_many([first, second], deposit(1), op_id="chosen-1")


#: What the home's owner logs when a participant shard changed hands under its step.
ELSEWHERE = (
    "shard 0: shard 2 changed hands during a cross-shard op of this shard's next step, which"
    " wrote nothing; giving the shard up"
)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["while the op runs", "while the op waits for the key"])
async def test_a_participant_shard_changing_hands_mid_op_lands_the_op_once(
    standalone_server: LocalServer,
    namespace: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    when: str,
) -> None:
    """One worker owns both shards, so the op holds the participant's key in process and
    the home's step commits both shards, fenced by both epochs. If the participant shard changes
    hands while the op runs, that step writes nothing, and the home's owner starts its shard
    again (the op runs again); if it does so while the op waits for the key (behind a slow op),
    the hold is abandoned, and the op asks the participant for a grant like any cross-shard op.
    Either way its effects land once.

    The takeover is made by hand (the participant's lease deleted, its epoch moved on: what a
    takeover and release leave in Redis) because no process fault moves one shard of a worker
    and leaves it the other: a worker renews all its leases together, so a freeze or a kill
    moves them all (test_cross_shard_faults.py covers that)."""
    caplog.set_level(logging.INFO, "keyserial.worker")
    url = standalone_server.url
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    note = tmp_path / "paying"
    async with (
        running_worker(url, namespace, shard_count=4, apps=["tests.apps"], lease_ttl=1.0),
        keyserial.connect(url, shards=4, namespace=namespace) as ks,
    ):
        for account in (source, target):
            await ks.submit(account, apps.open_account(100))
        async with anyio.create_task_group() as group:
            answers: list[Any] = []

            async def pay() -> None:
                answers.append(
                    await ks.submit_many(
                        [source, target], apps.pay(10, 0.5, str(note)), op_id="moved", timeout=20
                    )
                )

            if when == "while the op runs":
                group.start_soon(pay)
                await eventually(lambda: noted(note), message="the op's body started")
            else:
                busy = tmp_path / "busy"
                # Long enough that the worker drops the shard (next lease round, 0.25 s) while
                # the op still waits behind it.
                group.start_soon(ks.submit, target, apps.hold(2.0, str(busy)))
                await eventually(busy.exists, message="the participant's key is busy")
                group.start_soon(pay)
                await eventually(
                    lambda: fetched(url, namespace, 0, "moved"), message="the op fetched"
                )
            # Another owner took shard 2 (and left): its epoch moved on, its lease is gone.
            client = redis.asyncio.Redis.from_url(url)
            participant = ShardKeys(namespace, 2)
            await client.delete(participant.lease)
            await client.incr(participant.epoch)
            await client.aclose()
        assert answers == [90]
        assert await ks.read(source) == {"balance": 90, "ops": ["moved"]}
        assert await ks.submit(target, apps.peek()) == {"balance": 110, "ops": ["moved"]}
    if when == "while the op runs":
        assert ELSEWHERE in caplog.text
        assert len(note.read_text().split()) == 2  # the body ran twice, its effects landed once
    else:
        assert "shard 2 stopped during op moved; asking it for a grant" in caplog.text
        assert len(note.read_text().split()) == 1


async def test_a_sync_op_whose_step_is_fenced_out_by_a_participant_runs_again_in_its_order(
    standalone_server: LocalServer,
    namespace: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sync op on idle keys is held, run and committed by the home's next step with no task.
    Here another owner takes the participant shard over in between (the op's first run does
    that), so the step is fenced out and writes nothing: the home's owner starts its shard again
    from the stream, so the op runs again ahead of an op on its home key appended meanwhile.
    (The takeover is made by hand for the reason the test above gives.)"""
    caplog.set_level(logging.INFO, "keyserial.worker")
    url = standalone_server.url
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    note = tmp_path / "paying"
    participant = ShardKeys(namespace, 2)
    async with (
        running_worker(url, namespace, shard_count=4, apps=["tests.apps"], lease_ttl=1.0),
        keyserial.connect(url, shards=4, namespace=namespace) as ks,
    ):
        for account in (source, target):
            await ks.submit(account, apps.open_account(100))
        answers: list[Any] = []

        async def pay() -> None:
            answers.append(
                await ks.submit_many(
                    [source, target],
                    apps.pay_while_taken_over(
                        10, url, participant.epoch, participant.lease, str(note)
                    ),
                    op_id="moved",
                    timeout=20,
                )
            )

        async with anyio.create_task_group() as group:
            group.start_soon(pay)
            await eventually(lambda: noted(note), message="the op's first run")
            after = await ks.submit(source, apps.peek(), timeout=20)
        assert answers == [90]
        assert after == {"balance": 90, "ops": ["moved"]}, "the later op ran first"
        assert await ks.submit(target, apps.peek()) == {"balance": 110, "ops": ["moved"]}
    assert ELSEWHERE in caplog.text
    assert len(note.read_text().split()) >= 2  # its body ran again; its effects landed once


@pytest.mark.slow
async def test_concurrent_sync_payments_of_one_worker_across_shards_apply_each_once(
    redis_url: str, namespace: str
) -> None:
    """One worker owns every shard, so sync payments on idle keys take no task and commit in
    one script each (on a standalone server); many at once on few accounts, each key is let go
    only once its op's commit has landed: every account logs exactly the payments that touched
    it, and its balance is what they imply."""
    shards, opening = 8, 1_000
    accounts = [keys_on_shard(shard, shards, 1, "acct")[0] for shard in range(shards)]
    rng = random.Random(11)
    plans = [(f"pay-{n}", rng.sample(accounts, 2 + n % 2), rng.randint(1, 300)) for n in range(240)]
    outcomes: dict[str, str] = {}
    async with (
        running_worker(redis_url, namespace, shard_count=shards, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=shards, namespace=namespace) as ks,
    ):
        for account in accounts:
            await ks.submit(account, apps.open_account(opening))

        async def payer(mine: list[tuple[str, list[str], int]]) -> None:
            for op_id, keys, amount in mine:
                try:
                    await ks.submit_many(keys, apps.pay_now(amount), op_id=op_id, timeout=20)
                except InsufficientFunds:
                    outcomes[op_id] = "refused"
                else:
                    outcomes[op_id] = "paid"

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for n in range(24):
                    group.start_soon(payer, plans[n::24])
        states = {account: await ks.submit(account, apps.peek()) for account in accounts}
    assert Counter(outcomes.values())["paid"] > 100
    check_bank(states, plans, outcomes, opening)


async def test_a_grant_request_lost_with_a_dead_owner_is_sent_again_to_the_next_one(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A grant request goes to the worker the participant shard's lease names. Killed -9, that
    worker leaves its lease behind until it expires: the request is published on its channel,
    where nobody listens, and lost. The coordinator's poll must find no grant and ask whoever
    holds the shard then; else the transfer waits for its grant forever."""
    source, target = keys_on_shard(0, 2, 1, "src")[0], keys_on_shard(1, 2, 1, "dst")[0]
    results: list[Any] = []
    with worker_processes(tmp_path) as start:
        async with (
            running_worker(redis_url, namespace, shards=[0], shard_count=2, idle_poll=0.1),
            keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        ):
            await ks.submit(source, deposit(10), timeout=10)
            dead = start(redis_url, namespace, shards="1", shard_count=2, lease_ttl=2.0)
            await eventually(
                lambda: holder_pid(redis_url, namespace, 1) == dead.pid,
                timeout=15,
                message="the doomed worker owning shard 1",
            )
            lease = lease_holder(redis_url, namespace, 1)
            assert lease is not None
            # (A transfer first: the coordinator then knows the owner, and asks with no task.)
            assert await ks.transfer(source, target, 1, timeout=10) == {source: 9, target: 1}
            dead.kill()  # (its lease stands for up to 2 s more)

            async def transfer() -> None:
                results.append(await ks.transfer(source, target, 4, op_id="lost", timeout=30))

            async with anyio.create_task_group() as group:
                async with monitored(redis_url) as commands:
                    group.start_soon(transfer)
                    await eventually(
                        lambda: any(
                            c.startswith(("PUBLISH", "SPUBLISH"))
                            and f":worker:{lease} " in c
                            and '"t":"q","op":"lost"' in c
                            for c in commands
                        ),
                        message="the grant request published to the dead owner",
                    )
                assert not results
                # (Its result_ttl is short: a request sent again must be made again, its age
                # counted from then, not from the first one, lost seconds before.)
                async with running_worker(
                    redis_url, namespace, shards=[1], shard_count=2, result_ttl=1.0
                ):
                    await eventually(lambda: results, timeout=20, message="the transfer's outcome")
                    assert await ks.submit(source, balance(), timeout=10) == 5
                    assert await ks.submit(target, balance(), timeout=10) == 5
    assert results == [{source: 5, target: 5}]


async def test_a_malformed_coordination_message_is_logged_and_ignored(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's coordination channel is a plain Redis channel: whatever arrives there that is
    neither a grant nor a decision notice (not JSON, no kind, a grant missing its fields) is
    logged and dropped, and the worker goes on running cross-shard ops."""
    caplog.set_level(logging.ERROR, "keyserial.worker")
    source, target = keys_on_shard(3, SHARDS, 1, "acct")[0], keys_on_shard(9, SHARDS, 1, "acct")[0]
    garbage = [b"not json", b'{"op": "x"}', b'{"t": "g", "op": "x"}', b'{"t": "d", "op": 1}']
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS) as worker,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            channel = worker._mailbox.channel
            for message in garbage:
                assert await client.publish(channel, message) == 1
        finally:
            await client.aclose()
        await eventually(
            lambda: (
                sum(
                    "malformed coordination message" in record.getMessage()
                    for record in caplog.records
                )
                == len(garbage)
            ),
            message="every malformed message logged",
        )
        await ks.submit(source, deposit(10), timeout=10)
        assert await ks.transfer(source, target, 4, timeout=10) == {source: 6, target: 4}


async def test_signed_grants_and_decisions_are_taken_without_reading_their_records(
    redis_url: str, namespace: str
) -> None:
    """Two workers splitting the shards: once each has met the other's signer, a transfer
    between them reads no grant record and looks up no decision. Each worker takes the message
    the other signed for it as its record (an unsigned one only wakes: see
    tests/security/test_hostile_clients.py). On one server the grant is lent: the participant
    records no hold, and the home's step writes the participant's key (fenced by its owner's
    epoch); on a cluster each hold is recorded. Seen in the server's MONITOR, scripts' commands
    included."""
    source, target = keys_on_shard(3, SHARDS, 1, "acct")[0], keys_on_shard(9, SHARDS, 1, "acct")[0]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, shards=range(8)) as low,
        running_worker(redis_url, namespace, shard_count=SHARDS, shards=range(8, 16)) as high,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        await ks.submit(source, deposit(100))
        await ks.transfer(source, target, 1)  # (each worker meets the other's signer)
        await eventually(
            lambda: all(
                worker._mailbox.verifier.knows(other._pipeliner.signer.signer_id)  # type: ignore[union-attr]
                for worker, other in [(low, high), (high, low)]
            ),
            message="each worker knows the other's signer",
        )
        standalone = lends(redis_url)
        async with monitored(redis_url) as commands:
            for _ in range(5):
                await ks.transfer(source, target, 1)
        assert [await ks.submit(key, balance()) for key in (source, target)] == [94, 6]
        assert [await ks.read(key) for key in (source, target)] == [94, 6]  # (in Redis too)
    resolve_sha = Script.load("resolve").sha
    mine = [command for command in commands if namespace in command]
    holds = 0 if standalone else 5
    assert sum(c.startswith("HSET") and ":held" in c for c in mine) == holds
    assert [c for c in mine if c.startswith(("HGET", "HMGET")) and ":held" in c] == []
    assert [c for c in mine if resolve_sha in c] == []


async def test_a_worker_s_first_grant_request_to_another_waits_for_no_poll(
    redis_url: str, namespace: str
) -> None:
    """A participant that has not read the coordinator's signer listing yet keeps its first
    request and takes it once the listing is read: dropped, it would wait for the coordinator's
    poll (7.5 s here) after every start and takeover of a worker."""
    source, target = keys_on_shard(0, 2, 1, "src")[0], keys_on_shard(1, 2, 1, "dst")[0]
    slow_poll = {"shard_count": 2, "idle_poll": 30.0, "lease_ttl": 60.0}
    async with (
        running_worker(redis_url, namespace, shards=[0], **slow_poll) as coordinator,
        running_worker(redis_url, namespace, shards=[1], **slow_poll) as participant,
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
    ):
        await ks.submit(source, deposit(10), timeout=10)
        signer = coordinator._pipeliner.signer
        assert signer is not None and not participant._mailbox.verifier.knows(signer.signer_id)
        began = time.monotonic()
        assert await ks.transfer(source, target, 4, timeout=10) == {source: 6, target: 4}
        assert time.monotonic() - began < 4.0, "the first request waited for a poll"


async def test_a_held_record_that_is_not_a_grant_of_its_part_holds_nothing_at_takeover(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Only workers write a shard's held hash, so a record there that a new owner cannot read,
    that names no home shard, or that grants another part than its field's is a defect: it is
    logged and holds nothing (held again, its keys would wait for a decision that no
    coordinator ever makes), and the shard serves."""
    caplog.set_level(logging.ERROR, "keyserial.worker")
    key = keys_on_shard(1, 2, 1, "acct")[0]

    def grant(op_id: str, **home: int) -> str:
        return json.dumps(
            {"t": "g", "op": op_id, "a": 1, "s": 1, "st": [[key, None]], "c": "c"} | home
        )

    client = sync_redis.Redis.from_url(redis_url)
    client.hset(
        ShardKeys(namespace, 1).held,
        mapping={
            "bad#0.1": "not json",
            "nohome#0.1": grant("nohome"),
            "other#0.1": grant("else", h=0),
        },
    )
    client.close()
    async with (
        running_worker(redis_url, namespace, shard_count=2),
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
    ):
        assert await ks.submit(key, deposit(5), timeout=10) == 5
    errors = [record.getMessage() for record in caplog.records]
    assert sum("an unreadable hold bad#0.1" in e for e in errors) == 1, errors
    assert sum("is not a grant of that part" in e for e in errors) == 2, errors
