"""``ctx.fence`` is a per-key fencing token: every op on a key sees a larger one than the op
before it on that key, multi-key ops and changes of owner included, so an external store that
keeps the last token per key (``UPDATE … WHERE fence < $1``) refuses every stale writer."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import Starter, keys_on_shard
from tests.ownership import inspector, wait_for_holder

SHARDS = 4


async def fence_of(ks: keyserial.Client, key: str) -> int:
    fence = await ks.submit(key, apps.fence(), timeout=15)
    assert isinstance(fence, int)
    return fence


async def multi_fences(ks: keyserial.Client, keys: list[str]) -> dict[str, int]:
    fences = await ks.submit_many(keys, apps.fences(), timeout=15)
    assert isinstance(fences, dict)
    return fences


@pytest.mark.parametrize("split", [False, True], ids=["one-worker", "grants"])
async def test_every_op_on_a_key_sees_a_larger_fence_multi_key_ops_included(
    redis_url: str, namespace: str, split: bool
) -> None:
    """The home shard's owner took its shard far more often than the participant's: a
    multi-key op must still give the participant key a token between the ones before and
    after it on that key, not the home shard's."""
    home_key = keys_on_shard(0, SHARDS, 1, prefix="home")[0]
    far_key = keys_on_shard(2, SHARDS, 1, prefix="far")[0]
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        await client.set(ShardKeys(namespace, 0).epoch, 1000)  # many earlier owners of shard 0
    finally:
        await client.aclose()
    workers = (
        [
            running_worker(
                redis_url, namespace, shards=[0, 1], shard_count=SHARDS, apps=["tests.apps"]
            ),
            running_worker(
                redis_url, namespace, shards=[2, 3], shard_count=SHARDS, apps=["tests.apps"]
            ),
        ]
        if split
        else [running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"])]
    )
    with anyio.fail_after(60):
        async with keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks:
            for worker in workers:
                await worker.__aenter__()
            try:
                before = await fence_of(ks, far_key)
                during = await multi_fences(ks, [home_key, far_key])
                after = await fence_of(ks, far_key)
                assert before < during[far_key] < after
                assert await fence_of(ks, home_key) > during[home_key]
            finally:
                for worker in reversed(workers):
                    await worker.__aexit__(None, None, None)


@pytest.mark.slow
async def test_the_fence_of_a_key_grows_across_owners(
    redis_url: str, namespace: str, start: Starter
) -> None:
    key = keys_on_shard(1, SHARDS, 1, prefix="owners")[0]
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            first = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, first.pid, timeout=15)
            seen = [await fence_of(ks, key), await fence_of(ks, key)]
            first.kill()
            second = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, second.pid, timeout=15)
            seen.append(await fence_of(ks, key))
            assert seen == sorted(set(seen)), seen
