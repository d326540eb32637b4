"""A slow op holds its key, not its shard: ops on the shard's other keys keep flowing."""

from __future__ import annotations

import time

import anyio
import pytest

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests import apps


@pytest.mark.slow
async def test_a_slow_op_does_not_stall_other_keys_of_its_shard(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        finished: list[str] = []

        async def slow() -> None:
            await ks.submit("slow-key", apps.slow_increment(2.0))
            finished.append("slow")

        async with anyio.create_task_group() as group:
            group.start_soon(slow)
            for n in range(20):
                await ks.submit(f"fast-key-{n}", deposit(1))
            finished.append("fast")
        assert finished == ["fast", "slow"]


async def test_ops_on_the_slow_key_still_wait_their_turn(redis_url: str, namespace: str) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        results: list[int] = []

        async def bump(delay: float) -> None:
            results.append(await ks.submit("counter", apps.slow_increment(delay)))

        async with anyio.create_task_group() as group:
            for _ in range(10):
                group.start_soon(bump, 0.02)
        assert sorted(results) == list(range(1, 11))
        assert await ks.read("counter") == 10


async def test_throughput_of_slow_ops_grows_with_keys_not_shards(
    redis_url: str, namespace: str
) -> None:
    """20 ops that each wait 0.2 s: serial on one key (~4 s), overlapped on 20 keys."""
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for n in range(20):
                group.start_soon(ks.submit, f"io-key-{n}", apps.slow_increment(0.2))
        assert time.monotonic() - started < 1.5
