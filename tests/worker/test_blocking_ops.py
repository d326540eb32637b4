"""Sync ops run in a worker thread unless declared ``inline=True``: the event loop, the worker's
other keys and its lease renewals never wait for them, while ops on their own key stay in order.
An op declared inline runs on the loop, and one that holds it anyway is named in a warning.
``blocking=True`` is deprecated (it is the default now). (What the thread costs, and what it
spares the other keys, is measured by ``python -m benchmarks.blocking``.)"""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

import keyserial
from keyserial import ConfigError, OperationFailed
from keyserial.ledger import LEDGER_OPS, deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import Starter, eventually, keys_on_shard, stored_outcome
from tests.ownership import inspector

SHARDS = 2


@pytest.mark.slow
async def test_a_blocking_op_leaves_the_loop_free_keeps_its_key_in_order_and_every_lease(
    redis_url: str, namespace: str, tmp_path: Path, start: Starter
) -> None:
    """While a plain sync op blocks its thread for two lease TTLs, ops on another key of its
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
    assert "declared inline" in warnings[0] and "on the worker's event loop" in warnings[0]
    assert "Drop inline=True" in warnings[0]


def test_an_async_op_cannot_be_declared_blocking() -> None:
    async def waits(ctx: keyserial.Context) -> None: ...

    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ConfigError, match="blocking=True is for sync ops"),
    ):
        keyserial.op(blocking=True)(waits)


def test_inline_is_for_sync_ops_and_blocking_is_deprecated() -> None:
    """``inline=True`` on an async op, or with ``blocking=True``, is refused; ``blocking=True``
    still declares an op, run in a thread as every sync op is, with a warning that names the
    line declaring it; ``blocking=False`` warns that it no longer means the event loop."""

    async def waits(ctx: keyserial.Context) -> None: ...

    def quick(ctx: keyserial.Context) -> None: ...

    with pytest.raises(ConfigError, match="inline=True is for sync ops"):
        keyserial.op(inline=True)(waits)
    with pytest.raises(ConfigError, match="not both"):
        keyserial.multi_op(inline=True, blocking=True)
    with pytest.warns(DeprecationWarning, match="drop blocking=True") as warned:
        declared = keyserial.op(blocking=True)(quick)
    assert warned[0].filename == __file__
    assert declared.blocking and not declared.inline
    with pytest.warns(DeprecationWarning, match="no longer runs a sync op on the event loop"):
        assert not keyserial.op(blocking=False)(quick).inline
    assert keyserial.op(quick).blocking and keyserial.op(inline=True)(quick).inline
    assert all(each.inline for each in LEDGER_OPS)


@pytest.mark.slow
async def test_a_plain_sync_cpu_bound_op_stalls_no_other_key_and_loses_no_lease(
    redis_url: str, namespace: str, tmp_path: Path, start: Starter
) -> None:
    """A sync op with no declaration that keeps a core busy for three lease TTLs (CPU work,
    not a sleep: it holds the GIL as much as the interpreter lets it) runs in a worker thread:
    meanwhile ops on other keys, of its shard and of the other one, are answered one after
    another well within a lease TTL, and no lease changes hands. (Run on the event loop, as
    every sync op used to be, it held them all for the whole spin, and every lease lapsed.)"""
    note = tmp_path / "note"
    slow, *others = keys_on_shard(0, SHARDS, 3, "acct")
    others += keys_on_shard(1, SHARDS, 3, "acct")
    start(redis_url, namespace, shards="0-1", shard_count=SHARDS, lease_ttl=1)
    latencies: list[float] = []
    lapsed: list[float] = []  # (when a lease key was found gone, seconds into the spin)
    async with (
        inspector(redis_url) as client,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        for key in others:  # (the worker has started; every key is cached)
            await ks.submit(key, deposit(1), timeout=30)
        leases = [ShardKeys(namespace, shard) for shard in range(SHARDS)]
        epochs = [await client.get(keys.epoch) for keys in leases]
        spun: dict[str, Any] = {}

        async def spin() -> None:
            spun["count"] = await ks.submit(slow, apps.cpu_spin(3.0, str(note)), timeout=30)

        async def watch_leases(began: float) -> None:
            while "count" not in spun:
                for keys in leases:
                    if not await client.exists(keys.lease):
                        lapsed.append(time.monotonic() - began)
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as group:
            group.start_soon(spin)
            await eventually(note.exists, message="the CPU-bound op running")
            group.start_soon(watch_leases, time.monotonic())
            while "count" not in spun:
                began = time.monotonic()
                await ks.submit(others[len(latencies) % len(others)], deposit(1), timeout=30)
                latencies.append(time.monotonic() - began)
        await anyio.sleep(1)  # (a lease lost meanwhile would have been taken again by now)
        assert [await client.get(keys.epoch) for keys in leases] == epochs
    assert spun == {"count": 1}
    assert not lapsed
    assert len(latencies) >= 20, latencies
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


async def test_a_sync_op_declared_inline_runs_on_the_event_loop_and_a_plain_one_off_it(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", apps.where_inline()) == "loop"
        assert await ks.submit("k", apps.where_plain()) == "thread"


async def test_plain_sync_ops_on_one_key_run_one_after_another_in_stream_order(
    redis_url: str, namespace: str
) -> None:
    """Each reads the key's list, blocks its thread, then appends: run side by side in their
    threads they would all read the same list and lose updates; in stream order, each sees
    every one before it (those queued behind a slow one share a trip to a thread), and one
    that fails after appending leaves nothing to the next."""
    values: list[Any] = [0, 1, 2, "fail", 4, 5, 6, 7]
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        op_ids = [
            await ks.enqueue("list", apps.append_slowly(value, 0.05 * (n % 3 == 0)))
            for n, value in enumerate(values)
        ]
        kept = [value for value in values if value != "fail"]
        assert await ks.submit("list", apps.peek(), timeout=30) == kept
        with pytest.raises(OperationFailed, match="failed after appending"):
            await stored_outcome(ks, op_ids[3], "list")
        outcomes = [await stored_outcome(ks, op_id, "list") for op_id in op_ids[:3] + op_ids[4:]]
    assert outcomes == [kept[: n + 1] for n in range(len(kept))]
