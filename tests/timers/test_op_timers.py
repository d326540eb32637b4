"""Timers an op sets (``ctx.after``) and cancels (``ctx.cancel``), atomically with its writes:
a seat hold lapses unless paid, an op that raises sets nothing, and a cancelled timer's op
never runs after the op that cancelled it, even when it fired already and waits in memory."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import OperationFailed
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import envelope, push_raw_item
from tests.helpers import eventually, stored_outcome


async def _read_is(ks: keyserial.Client, key: str, expected: Any) -> bool:
    return await ks.read(key) == expected


async def test_a_seat_hold_lapses_by_the_timer_its_op_set(redis_url: str, namespace: str) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
    ):
        timer = await ks.submit("seat:1", apps.hold_seat("alice", 0.3))
        assert timer.endswith("#t1")
        assert (await ks.read("seat:1"))["holder"] == "alice"
        assert await stored_outcome(ks, timer, "seat:1") is True
        assert await ks.read("seat:1") is None
        assert await ks.submit("seat:1", apps.hold_seat("bob", 60)) != timer


async def test_paying_cancels_the_hold_s_timer_with_its_write(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        timer = await ks.submit("seat:2", apps.hold_seat("bob", 0.3))
        assert await client.zscore(ShardKeys(namespace, 0).timers, timer)
        assert await ks.submit("seat:2", apps.pay_seat("bob")) == timer
        assert await client.zcard(ShardKeys(namespace, 0).timers) == 0
        with pytest.raises(keyserial.TimerCancelled, match="cancelled") as cancelled:
            await ks.result(timer, key="seat:2")
        assert cancelled.value.error_type == "keyserial.TimerCancelled"
        await ks.submit("seat:2", apps.append_later(0.3, "after"))  # (no state of a list)
        assert await ks.read("seat:2") == {"holder": "bob", "paid": True}


async def test_an_op_that_raises_sets_no_timer(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        with pytest.raises(OperationFailed, match="failed after setting a timer"):
            await ks.submit("list:1", apps.append_later(0.01, "never", fail=True))
        assert await client.zcard(ShardKeys(namespace, 0).timers) == 0
        timer = await ks.submit("list:1", apps.append_later(0.01, "once"))
        assert await stored_outcome(ks, timer, "list:1") == ["once"]
        assert await ks.submit("list:1", apps.append("last")) == ["once", "last"]


async def test_a_timer_s_op_takes_its_place_in_the_key_s_order_when_it_fires(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        timer = await ks.submit("list:2", apps.append_later(0.3, "timer"))
        assert await ks.submit("list:2", apps.append("before")) == ["before"]
        await stored_outcome(ks, timer, "list:2")
        assert await ks.submit("list:2", apps.append("after")) == ["before", "timer", "after"]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "in a thread"])
async def test_a_timer_that_fired_and_waits_behind_its_cancel_never_runs(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, threaded: bool
) -> None:
    """The cancel is ahead of the fired timer in the key's order (appended before it fired),
    and both wait behind a slow op: the cancel finds the timer gone from Redis, in the stream
    already, and its op, fetched, is answered as cancelled instead of running. (In a thread,
    the cancel and the timer's op run in one trip.)"""
    keys = ShardKeys(namespace, 0)
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        timer = await ks.submit("list:3", apps.append_later(0.4, "fired", threaded=threaded))
        async with anyio.create_task_group() as group:
            group.start_soon(ks.submit, "list:3", apps.slow_append("slow", 1.0))
            cancel = apps.cancel_timer_in_thread(timer) if threaded else apps.cancel_timer(timer)
            group.start_soon(ks.submit, "list:3", cancel)
            # (The timer fires behind the cancel while the slow op runs.)
            await eventually(lambda: _fired(client, keys), message="the timer firing")
        with pytest.raises(keyserial.TimerCancelled, match="cancelled"):
            await stored_outcome(ks, timer, "list:3")
        assert await ks.submit("list:3", apps.append("last")) == ["slow", "last"]


async def _fired(client: redis.asyncio.Redis, keys: ShardKeys) -> bool:
    return await client.zcard(keys.timers) == 0


async def test_an_entry_a_client_pushes_under_a_timer_s_op_id_is_refused(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """Only a timer's firing runs an op under ``<op id>#t<n>``: a client that pushes one (to
    run it ahead, or to answer a timer with an outcome of its own) is refused, and nothing is
    stored under the id."""
    keys = ShardKeys(namespace, 0)
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        timer = await ks.submit("list:4", apps.append_later(60, "timer"))
        forged = f"1\n{json.dumps([envelope(timer, 'list:4', 'append', 'forged')])}"
        await push_raw_item(client, keys, forged, wake=True)
        assert await ks.submit("list:4", apps.append("after")) == ["after"]
        assert await client.hget(keys.results, timer) is None
        assert await client.zscore(keys.timers, timer)


@pytest.mark.parametrize(
    ("seconds", "call", "error"),
    [(-1, "ok", ValueError), (10**12, "ok", ValueError), ("1", "ok", TypeError)],
)
async def test_a_bad_timer_fails_its_op_and_sets_nothing(
    redis_url: str,
    namespace: str,
    client: redis.asyncio.Redis,
    seconds: Any,
    call: str,
    error: type[Exception],
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
    ):
        with pytest.raises(OperationFailed, match=error.__name__):
            await ks.submit("list:5", apps.append_later(seconds, call))
        with pytest.raises(OperationFailed, match="not a timer id"):
            await ks.submit("list:5", apps.cancel_timer("no-such-id"))
        assert await client.zcard(ShardKeys(namespace, 0).timers) == 0


async def test_an_idle_owner_wakes_for_a_timer_its_op_just_set(
    redis_url: str, namespace: str
) -> None:
    """(Its poll is 10 s here: the timer, due in 0.3 s, fires long before the next one.)"""
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"], idle_poll=10.0),
    ):
        timer = await ks.submit("list:6", apps.append_later(0.3, "woken"))
        assert await stored_outcome(ks, timer, "list:6", timeout=5) == ["woken"]
