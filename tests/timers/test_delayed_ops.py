"""Delayed ops (``submit(..., delay=)`` / ``at=``): each waits in its shard's timers, in Redis,
and takes its place in the key's order once due, never before, and runs once."""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import ResultNotFound, SubmitTimeout
from keyserial._wire.layout import ShardKeys
from keyserial.ledger import balance, deposit
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import eventually, stored_outcome


async def test_a_delayed_op_runs_once_due_behind_the_ops_appended_before_then(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
    ):
        before = time.time()
        async with anyio.create_task_group() as group:
            ran_at: list[float] = []

            async def late() -> None:
                ran_at.append(await ks.submit("seat:1", apps.stamp("late"), delay=0.5))

            group.start_soon(late)
            assert await ks.submit("seat:1", apps.append("ahead")) == ["ahead"]
            assert await ks.submit("seat:1", apps.append("still ahead")) == [
                "ahead",
                "still ahead",
            ]
        assert ran_at[0] >= before + 0.5, "never before its due time"
        assert [item if isinstance(item, str) else item[0] for item in await ks.read("seat:1")] == [
            "ahead",
            "still ahead",
            "late",
        ]


async def test_delayed_ops_due_in_one_millisecond_run_in_the_order_they_were_appended(
    redis_url: str, namespace: str
) -> None:
    due = datetime.now() + timedelta(seconds=2)
    keys = ShardKeys(namespace, 0)
    admin = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
            for n in range(12):  # (one entry each: their places order them, 1 to 12)
                await ks.enqueue("seat:2", apps.append(n), at=due)
            async with running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]):
                assert await ks.submit("seat:2", apps.append("now")) == ["now"]
                assert await admin.zcard(keys.timers) == 12, "all waiting as timers, due at once"
                assert len(set(await admin.zrange(keys.timers, 0, -1, withscores=True))) == 12
                await eventually(lambda: _length(ks, "seat:2", 13), message="all 13 ops")
                assert await ks.read("seat:2") == ["now", *range(12)]
    finally:
        await admin.aclose()


async def _length(ks: keyserial.Client, key: str, length: int) -> bool:
    return len(await ks.read(key) or []) == length


async def test_a_delayed_op_waits_in_the_shards_timers_not_its_stream(
    redis_url: str, namespace: str
) -> None:
    admin = redis.asyncio.Redis.from_url(redis_url)
    keys = ShardKeys(namespace, 0)
    try:
        async with (
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
            running_worker(redis_url, namespace, shard_count=1),
        ):
            op_id = await ks.enqueue("account:1", deposit(5), delay=60)
            await eventually(lambda: admin.zcard(keys.timers), message="the timer")
            assert await admin.llen(keys.inbox) == 0 and await admin.xlen(keys.stream) == 0
            with pytest.raises(ResultNotFound):
                await ks.result(op_id, key="account:1")
            [(timer_id, due_ms)] = await admin.zrange(keys.timers, 0, -1, withscores=True)
            (seconds, micros) = await admin.time()
            assert 59_000 < due_ms - (seconds * 1000 + micros // 1000) <= 60_000
            assert b'"account:1"' in await admin.hget(keys.timed, timer_id)
            assert await ks.submit("account:1", balance()) == 0
    finally:
        await admin.aclose()


async def test_enqueued_delayed_ops_are_fetched_by_op_id_once_they_ran(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2),
    ):
        op_id = await ks.enqueue("account:2", deposit(3), delay=0.3)
        with pytest.raises(ResultNotFound):
            await ks.result(op_id, key="account:2")
        assert await stored_outcome(ks, op_id, "account:2") == 3
        assert await ks.enqueue("account:2", deposit(3), op_id=op_id, delay=0.1) == op_id
        assert await ks.submit("account:2", deposit(3), op_id=op_id, delay=0.1) == 3  # answered
        assert await ks.submit("account:2", balance()) == 3


async def test_an_op_due_in_the_past_or_with_no_delay_runs_at_once(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1),
    ):
        with anyio.fail_after(5):
            assert await ks.submit("account:3", deposit(1), at=datetime.now() - timedelta(1)) == 1
            assert await ks.submit("account:3", deposit(1), delay=0) == 2


async def test_a_delayed_multi_key_op_and_transfer_wait_on_their_home_shard(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=4),
    ):
        await ks.submit("account:a", deposit(10))
        before = time.monotonic()
        assert await ks.transfer("account:a", "account:b", 4, delay=0.3) == {
            "account:a": 6,
            "account:b": 4,
        }
        assert time.monotonic() - before >= 0.3


async def test_the_timeout_of_a_delayed_submit_counts_from_its_due_time(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
        before = time.monotonic()
        with pytest.raises(SubmitTimeout):  # (no worker runs it)
            await ks.submit("account:4", deposit(1), delay=0.4, timeout=0.2)
        assert time.monotonic() - before >= 0.6


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"delay": -1}, ValueError, "delay"),
        ({"delay": math.nan}, ValueError, "delay"),
        ({"delay": math.inf}, ValueError, "delay"),
        ({"delay": 10**13}, ValueError, "too long"),
        ({"delay": "5"}, TypeError, "delay"),
        ({"delay": True}, TypeError, "delay"),
        ({"at": 1700000000}, TypeError, "datetime"),
        ({"delay": 1, "at": datetime.now()}, TypeError, "not both"),
    ],
)
async def test_a_bad_delay_is_refused_before_anything_is_sent(
    redis_url: str, namespace: str, options: dict[str, object], error: type[Exception], match: str
) -> None:
    admin = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
            with pytest.raises(error, match=match):
                await ks.submit("account:5", deposit(1), **options)  # type: ignore[arg-type]
            with pytest.raises(error, match=match):
                await ks.enqueue("account:5", deposit(1), **options)  # type: ignore[arg-type]
            assert await admin.llen(ShardKeys(namespace, 0).inbox) == 0
    finally:
        await admin.aclose()


def test_the_sync_client_delays_ops_too(redis_url: str, namespace: str) -> None:
    with keyserial.connect_sync(redis_url, shards=1, namespace=namespace) as ks:
        op_id = ks.enqueue("account:6", deposit(2), delay=30)
        with pytest.raises(ResultNotFound):
            ks.result(op_id, key="account:6")


async def test_an_awaited_delayed_op_due_while_no_worker_runs_is_not_appended_again(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's sweep finds the op in its shard's timers (not lost to a failover), so it
    appends no second copy; the next owner fires the one there is."""
    admin = redis.asyncio.Redis.from_url(redis_url)
    keys = ShardKeys(namespace, 0)
    try:
        async with keyserial.connect(
            redis_url, shards=1, namespace=namespace, idle_poll=0.05
        ) as ks:
            async with anyio.create_task_group() as group:
                outcome: list[int] = []

                async def wait_for_it() -> None:
                    outcome.append(await ks.submit("account:7", deposit(5), delay=0.3))

                async with running_worker(redis_url, namespace, shard_count=1):
                    group.start_soon(wait_for_it)
                    await eventually(lambda: admin.zcard(keys.timers), message="the timer")
                due = time.time() + 0.3
                # (Ten sweeps of the overdue op, with no owner to fire it.)
                await eventually(lambda: time.time() > due + 0.5, message="ten sweeps")
                assert await admin.llen(keys.inbox) == 0 and await admin.zcard(keys.timers) == 1
                async with running_worker(redis_url, namespace, shard_count=1):
                    await eventually(lambda: outcome, message="its outcome")
                    assert await ks.submit("account:7", balance()) == 5
            assert outcome == [5]
            assert "appending it again" not in caplog.text
    finally:
        await admin.aclose()


async def test_an_idle_owner_wakes_for_its_next_timer_rather_than_its_poll(
    redis_url: str, namespace: str
) -> None:
    """(Its poll is 10 s here: the op, due in 0.3 s, runs long before the next one.)"""
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=1, idle_poll=10.0),
    ):
        await ks.submit("account:8", deposit(1))
        before = time.monotonic()
        assert await ks.submit("account:8", deposit(1), delay=0.3) == 2
        assert time.monotonic() - before < 5.0
