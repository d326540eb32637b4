"""A reshard moves pending timers with their keys: each delayed op fires once, in the new
layout, never before its due time."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta

import anyio
import redis.asyncio

import keyserial
from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import move_namespace
from keyserial._wire.layout import Layout
from tests import apps
from tests.helpers import WorkerProcess, eventually, stored_outcome

Starter = Callable[..., WorkerProcess]


async def _pending_timers(client: redis.asyncio.Redis, layout: Layout) -> int:
    return sum([int(await client.zcard(keys.timers)) for keys in layout.all_keys()])


async def _inboxes_empty(client: redis.asyncio.Redis, layout: Layout) -> bool:
    return sum([int(await client.llen(keys.inbox)) for keys in layout.all_keys()]) == 0


async def test_pending_timers_move_with_their_keys_and_fire_once_in_the_new_layout(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    start(redis_url, namespace, shards="0-3")
    old, new = Layout(namespace, 4), Layout(namespace, 16, 1)
    keys = [f"seat:{n}" for n in range(24)]
    with anyio.fail_after(60):
        async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
            await ks.submit(keys[0], apps.append("before"))
            due = datetime.now() + timedelta(seconds=4)
            earliest = due.timestamp()
            op_ids: dict[str, str] = {}

            async def enqueue(key: str) -> None:
                op_ids[key] = await ks.enqueue(key, apps.stamp(key), at=due)

            # (Enqueued together, due together: packed into one entry per shard, whose ops a
            # larger layout splits between several shards.)
            async with anyio.create_task_group() as group:
                for key in keys:
                    group.start_soon(enqueue, key)
            await eventually(lambda: _inboxes_empty(client, old), message="the timers set")
            assert 0 < await _pending_timers(client, old) < len(keys)
            lists = [f"later:{n}" for n in range(4)]
            set_by_ops = {key: await ks.submit(key, apps.append_later(3, key)) for key in lists}

            backend = await Backend.connect(redis_url)
            try:
                await move_namespace(backend, Settings(namespace=namespace), 16)
            finally:
                await backend.aclose()
            assert await _pending_timers(client, old) == 0
            homes = {keyserial.shard_for(key, 16) for key in keys}
            moved = [m for k in new.all_keys() for m in await client.zrange(k.timers, 0, -1)]
            assert sum(b"#t1" in member for member in moved) == len(lists), "ops' timers moved"
            assert await _pending_timers(client, new) >= len(homes)
            assert time.time() < earliest, "moved before they were due"
            for key in keys:
                await stored_outcome(ks, op_ids[key], key, timeout=20)
            for key in keys:
                ran = await ks.read(key)
                stamps = [item for item in ran if isinstance(item, list)]
                assert len(stamps) == 1 and stamps[0][0] == key, ran
                assert stamps[0][1] >= earliest
            assert (await ks.read(keys[0]))[0] == "before"
            for key, timer in set_by_ops.items():
                assert await stored_outcome(ks, timer, key, timeout=20) == [key]
            assert await _pending_timers(client, new) == 0
