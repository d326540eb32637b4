"""``keyserial timers list`` and ``cancel``: an operator sees each shard's pending timers,
soonest first (a key's alone), and cancels one that has not fired: its ops never run, and are
answered ``keyserial.TimerCancelled``; one that fired is not cancelled, and says so."""

from __future__ import annotations

import json

import pytest
import redis.asyncio

import keyserial
from keyserial.ledger import balance, deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import cli, eventually


async def _timers(client: redis.asyncio.Redis, namespace: str, shards: int) -> int:
    return sum([int(await client.zcard(ShardKeys(namespace, s).timers)) for s in range(shards)])


async def _three(client: redis.asyncio.Redis, namespace: str) -> bool:
    return await _timers(client, namespace, 2) == 3


async def test_an_operator_lists_pending_timers_and_cancels_one(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
    ):
        later = await ks.enqueue("account:1", deposit(5), delay=60)
        sooner = await ks.enqueue("account:2", deposit(7), delay=30)
        timer = await ks.submit("seat:1", apps.hold_seat("alice", 90))
        await eventually(lambda: _three(client, namespace), message="three timers")

        code, out, _ = await cli(redis_url, namespace, "timers", "list", "--json")
        assert code == 0
        listed = [json.loads(line) for line in out.splitlines()]
        assert [[op["id"] for op in each["ops"]] for each in listed] == [[sooner], [later], [timer]]
        assert listed[2]["id"] == timer and listed[2]["ops"][0]["op"] == "release_seat"
        code, out, _ = await cli(redis_url, namespace, "timers", "list", "account:1")
        assert code == 0 and later in out and sooner not in out and "due 20" in out

        by_op = {each["ops"][0]["id"]: each for each in listed}
        code, out, _ = await cli(redis_url, namespace, "timers", "cancel", by_op[later]["id"])
        assert code == 0 and "cancelled timer" in out
        with pytest.raises(keyserial.TimerCancelled, match="cancelled by an operator") as cancelled:
            await ks.result(later, key="account:1")
        assert cancelled.value.error_type == "keyserial.TimerCancelled"
        code, out, _ = await cli(redis_url, namespace, "timers", "cancel", timer)
        assert code == 0
        assert await _timers(client, namespace, 2) == 1
        assert await ks.submit("account:1", balance()) == 0
        assert (await ks.read("seat:1"))["holder"] == "alice", "its release never runs"


async def test_cancelling_a_timer_that_fired_or_never_was_says_so(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1),
    ):
        op_id = await ks.enqueue("account:3", deposit(1), delay=0.2)
        await eventually(lambda: client.zcard(ShardKeys(namespace, 0).timers), message="timer")
        [(timer_id, _)] = await client.zrange(
            ShardKeys(namespace, 0).timers, 0, -1, withscores=True
        )
        await eventually(lambda: _ran(ks, op_id), message="the op running")
        code, _, err = await cli(redis_url, namespace, "timers", "cancel", timer_id.decode())
        assert code == 1 and "no pending timer" in err
        assert await ks.result(op_id, key="account:3") == 1
        code, out, _ = await cli(redis_url, namespace, "timers", "list")
        assert code == 0 and out.strip() == "no pending timers"


async def _ran(ks: keyserial.Client, op_id: str) -> bool:
    try:
        await ks.result(op_id, key="account:3")
    except keyserial.ResultNotFound:
        return False
    return True


async def test_status_counts_each_shard_s_timers_and_when_the_next_is_due(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2),
    ):
        shard = ks.shard_of("account:4")
        for delay in (600, 60):
            await ks.enqueue("account:4", deposit(1), delay=delay)
        await eventually(lambda: _two(client, namespace), message="two timers")
        code, out, err = await cli(redis_url, namespace, "status", "--json", "--interval", "0.1")
    assert code == 0, err
    shards = json.loads(out)["shards"]
    assert shards[shard]["timers"] == 2 and 50_000 < shards[shard]["next_timer_in_ms"] <= 60_000
    assert (shards[1 - shard]["timers"], shards[1 - shard]["next_timer_in_ms"]) == (0, None)


async def _two(client: redis.asyncio.Redis, namespace: str) -> bool:
    return await _timers(client, namespace, 2) == 2
