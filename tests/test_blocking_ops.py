"""Sync ops declared ``blocking=True`` run in a worker thread: the event loop, the worker's other
keys and its lease renewals never wait for them, while ops on their own key stay in order. A
sync op not so declared that holds the loop anyway is named in a warning. (What a blocking op
costs, and what it spares the other keys, is measured by ``python -m benchmarks.blocking``.)"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

import keyserial
from keyserial import ConfigError, OperationFailed
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import Starter, eventually, keys_on_shard
from tests.ownership import inspector

SHARDS = 2


async def test_a_blocking_op_leaves_the_loop_free_keeps_its_key_in_order_and_every_lease(
    redis_url: str, namespace: str, tmp_path: Path, start: Starter
) -> None:
    """While a blocking op blocks its thread for two lease TTLs, ops on another key of its
    shard and on the other shard are answered, an op on its own key waits for it and sees its
    write, and no lease changes hands. (Run inline, the op would hold the worker's loop:
    nothing else would be answered, and the leases would lapse.)"""
    gate, note = tmp_path / "gate", tmp_path / "note"
    slow, other = keys_on_shard(0, SHARDS, 2, "acct")
    elsewhere = keys_on_shard(1, SHARDS, 1, "acct")[0]
    answers: dict[str, Any] = {}
    start(redis_url, namespace, shards="0-1", shard_count=SHARDS, lease_ttl=1)
    async with (
        inspector(redis_url) as client,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        anyio.create_task_group() as group,
    ):
        assert await ks.submit(other, deposit(1), timeout=30) == 1  # (the worker has started)
        leases = [ShardKeys(namespace, shard) for shard in range(SHARDS)]
        epochs = [await client.get(keys.epoch) for keys in leases]

        async def submit(name: str, key: str, call: Any) -> None:
            answers[name] = await ks.submit(key, call, timeout=30)

        group.start_soon(submit, "blocked", slow, apps.gated_block(str(gate), str(note)))
        await eventually(note.exists, message="the blocking op running")
        group.start_soon(submit, "after it", slow, apps.peek())
        assert await ks.submit(other, deposit(5), timeout=5) == 6
        assert await ks.submit(elsewhere, deposit(7), timeout=5) == 7
        await anyio.sleep(2)  # (the op outlives two lease TTLs)
        assert "after it" not in answers
        assert [await client.get(keys.epoch) for keys in leases] == epochs
        gate.touch()
    assert answers == {"blocked": 1, "after it": 1}


async def test_a_blocking_op_that_raises_keeps_nothing_and_reports_its_traceback(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        with pytest.raises(OperationFailed) as failed:
            await ks.submit("k", apps.blocking_fail())
        assert failed.value.error_type == "RuntimeError"
        assert "boom in a thread" in (failed.value.remote_traceback or "")
        assert await ks.submit("k", apps.peek()) is None


@pytest.mark.parametrize("owners", ["one worker", "two workers"])
async def test_a_blocking_multi_key_op_commits_once_across_shards(
    redis_url: str, namespace: str, owners: str
) -> None:
    """In a thread, across shards: committed in one script by a worker owning both, or
    through grants between two."""
    source, target = keys_on_shard(0, SHARDS, 1, "acct")[0], keys_on_shard(1, SHARDS, 1, "acct")[0]
    ranges = [[0], [1]] if owners == "two workers" else [None]
    async with AsyncExitStack() as stack:
        for shards in ranges:
            await stack.enter_async_context(
                running_worker(
                    redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"], shards=shards
                )
            )
        ks = await stack.enter_async_context(
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace)
        )
        await ks.submit(source, apps.open_account(100))
        await ks.submit(target, apps.open_account(0))
        assert await ks.submit_many([source, target], apps.blocking_pay(30), op_id="p1") == 70
        assert await ks.submit_many([source, target], apps.blocking_pay(30), op_id="p1") == 70
        balances = [(await ks.submit(key, apps.peek()))["balance"] for key in (source, target)]
    assert balances == [70, 30]


async def test_a_sync_op_that_holds_the_loop_is_named_in_a_warning(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "keyserial.worker")
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        await ks.submit("k", apps.stall_loop(0.15))
        await ks.submit("k", apps.stall_loop(0.15))  # (once per op name, then once a minute)
    warnings = [r.getMessage() for r in caplog.records if "stall_loop" in r.getMessage()]
    assert len(warnings) == 1
    assert "on the worker's event loop" in warnings[0] and "blocking=True" in warnings[0]


def test_an_async_op_cannot_be_declared_blocking() -> None:
    async def waits(ctx: keyserial.Context) -> None: ...

    with pytest.raises(ConfigError, match="blocking=True is for sync ops"):
        keyserial.op(blocking=True)(waits)
