"""``keyserial keys pause|resume|paused``: an operator holds one key's ops. They queue and none
runs, the rest of the shard flows, and the pause is recorded in Redis, so the next owner honours
it after a takeover; resumed, the queued ops run once each, in order."""

from __future__ import annotations

import json
import signal
from typing import Any

import anyio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests.helpers import Starter, eventually_async, keys_on_shard
from tests.ownership import holder_pid, inspector
from tests.test_acl import documented_users
from tests.test_keys_cli import cli

SHARDS = 2


async def test_a_paused_key_s_ops_queue_while_its_shard_flows_and_run_in_order_once_resumed(
    redis_url: str, namespace: str
) -> None:
    paused, neighbour = keys_on_shard(0, SHARDS, 2, "acct")
    answers: dict[str, Any] = {}
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        anyio.create_task_group() as group,
    ):
        assert await ks.submit(paused, deposit(1)) == 1
        code, out, _ = await cli(redis_url, namespace, "keys", "pause", paused)
        assert code == 0 and f"paused {paused!r} (shard 0)" in out

        async def submit(name: str, amount: int) -> None:
            answers[name] = await ks.submit(paused, deposit(amount), timeout=30)

        group.start_soon(submit, "first", 10)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(submit, "second", 100)
        await anyio.wait_all_tasks_blocked()
        # Appended after the paused key's ops, so taken in after them: its shard flows.
        assert await ks.submit(neighbour, deposit(5), timeout=5) == 5
        assert answers == {}
        code, out, _ = await cli(redis_url, namespace, "keys", "paused")
        assert [entry["key"] for entry in json.loads(out)] == [paused]
        code, out, _ = await cli(redis_url, namespace, "keys", "resume", paused)
        assert code == 0 and f"resumed {paused!r}" in out
    assert answers == {"first": 11, "second": 111}
    code, out, _ = await cli(redis_url, namespace, "keys", "resume", paused)
    assert code == 0 and "(it was not paused)" in out


async def test_the_next_owner_honours_a_pause_after_a_crash(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """The owner is killed with the paused key's op taken in; its successor takes the shard
    over, runs the neighbour's ops, holds the paused key's op, and runs it once on resume."""
    paused, neighbour = keys_on_shard(0, SHARDS, 2, "acct")
    shards = f"0-{SHARDS - 1}"
    owner = start(redis_url, namespace, shards=shards, shard_count=SHARDS)
    answers: dict[str, Any] = {}
    async with (
        inspector(redis_url) as client,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        anyio.create_task_group() as group,
    ):
        assert await ks.submit(paused, deposit(1), timeout=30) == 1
        standby = start(redis_url, namespace, shards=shards, shard_count=SHARDS)
        assert (await cli(redis_url, namespace, "keys", "pause", paused))[0] == 0

        async def held() -> None:
            answers["held"] = await ks.submit(paused, deposit(10), timeout=60)

        group.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        assert await ks.submit(neighbour, deposit(5), timeout=10) == 5  # (taken in after it)
        owner.signal(signal.SIGKILL)
        await eventually_async(lambda: _held_by(client, namespace, standby.pid), timeout=15)
        assert await ks.submit(neighbour, deposit(5), timeout=10) == 10
        assert answers == {}
        assert (await cli(redis_url, namespace, "keys", "resume", paused))[0] == 0
    assert answers == {"held": 11}
    assert await _state(redis_url, namespace, paused) == 11


async def test_a_client_user_cannot_pause_a_key(redis_url: str, namespace: str) -> None:
    with documented_users(redis_url) as users:
        async with running_worker(users.worker_url, namespace, shard_count=SHARDS):
            code, _, err = await cli(users.client_url, namespace, "keys", "pause", "acct:1")
            assert code == 2 and "no permissions" in err
            code, out, _ = await cli(users.worker_url, namespace, "keys", "paused")
            assert (code, json.loads(out)) == (0, [])


async def _held_by(client: Any, namespace: str, pid: int) -> bool:
    return all([await holder_pid(client, namespace, shard) == pid for shard in range(SHARDS)])


async def _state(url: str, namespace: str, key: str) -> Any:
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        return await ks.read(key)
