"""G2: ops on one key take effect in the order Redis took their entries into the shard's inbox
(the order its owner moves them into the stream in)."""

from __future__ import annotations

import json
from collections import defaultdict

import anyio
import redis.asyncio

import keyserial
from keyserial.testing import running_worker
from tests import apps
from tests.entries import inbox_entries
from tests.helpers import eventually

KEYS = [f"item:{n}" for n in range(5)]
SUBMITTERS = 50
PER_SUBMITTER = 8
TOTAL = SUBMITTERS * PER_SUBMITTER


async def _inbox_order(url: str, namespace: str, shard_count: int) -> dict[str, list[str]]:
    """Op ids per key, in the order their entries sit in the shards' inboxes."""
    client = redis.asyncio.Redis.from_url(url)
    order: dict[str, list[str]] = defaultdict(list)
    try:
        for shard in range(shard_count):
            for fields in await inbox_entries(client, namespace, shard):
                for envelope in json.loads(fields[b"ops"]):
                    order[envelope["key"]].append(envelope["id"])
    finally:
        await client.aclose()
    return order


async def test_concurrent_submitters_on_five_keys_apply_in_inbox_order(
    redis_url: str, namespace: str
) -> None:
    replied = 0
    all_replied = anyio.Event()
    async with keyserial.connect(redis_url, shards=4, namespace=namespace) as ks:

        async def submit(key: str, op_id: str) -> None:
            nonlocal replied
            await ks.submit(key, apps.record(), op_id=op_id)
            replied += 1
            if replied == TOTAL:
                all_replied.set()

        async def submitter(number: int) -> None:
            async with anyio.create_task_group() as mine:
                for step in range(PER_SUBMITTER):
                    mine.start_soon(submit, KEYS[(number + step) % len(KEYS)], f"s{number}-{step}")

        async with anyio.create_task_group() as group:
            for number in range(SUBMITTERS):
                group.start_soon(submitter, number)

            async def all_pushed() -> dict[str, list[str]] | None:
                order = await _inbox_order(redis_url, namespace, 4)
                return order if sum(map(len, order.values())) == TOTAL else None

            # No worker runs yet, so every entry is still in the inboxes: read their order,
            # then start the worker and let all 400 submits complete.
            expected = await eventually(all_pushed, message="every entry pushed")
            async with running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]):
                with anyio.fail_after(20):
                    await all_replied.wait()
        applied = {key: await ks.read(key) for key in KEYS}
    assert applied == {key: expected[key] for key in KEYS}
    assert sum(map(len, applied.values())) == TOTAL


async def test_a_client_that_awaits_each_submit_reads_its_own_writes(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
    ):

        async def submitter(number: int) -> None:
            key = KEYS[number % len(KEYS)]
            for step in range(PER_SUBMITTER):
                seen = await ks.submit(key, apps.append([number, step]))
                assert [item for item in seen if item[0] == number] == [
                    [number, s] for s in range(step + 1)
                ]

        async with anyio.create_task_group() as group:
            for number in range(SUBMITTERS):
                group.start_soon(submitter, number)
        final = {key: await ks.read(key) for key in KEYS}
    for index, key in enumerate(KEYS):
        items = final[key]
        # Every write of every submitter on the key is there once, each submitter's in order.
        assert sorted(map(tuple, items)) == sorted(
            (number, step)
            for number in range(index, SUBMITTERS, len(KEYS))
            for step in range(PER_SUBMITTER)
        )
        for number in range(index, SUBMITTERS, len(KEYS)):
            assert [item[1] for item in items if item[0] == number] == list(range(PER_SUBMITTER))
