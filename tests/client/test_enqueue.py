"""``ks.enqueue``: append an op and return its op id without waiting for it to run; its outcome
is fetched later by ``result()``."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import BacklogFull, PayloadTooLarge, ResultNotFound, SubmitTimeout
from keyserial.ledger import balance, deposit
from keyserial.testing import running_worker
from tests.helpers import stored_outcome


async def test_an_enqueued_op_returns_once_appended_and_runs_when_a_worker_comes(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:
        with anyio.fail_after(5):  # no worker runs: only the append is waited for
            op_id = await ks.enqueue("account:1", deposit(5))
        assert op_id.startswith(ks.client_id)
        with pytest.raises(ResultNotFound):
            await ks.result(op_id, key="account:1")
        async with running_worker(redis_url, namespace, shard_count=2):
            assert await stored_outcome(ks, op_id, "account:1") == 5
            assert await ks.submit("account:1", balance()) == 5


async def test_enqueueing_again_under_the_same_op_id_never_runs_it_twice(
    redis_url: str, namespace: str
) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
        running_worker(redis_url, namespace, shard_count=2),
    ):
        op_id = ks.new_op_id()
        assert await ks.enqueue("account:2", deposit(7), op_id=op_id) == op_id
        assert await ks.enqueue("account:2", deposit(7), op_id=op_id) == op_id
        assert await stored_outcome(ks, op_id, "account:2") == 7
        assert await ks.submit("account:2", deposit(7), op_id=op_id) == 7  # answered, not run
        assert await ks.submit("account:2", balance()) == 7


async def test_an_enqueue_that_cannot_be_appended_says_why(redis_url: str, namespace: str) -> None:
    async with keyserial.connect(
        redis_url, shards=1, namespace=namespace, max_backlog=1, max_payload_bytes=1000
    ) as ks:
        await ks.enqueue("account:3", deposit(1))
        with pytest.raises(BacklogFull):
            await ks.enqueue("account:3", deposit(1))
        with pytest.raises(PayloadTooLarge):
            await ks.enqueue("account:3", deposit("x" * 1000))
        with pytest.raises(ValueError, match="op_id"):
            await ks.enqueue("account:3", deposit(1), op_id="has#hash")


async def test_an_enqueue_to_an_unreachable_server_times_out(
    namespace: str, redis_url: str
) -> None:
    """(The append never returns: the server holds every write back.)"""
    admin = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
            await admin.client_pause(1500, all=False)  # (writes wait: the append among them)
            with pytest.raises(SubmitTimeout):
                await ks.enqueue("account:4", deposit(1), timeout=0.3)
    finally:
        await admin.aclose()


def test_the_sync_client_enqueues_too(redis_url: str, namespace: str) -> None:
    with keyserial.connect_sync(redis_url, shards=1, namespace=namespace) as ks:
        op_id = ks.enqueue("account:5", deposit(2))
        with pytest.raises(ResultNotFound):
            ks.result(op_id, key="account:5")
