"""``keyserial keys pause|resume|paused``: an operator holds one key's ops. They queue and none
runs, the rest of the shard flows, and the pause is recorded in Redis, so the next owner honours
it after a takeover; resumed, the queued ops run once each, in order. A pause or resume holds
across a reshard however it interleaves with the move's copy and flip."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import redis.asyncio
from anyio.abc import TaskGroup

import keyserial
from keyserial import Settings, shard_for
from keyserial._backend.backend import Backend
from keyserial._operator.pauses import pause
from keyserial._reshard.mover import Progress, move_namespace
from keyserial._wire.layout import Layout, ShardKeys
from keyserial._wire.resharding import LayoutRecord
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import (
    ROOT,
    Starter,
    WorkerProcess,
    cli,
    eventually,
    keys_on_shard,
    publish,
    stored_outcome,
)
from tests.ownership import holder_pid, inspector, stream_empty, takes_pushes
from tests.users import documented_users

# Paused keys' ops wait: the command line as processes, reshards, takeovers.
pytestmark = pytest.mark.slow

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


#: The paused key and its neighbour, on shard 0, in the takeover tests.
KEYS = tuple(keys_on_shard(0, SHARDS, 2, "acct"))
ALL_SHARDS = f"0-{SHARDS - 1}"


@asynccontextmanager
async def _owner_and_a_key(
    redis_url: str, namespace: str, start: Starter
) -> AsyncIterator[tuple[WorkerProcess, Any, keyserial.Client, TaskGroup]]:
    """A worker owning every shard, with the first of :data:`KEYS` deposited on (so its owner
    holds its state); an inspector, a client and a task group for the test's callers."""
    owner = start(redis_url, namespace, shards=ALL_SHARDS, shard_count=SHARDS)
    async with (
        inspector(redis_url) as client,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        anyio.create_task_group() as group,
    ):
        assert await ks.submit(KEYS[0], deposit(1), timeout=30) == 1
        yield owner, client, ks, group


async def test_the_next_owner_honours_a_pause_after_a_crash(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """The owner is killed with the paused key's op taken in; its successor takes the shard
    over, runs the neighbour's ops, holds the paused key's op, and runs it once on resume."""
    answers: dict[str, Any] = {}
    async with _owner_and_a_key(redis_url, namespace, start) as (owner, client, ks, group):
        paused, neighbour = KEYS
        standby = start(redis_url, namespace, shards=ALL_SHARDS, shard_count=SHARDS)
        assert (await cli(redis_url, namespace, "keys", "pause", paused))[0] == 0

        async def held() -> None:
            answers["held"] = await ks.submit(paused, deposit(10), timeout=60)

        group.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        assert await ks.submit(neighbour, deposit(5), timeout=10) == 5  # (taken in after it)
        owner.signal(signal.SIGKILL)
        await eventually(lambda: _held_by(client, namespace, standby.pid), timeout=15)
        assert await ks.submit(neighbour, deposit(5), timeout=10) == 10
        assert answers == {}
        assert (await cli(redis_url, namespace, "keys", "resume", paused))[0] == 0
    assert answers == {"held": 11}
    assert await _state(redis_url, namespace, paused) == 11


async def test_the_next_owner_of_an_idle_shard_honours_a_pause_before_its_first_op(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """The owner is killed with its stream empty; its successor reads the paused keys as it
    takes the shard over, before any op. No step of the successor's fetches an entry (which
    would read the pauses along with it): the paused key's next op comes in its push, and is
    held while a later op on the shard runs; resumed, it runs once."""
    shard = ShardKeys(namespace, 0)
    answers: dict[str, Any] = {}
    async with _owner_and_a_key(redis_url, namespace, start) as (owner, client, ks, group):
        paused, neighbour = KEYS
        assert (await cli(redis_url, namespace, "keys", "pause", paused))[0] == 0
        await eventually(lambda: stream_empty(client, shard), timeout=15)
        standby = start(redis_url, namespace, shards=ALL_SHARDS, shard_count=SHARDS)
        owner.signal(signal.SIGKILL)
        await eventually(lambda: _held_by(client, namespace, standby.pid), timeout=15)
        await eventually(lambda: takes_pushes(client, shard), timeout=15)

        async def held() -> None:
            answers["held"] = await ks.submit(paused, deposit(10), timeout=60)

        group.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        # Appended after the paused key's op: had that one run, its reply came first.
        assert await ks.submit(neighbour, deposit(5), timeout=10) == 5
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


async def test_a_submit_timing_out_on_a_paused_key_says_it_is_paused_and_how_to_resume_it(
    redis_url: str, namespace: str
) -> None:
    """A client whose submit times out reads its keys' pause records: the error names the
    paused key and the command that resumes it, for a multi-key op too; a timeout on a key of
    the same shard that is not paused says nothing of pauses. Resumed, the held op runs."""
    paused, neighbour = keys_on_shard(0, SHARDS, 2, "acct")
    elsewhere = keys_on_shard(1, SHARDS, 1, "acct")[0]
    backend = await Backend.connect(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(elsewhere, deposit(5)) == 5
            await pause(backend, namespace, paused, pausing=True)
            with pytest.raises(keyserial.SubmitTimeout) as held:
                await ks.submit(paused, deposit(10), op_id="held-op", timeout=0.5)
            assert held.value.paused == (paused,) and held.value.vacant == ()
            message = str(held.value)
            assert f"key {paused!r} is paused" in message
            assert f"`keyserial keys resume {paused} --namespace {namespace}`" in message
            with pytest.raises(keyserial.SubmitTimeout) as both:
                await ks.transfer(elsewhere, paused, 1, timeout=0.5)
            assert both.value.paused == (paused,) and f"key {paused!r} is paused" in str(both.value)
            with pytest.raises(keyserial.SubmitTimeout) as slow:
                await ks.submit(neighbour, apps.slow_increment(1.0), timeout=0.2)
            assert slow.value.paused == () and "paused" not in str(slow.value)
            await pause(backend, namespace, paused, pausing=False)
            assert await stored_outcome(ks, "held-op", paused) == 10
    finally:
        await backend.aclose()


async def _held_by(client: Any, namespace: str, pid: int) -> bool:
    return all([await holder_pid(client, namespace, shard) == pid for shard in range(SHARDS)])


async def _state(url: str, namespace: str, key: str) -> Any:
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        return await ks.read(key)


# -- pauses and resumes across a reshard ------------------------------------------------------
#
# The mover copies the paused keys to the new layout before its flip; `pause` (the CLI's and the
# dashboard's) must land in the new layout however it interleaves with that copy and the flip.


def _cli_now(url: str, namespace: str, *args: str) -> tuple[int, str]:
    """The CLI, run to its end before returning: from the mover's (synchronous) progress
    callback, so between two of its steps."""
    result = subprocess.run(
        [sys.executable, "-m", "keyserial", *args, "--redis", url, "--namespace", namespace],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        check=False,
    )
    return result.returncode, result.stdout.decode()


async def _waits_until_resumed(
    ks: keyserial.Client, url: str, namespace: str, key: str, shards: int
) -> None:
    """``key`` (balance 1) is paused on its shard of ``shards``: a deposit waits while an op of
    a neighbour on that shard, appended after it, runs; once resumed through the CLI, it runs."""
    neighbour = next(
        k for k in keys_on_shard(shard_for(key, shards), shards, 2, "acct") if k != key
    )
    answers: dict[str, Any] = {}

    async def held() -> None:
        answers["held"] = await ks.submit(key, deposit(10), timeout=30)

    async with anyio.create_task_group() as group:
        group.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        assert await ks.submit(neighbour, deposit(5), timeout=30) == 5
        assert answers == {}, f"{key!r} was not paused in the new layout"
        code, out, _ = await cli(url, namespace, "keys", "resume", key)
        assert code == 0 and "(it was not paused)" not in out
    assert answers == {"held": 11}


async def _move(url: str, namespace: str, shards: int, progress: Progress | None = None) -> None:
    backend = await Backend.connect(url)
    try:
        settings = Settings(namespace=namespace)
        if progress is None:
            assert await move_namespace(backend, settings, shards) is not None
        else:
            assert await move_namespace(backend, settings, shards, progress) is not None
    finally:
        await backend.aclose()


class _Interrupted(Exception):
    """Raised by the mover's progress callback: the mover stops right after that step."""


def _stop_after_the_copy(message: str) -> None:
    if message.startswith("copied"):
        raise _Interrupted(message)


async def _start(ks: keyserial.Client, url: str, namespace: str, *, paused: str) -> None:
    """``acct:resumed`` and ``acct:paused`` hold 1; ``paused`` is paused."""
    for key in ("acct:resumed", "acct:paused"):
        assert await ks.submit(key, deposit(1)) == 1
    assert (await cli(url, namespace, "keys", "pause", paused))[0] == 0


async def test_a_pause_and_a_resume_between_the_copy_and_the_flip_hold_after_the_flip(
    redis_url: str, namespace: str
) -> None:
    """One uninterrupted move from 4 shards to 16: right after it copied the states and paused
    keys, before its flip, the operator resumes a key the copy carried paused and pauses
    another. After the flip the resumed key's ops run and the paused key's wait."""
    resumed, paused = "acct:resumed", "acct:paused"
    said: list[tuple[int, str]] = []

    def progress(message: str) -> None:
        if message.startswith("copied"):
            said.append(_cli_now(redis_url, namespace, "keys", "resume", resumed))
            said.append(_cli_now(redis_url, namespace, "keys", "pause", paused))

    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
    ):
        await _start(ks, redis_url, namespace, paused=resumed)
        await _move(redis_url, namespace, 16, progress)
        assert [code for code, _ in said] == [0, 0], said
        assert f"resumed {resumed!r}" in said[0][1] and "(it was not paused)" not in said[0][1]
        assert await ks.submit(resumed, deposit(10), timeout=10) == 11
        await _waits_until_resumed(ks, redis_url, namespace, paused, 16)


class _MovesOnAfterReading(Backend):
    """A connection whose first reading of the layout record is followed, before it returns, by
    ``then`` (the rest of a move, flip included): a `pause` that read the layout just before the
    flip, and writes after it."""

    then: Callable[[], Awaitable[None]] | None = None

    async def layout_record(self, namespace: str) -> LayoutRecord | None:
        record = await super().layout_record(namespace)
        then, self.then = self.then, None
        if then is not None:
            await then()
        return record


async def _pause_reading_before(
    url: str, namespace: str, key: str, then: Callable[[], Awaitable[None]], *, pausing: bool
) -> None:
    backend = await _MovesOnAfterReading.connect(url)
    assert isinstance(backend, _MovesOnAfterReading)
    try:
        backend.then = then
        await pause(backend, namespace, key, pausing=pausing)
        assert backend.then is None, "the layout was read"
    finally:
        await backend.aclose()


async def test_a_pause_and_a_resume_that_read_the_layout_before_a_flip_hold_after_it(
    redis_url: str, namespace: str
) -> None:
    """`pause` reads the layout record, and a move flips before it writes: a resume that read
    it while a move from 4 shards to 16 was under way (after its copy), then a pause that read
    it before a move from 16 to 8 was recorded. Each holds in the new layout."""
    resumed, paused = "acct:resumed", "acct:paused"
    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
    ):
        await _start(ks, redis_url, namespace, paused=resumed)
        with pytest.raises(_Interrupted):
            await _move(redis_url, namespace, 16, _stop_after_the_copy)
        await _pause_reading_before(
            redis_url, namespace, resumed, lambda: _move(redis_url, namespace, 16), pausing=False
        )
        assert await ks.submit(resumed, deposit(10), timeout=10) == 11
        await _pause_reading_before(
            redis_url, namespace, paused, lambda: _move(redis_url, namespace, 8), pausing=True
        )
        await _waits_until_resumed(ks, redis_url, namespace, paused, 8)


class _OperatorMidCopy(Backend):
    """The mover's connection: right after its first reading of the old shards' paused keys,
    the operator resumes one key and pauses another through the CLI."""

    url = ""
    namespace = ""

    async def all_paused(self, shards: Sequence[ShardKeys]) -> list[dict[bytes, bytes]]:
        paused = await super().all_paused(shards)
        if self.url:
            url, self.url = self.url, ""
            assert (await cli(url, self.namespace, "keys", "resume", "acct:resumed"))[0] == 0
            assert (await cli(url, self.namespace, "keys", "pause", "acct:paused"))[0] == 0
        return paused


async def test_a_pause_and_a_resume_made_while_the_mover_copies_paused_keys_hold(
    redis_url: str, namespace: str
) -> None:
    """The operator resumes a paused key and pauses another between the mover's reading of the
    old shards' paused keys and its writes to the new ones (which undo both in the new layout):
    the mover reads the old shards again, sees the change, and copies again."""
    resumed, paused = "acct:resumed", "acct:paused"
    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
    ):
        await _start(ks, redis_url, namespace, paused=resumed)
        mover = await _OperatorMidCopy.connect(redis_url)
        assert isinstance(mover, _OperatorMidCopy)
        try:
            mover.url, mover.namespace = redis_url, namespace
            assert await move_namespace(mover, Settings(namespace=namespace), 16) is not None
            assert mover.url == "", "the mover read the paused keys"
        finally:
            await mover.aclose()
        assert await ks.submit(resumed, deposit(10), timeout=10) == 11
        await _waits_until_resumed(ks, redis_url, namespace, paused, 16)


async def test_an_owner_that_has_not_heard_of_a_pause_holds_the_key_it_fetches(
    redis_url: str, namespace: str
) -> None:
    """The pause is written and its wake-up never comes (lost): the owner, polling once in
    30 s, fetches an entry with an op on the paused key and one on another key, woken by an
    append's own wake-up. The step reads the paused keys with the entries: the other key's op
    runs, the paused key's waits."""
    paused, free = keys_on_shard(1, 4, 2, "late")
    shard = Layout(namespace, 4).keys(1)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(
                redis_url, namespace, shard_count=4, apps=["tests.apps"], idle_poll=30.0
            ) as worker,
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(paused, apps.append(0)) == [0]
            await client.hset(shard.paused, paused, json.dumps({"at": 0}))
            ops = [
                {"id": "on-paused", "key": paused, "op": "append", "args": [1]},
                {"id": "on-free", "key": free, "op": "append", "args": [1]},
            ]
            entry_id = await client.xadd(shard.stream, {"v": "1", "ops": json.dumps(ops)})
            await publish(client, shard.wake_channel, entry_id)
            assert await stored_outcome(ks, "on-free", free, timeout=10) == [1]
            assert json.loads(await client.hget(shard.state, paused)) == [0]
            runner = worker._owned[1].runner
            assert paused in runner._paused
            # (Its op then runs: the worker's stop has no op to wait a lease TTL for.)
            assert (await cli(redis_url, namespace, "keys", "resume", paused))[0] == 0
            assert await stored_outcome(ks, "on-paused", paused, timeout=10) == [0, 1]
    finally:
        await client.aclose()
