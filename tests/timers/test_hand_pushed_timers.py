"""Delayed items pushed by hand, as any client user may (an RPUSH, and a wake-up anyone allowed
to publish may forge): none runs before the due time its item names, and one whose due time
cannot be read is dead-lettered, never run."""

from __future__ import annotations

import json
import time

import pytest
import redis.asyncio

import keyserial
from keyserial import ResultNotFound
from keyserial.ledger import balance
from keyserial.testing import ShardKeys, running_worker
from tests.entries import envelope, push_raw_item
from tests.helpers import eventually, stored_outcome


def _item(op_id: str, key: str, head: str) -> str:
    return f"{head}\n{json.dumps([envelope(op_id, key, 'deposit', 5)])}"


async def test_a_forged_push_of_a_delayed_item_never_runs_it_early(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    keys = ShardKeys(namespace, 0)
    due_ms = int(time.time() * 1000) + 60_000
    item = _item("forged-early", "account:1", f"1 fresh at {due_ms}")
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1),
    ):
        await ks.submit("account:1", balance())  # (the owner takes pushes from now on)
        place = await push_raw_item(client, keys, item)
        await client.publish(keys.wake_channel, f"push {place} {item}")
        await eventually(lambda: client.zcard(keys.timers), message="the item in the timers")
        assert await ks.submit("account:1", balance()) == 0
        with pytest.raises(ResultNotFound):
            await ks.result("forged-early", key="account:1")
        assert await client.zscore(keys.timers, f"{place:016d}") == due_ms


async def test_a_delayed_item_due_already_runs_at_once(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    keys = ShardKeys(namespace, 0)
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1),
    ):
        item = _item("due-long-ago", "account:2", "1 at 1000")
        await push_raw_item(client, keys, item, wake=True)
        assert await stored_outcome(ks, "due-long-ago", "account:2") == 5
        assert await client.zcard(keys.timers) == 0


@pytest.mark.parametrize("head", ["1 at 1000000000000000", "1 at soon", "1 at -5", "1 fresh at"])
async def test_a_delayed_item_whose_due_time_cannot_be_read_is_dead_lettered(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, head: str
) -> None:
    keys = ShardKeys(namespace, 0)
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1),
    ):
        await push_raw_item(client, keys, _item("unreadable", "account:3", head), wake=True)
        await eventually(lambda: client.xlen(keys.dead), message="the dead letter")
        assert await ks.submit("account:3", balance()) == 0
        assert await client.zcard(keys.timers) == 0


async def test_delayed_items_by_the_hundred_reach_the_timers_without_waiting_for_polls(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """(Pushed with one wake-up for all: each fetch moves a batch of 64 into the timers, and
    fetches again while the inbox may hold more; its poll is 10 s here.)"""
    keys = ShardKeys(namespace, 0)
    due_ms = int(time.time() * 1000) + 600_000
    async with running_worker(redis_url, namespace, shard_count=1, idle_poll=10.0):
        for n in range(300):
            await push_raw_item(client, keys, _item(f"bulk-{n}", "account:4", f"1 at {due_ms}"))
        await client.publish(keys.wake_channel, "300")
        await eventually(lambda: _all_timers(client, keys, 300), timeout=5, message="300 timers")


async def _all_timers(client: redis.asyncio.Redis, keys: ShardKeys, count: int) -> bool:
    return int(await client.zcard(keys.timers)) == count
