"""Delayed ops under faults: each fires once, never before its due time, in its key's order,
across a kill -9 of its owner, a frozen owner resumed after its timers fired elsewhere, and a
Redis restart with timers due while it was down."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import anyio

import keyserial
from keyserial.testing import LocalServer, ShardKeys
from tests import apps
from tests.helpers import WorkerProcess, eventually, freeze, stored_outcome, wait_for_log
from tests.ownership import holders, inspector, wait_for_holder

SHARDS = 4
Starter = Callable[..., WorkerProcess]


async def _owner_and_standby(
    start: Starter, url: str, namespace: str, client: Any
) -> tuple[WorkerProcess, WorkerProcess]:
    owner = start(url, namespace, lease_ttl=1.0)
    await wait_for_holder(client, namespace, owner.pid, timeout=15)
    standby = start(url, namespace, lease_ttl=1.0)
    await wait_for_log(standby, "serving shards", timeout=15)
    return owner, standby


async def _delay(
    ks: keyserial.Client, key: str, delays: list[float], prefix: str = "t"
) -> dict[str, tuple[str, float]]:
    """Enqueue a ``stamp`` op per delay (labelled ``<prefix><n>``); each label -> (op id, the
    earliest it may run)."""
    due: dict[str, tuple[str, float]] = {}
    for n, delay in enumerate(delays):
        label = f"{prefix}{n}"
        earliest = time.time() + delay
        due[label] = (await ks.enqueue(key, apps.stamp(label), delay=delay), earliest)
    return due


async def _timers(client: Any, keys: ShardKeys) -> int:
    return int(await client.zcard(keys.timers))


async def _check_fired(ks: keyserial.Client, key: str, due: dict[str, tuple[str, float]]) -> None:
    """Each op ran once, not before it was due, in the order of their due times."""
    for op_id, _ in due.values():
        await stored_outcome(ks, op_id, key, timeout=20)
    ran = await ks.read(key)
    labels = [label for label, _ in ran]
    assert sorted(labels) == sorted(due), "each delayed op ran exactly once"
    assert labels == sorted(due, key=lambda label: (due[label][1], label))
    for label, at in ran:
        assert at >= due[label][1], f"{label} ran {due[label][1] - at:.3f}s early"


async def test_timers_due_while_their_owner_is_dead_fire_once_on_the_standby(
    redis_url: str, namespace: str, start: Starter
) -> None:
    key = "hold:1"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            keys = ShardKeys(namespace, ks.shard_of(key))
            owner, standby = await _owner_and_standby(start, redis_url, namespace, client)
            # Due during the takeover (about a lease TTL), and after it.
            due = await _delay(ks, key, [0.3 + n * 0.02 for n in range(10)] + [2.5, 2.6])
            await eventually(lambda: _timers_are(client, keys, 12), message="12 timers")
            owner.kill()
            await wait_for_holder(client, namespace, standby.pid, timeout=10)
            await _check_fired(ks, key, due)
            assert await _timers(client, keys) == 0


async def _timers_are(client: Any, keys: ShardKeys, count: int) -> bool:
    return await _timers(client, keys) == count


async def test_a_frozen_owner_resumed_after_its_timers_fired_elsewhere_fires_none_again(
    redis_url: str, namespace: str, start: Starter
) -> None:
    key = "hold:2"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            shard = ks.shard_of(key)
            keys = ShardKeys(namespace, shard)
            owner, standby = await _owner_and_standby(start, redis_url, namespace, client)
            due = await _delay(ks, key, [0.2 + n * 0.05 for n in range(8)] + [3.0])
            await eventually(lambda: _timers_are(client, keys, 9), message="9 timers")
            await freeze(owner)  # (past its lease, with timers due meanwhile)
            await wait_for_holder(client, namespace, standby.pid, shards=[shard], timeout=10)
            for label in ("t0", "t7"):
                await stored_outcome(ks, due[label][0], key, timeout=10)
            owner.signal(signal.SIGCONT)
            await eventually(
                lambda: (
                    f"shard {shard}: lost the lease" in owner.log()
                    or f"shard {shard}: stopping at once" in owner.log()
                ),
                message="the resumed owner giving the shard up",
            )
            await _check_fired(ks, key, due)
            assert owner.process.poll() is None, "the zombie stays alive as a standby"
            assert (await holders(client, namespace))[shard] == standby.pid


async def test_timers_due_while_redis_was_down_fire_once_after_its_restart(
    durable_server: LocalServer, namespace: str, start: Starter
) -> None:
    url = durable_server.url
    key = "hold:3"
    with anyio.fail_after(75):
        async with (
            inspector(url) as client,
            keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks,
        ):
            keys = ShardKeys(namespace, ks.shard_of(key))
            worker = start(url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, worker.pid, timeout=15)
            due = await _delay(ks, key, [0.6 + n * 0.01 for n in range(6)] + [4.0])
            await eventually(lambda: _timers_are(client, keys, 7), message="7 timers")
            await anyio.to_thread.run_sync(durable_server.kill)
            latest = max(earliest for _, earliest in list(due.values())[:6])
            await eventually(lambda: time.time() > latest + 0.2, message="the due times passing")
            await anyio.to_thread.run_sync(durable_server.start)
            await _check_fired(ks, key, due)
            assert worker.process.poll() is None, "the worker survived the restart"


async def test_timers_ops_set_fire_once_after_a_kill_9_of_their_owner(
    redis_url: str, namespace: str, start: Starter
) -> None:
    lists = [f"later:{n}" for n in range(6)]
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            owner, standby = await _owner_and_standby(start, redis_url, namespace, client)
            timers = {key: await ks.submit(key, apps.append_later(0.3, key)) for key in lists}
            owner.kill()
            await wait_for_holder(client, namespace, standby.pid, timeout=10)
            for key, timer in timers.items():
                assert await stored_outcome(ks, timer, key, timeout=20) == [key]
                assert await ks.read(key) == [key], "each timer's op ran once"


async def test_a_delayed_op_pushed_while_no_worker_owns_its_shard_keeps_its_due_order(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """A timer due during the outage, and delayed ops pushed during it (in the inbox, due by
    the takeover, one pushed before another that is due sooner): the next owner fires them all
    in the order of their due times."""
    key = "hold:4"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            keys = ShardKeys(namespace, ks.shard_of(key))
            owner = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, owner.pid, timeout=15)
            due = await _delay(ks, key, [0.4])
            await eventually(lambda: _timers_are(client, keys, 1), message="the timer")
            owner.kill()
            due |= await _delay(ks, key, [0.9, 0.5], prefix="u")
            latest = max(earliest for _, earliest in due.values())
            await eventually(lambda: time.time() > latest + 0.2, message="all due, no owner")
            assert await client.llen(keys.inbox) == 2, "pushed while no worker owned the shard"
            start(redis_url, namespace, lease_ttl=1.0)
            await _check_fired(ks, key, due)
