"""Cross-shard ops racing a takeover or a lost reply, on a standalone server (where a worker
that owns every shard of an op holds their keys in process and commits them with the home
shard's step, which writes every shard). Each test checks the bank at the end: money
conserved, each op applied once on each of its keys. Each failed on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

import keyserial
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import append_entry, envelope, stored
from tests.helpers import Starter, check_bank, eventually, keys_on_shard
from tests.ownership import inspector, wait_for_holder
from tests.proxy import FaultProxy

pytestmark = [
    pytest.mark.parametrize("redis_url", ["standalone"], indirect=True),
    pytest.mark.slow,  # takeovers that wait out leases
]

SHARDS = 4
OPENING = 100


def payment(op_id: str, keys: list[str], amount: int) -> dict[str, Any]:
    """A ``pay_now`` envelope as the wire format has it: ``keys[0]`` pays each of the others."""
    return {"id": op_id, "keys": keys, "op": "pay_now", "args": [amount]}


async def open_accounts(ks: keyserial.Client, *accounts: str) -> None:
    for account in accounts:
        await ks.submit(account, apps.open_account(OPENING), timeout=10)


async def test_a_participant_takeover_lets_no_in_process_op_overtake_a_replayed_grant(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """X1 (a on shard 0 pays b on shard 2) goes through grants; the owner of shard 2 dies
    after granting b, before applying X1's decision. Its successor also owns shard 1, so X2
    (c on shard 1 pays b) would commit in process; but it must wait until the successor has
    fetched X1's grant request again (a stuck op ahead of it, run alone first, keeps the
    request unscheduled for a lease TTL). Otherwise X2 commits b at once, and X1's replayed
    decision, which carries b's state as X1 computed it before X2, overwrites it (or the other
    way round): one payment to b is lost."""
    ttl = 1.0
    [a], [c], [b, stuck] = (
        keys_on_shard(shard, SHARDS, n, "race") for shard, n in ((0, 1), (1, 1), (2, 2))
    )
    running, paying = tmp_path / "stuck", tmp_path / "paying"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            home = start(redis_url, namespace, shards="0", lease_ttl=ttl)
            participant = start(redis_url, namespace, shards="2", lease_ttl=ttl)
            await wait_for_holder(client, namespace, home.pid, shards=[0], timeout=15)
            await wait_for_holder(client, namespace, participant.pid, shards=[2], timeout=15)
            successor = start(redis_url, namespace, shards="1-2", lease_ttl=ttl)
            await wait_for_holder(client, namespace, successor.pid, shards=[1], timeout=15)
            await open_accounts(ks, a, b, c)
            await append_entry(
                client,
                namespace,
                2,
                [envelope("stuck", stuck, "hold", 3600, str(running))],
                fresh=True,
            )
            await eventually(running.exists, message="the stuck op running")

            answers: dict[str, Any] = {}

            async def pay(op_id: str, keys: list[str], op: Any) -> None:
                answers[op_id] = await ks.submit_many(keys, op, op_id=op_id, timeout=30)

            async with anyio.create_task_group() as group:
                group.start_soon(pay, "x1", [a, b], apps.pay(10, 2 * ttl, str(paying)))
                await eventually(paying.exists, message="x1 running, b granted")
                participant.kill()
                await wait_for_holder(client, namespace, successor.pid, shards=[2], timeout=10)
                group.start_soon(pay, "x2", [c, b], apps.pay_now(10))
            assert answers == {"x1": OPENING - 10, "x2": OPENING - 10}
            states = {account: await ks.read(account) for account in (a, b, c)}
            plans = [("x1", [a, b], 10), ("x2", [c, b], 10)]
            check_bank(states, plans, {"x1": "paid", "x2": "paid"}, OPENING)


async def test_a_lost_reply_of_a_step_writing_two_shards_is_sent_again_not_taken_as_not_written(
    redis_url: str, namespace: str
) -> None:
    """One worker owns both shards. X (a pays b) commits with the home's step, which writes both
    shards, and its reply is lost (the worker's connection is reset after the script ran). Y (b
    pays d, in the same entry) waits for b behind X. The worker must send the step again (the
    script finds X's result and writes nothing) and learn that it landed. Taking the lost reply
    as "not written" releases b with its cached state from before X: Y then commits b without X's
    payment, and X's rerun finds its result and writes nothing."""
    shards = 2
    a, d = keys_on_shard(0, shards, 2, "lost")
    [b] = keys_on_shard(1, shards, 1, "lost")
    results = ShardKeys(namespace, 0).results
    proxy = FaultProxy("worker", int(urlsplit(redis_url).port or 0))
    await proxy.start()
    try:
        with anyio.fail_after(60):
            async with (
                inspector(redis_url) as client,
                keyserial.connect(redis_url, shards=shards, namespace=namespace) as ks,
                running_worker(
                    proxy.url, namespace, shard_count=shards, apps=["tests.apps"], lease_ttl=5.0
                ),
            ):
                await open_accounts(ks, a, b, d)
                # Each byte between the worker and Redis now takes 0.5 s each way: once X's
                # commit has run, its reply is on its way back for that long.
                proxy.delay = 0.5
                await append_entry(
                    client,
                    namespace,
                    0,
                    [payment("x", [a, b], 10), payment("y", [b, d], 5)],
                    fresh=True,
                )
                with anyio.fail_after(10):
                    while not await client.hexists(results, "x"):
                        await anyio.sleep(0.002)
                proxy.reset()  # X's reply (and everything else in flight) is lost
                proxy.heal()
                await eventually(lambda: stored(client, namespace, 0, "y"))
                assert await stored(client, namespace, 0, "x") == {"ok": OPENING - 10}
                assert await stored(client, namespace, 0, "y") == {"ok": OPENING + 10 - 5}
                states = {}
                for account in (a, b, d):
                    raw = await client.hget(
                        ShardKeys(namespace, ks.shard_of(account)).state, account
                    )
                    states[account] = json.loads(raw)
                plans = [("x", [a, b], 10), ("y", [b, d], 5)]
                check_bank(states, plans, {"x": "paid", "y": "paid"}, OPENING)
                # The worker's cache agrees with Redis: the next op on b sees both payments.
                assert await ks.submit_many([b, a], apps.pay_now(1), timeout=10) == 104
    finally:
        await proxy.aclose()


async def test_an_in_process_op_waits_for_a_replay_of_its_keys_earlier_ops(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A new owner replays what its predecessor left (a suspect op first, alone, then an op on
    b); a cross-shard op of another shard of the same worker that touches b, submitted
    meanwhile, holds b only once the replay is over: b's ops apply in the order they came."""
    note, gate = tmp_path / "stuck", tmp_path / "gate"
    [c], [b, stuck] = (keys_on_shard(shard, 4, n, "replay") for shard, n in ((1, 1), (2, 2)))
    keys = ShardKeys(namespace, 2)
    async with inspector(redis_url) as client:
        first = await append_entry(
            client,
            namespace,
            2,
            [envelope("stuck", stuck, "gated_hold", str(gate), str(note))],
            fresh=False,
        )
        last = await append_entry(
            client, namespace, 2, [envelope("first", b, "append", "first")], fresh=False
        )
        await client.set(keys.horizon, last)  # (a predecessor that fetched both, and died)
        assert first < last
        with anyio.fail_after(60):
            async with (
                running_worker(
                    redis_url, namespace, shard_count=4, apps=["tests.apps"], lease_ttl=10
                ),
                keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
                anyio.create_task_group() as group,
            ):
                await eventually(note.exists, message="the suspect running alone")
                done = anyio.Event()

                async def move() -> None:
                    await ks.submit_many([c, b], apps.slow_move(0), op_id="x2")
                    done.set()

                group.start_soon(move)
                with anyio.move_on_after(3):  # (it must not get b while the replay holds)
                    await done.wait()
                gate.touch()
                await done.wait()
                assert await ks.read(b) == ["first", "x2"]
