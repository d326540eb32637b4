"""Regression tests for faults that hand-picked scenarios missed: each one failed on the code
before its fix. Real worker processes, real signals, a private server per topology."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis.asyncio

import keyserial
import keyserial.testing
from keyserial import shard_for
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import append_entry, envelope, stored
from tests.helpers import (
    Starter,
    eventually,
    keys_on_shard,
    stored_outcome,
    submit_quietly,
    wait_for_exit,
    wait_for_log,
)
from tests.ownership import all_held, inspector, wait_for_holder
from tests.proxy import FaultProxy

SHARDS = 4


async def run_one(ks: keyserial.Client, key: str) -> list[str]:
    """A later op on ``key``: it runs after everything appended before it, and shows the
    key's op log as it committed."""
    await ks.submit(key, apps.record(), timeout=20)
    state = await ks.read(key)
    assert isinstance(state, list)
    return state


@pytest.mark.slow
async def test_a_graceful_stop_never_replays_an_op_that_committed(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """An entry carries op A (sync, committed and answered) and op B (slow, still running).
    SIGTERM gives up on B after a lease TTL and releases the shard: the next owner must run B
    again but must not run A again, although the entry was appended with ``fresh`` op ids."""
    fast_key, slow_key = keys_on_shard(0, SHARDS, 2, prefix="graceful")
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            owner = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, owner.pid, timeout=15)
            note = tmp_path / "running"
            await append_entry(
                client,
                namespace,
                0,
                [
                    envelope("A", fast_key, "record"),
                    envelope("B", slow_key, "noted_slow_record", 30, str(note)),
                ],
                fresh=True,
            )
            await eventually(lambda: note.exists(), message="B running")
            assert await stored(client, namespace, 0, "A") == {"ok": 1}

            assert owner.terminate() == 0
            assert "released shards" in owner.log()
            successor = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, successor.pid, timeout=15)
            await eventually(
                lambda: note.read_text().count("\n") == 2,
                timeout=15,
                message="B running again on the successor",
            )

            log = await run_one(ks, fast_key)
            assert log[0] == "A" and len(log) == 2, f"A applied twice: {log}"
            assert "died with entries" not in successor.log(), "a clean release blames no op"


@pytest.mark.slow
async def test_a_failed_runner_replays_without_running_a_committed_op_twice(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """An entry holds a committed op and then an op whose result cannot be encoded for Redis
    (the runner fails on it). Whatever happens to the runner, the committed op stays applied
    once and the shard keeps serving its other keys."""
    fast_key, bad_key, other_key = keys_on_shard(1, SHARDS, 3, prefix="failed")
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            worker = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, worker.pid, timeout=15)
            await append_entry(
                client,
                namespace,
                1,
                [
                    envelope("A", fast_key, "record"),
                    envelope("bad", bad_key, "append", "\ud83d"),
                ],
                fresh=True,
            )
            outcome = await eventually(
                lambda: _sync_stored(redis_url, namespace, 1, "bad"),
                timeout=20,
                message="an outcome for the op with undecodable text",
            )
            assert outcome["error"]["type"] == "keyserial.MalformedOperation", outcome
            assert len(await run_one(ks, other_key)) == 1
            assert (await ks.read(fast_key)) == ["A"]
            assert worker.process.poll() is None, "one op's data never kills the worker"


def _sync_stored(url: str, namespace: str, shard: int, op_id: str) -> Any:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(url)
    try:
        keys = ShardKeys(namespace, shard)
        raw = client.hget(keys.results, op_id) or client.hget(keys.results_old, op_id)
        return None if raw is None else json.loads(raw)
    finally:
        client.close()


@pytest.mark.slow
async def test_one_sigterm_stops_a_worker_that_cannot_reach_redis(
    namespace: str, start: Starter
) -> None:
    """A service manager's SIGTERM must stop a worker still waiting for Redis at start, not
    wait for a SIGKILL."""
    from tests.helpers import free_closed_port, wait_for_log

    worker = start(f"redis://127.0.0.1:{free_closed_port()}/0", namespace)
    await wait_for_log(worker, "retrying", timeout=15)
    worker.signal(signal.SIGTERM)
    assert await wait_for_exit(worker, timeout=5) == 0


@pytest.mark.slow
async def test_results_a_replay_needs_outlive_the_retention_while_progress_is_pinned(
    redis_url: str, namespace: str
) -> None:
    """A slow op pins progress; a deposit in the same entry commits (an entry whose ops have
    all committed leaves the stream, this one cannot); the retention passes several times. The
    next owner replays the entry: the deposit's result must still be there, or the deposit
    would apply twice."""
    from keyserial.ledger import deposit

    options: dict[str, Any] = {
        "shard_count": 1,
        "apps": ["tests.apps"],
        "lease_ttl": 1.0,
        "result_ttl": 0.2,
    }
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        ):
            async with running_worker(redis_url, namespace, **options):
                await append_entry(
                    client,
                    namespace,
                    0,
                    [
                        envelope("slow", "k1", "slow_record", 30),
                        envelope("dep", "k2", "deposit", 10),
                    ],
                    fresh=True,
                )
                assert await stored_outcome(ks, "dep", "k2") == 10
                began = anyio.current_time()
                while anyio.current_time() - began < 5 * options["result_ttl"]:
                    await ks.submit("k3", deposit(1), timeout=10)  # steps that may rotate
            async with running_worker(redis_url, namespace, **options):
                assert await ks.submit("k2", keyserial.call("balance"), timeout=10) == 10


async def test_a_stuck_op_holds_its_key_not_the_shards_backlog(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """An op that never returns pins progress at its entry. Entries after it whose ops all
    committed leave the stream, so the backlog counts only what waits: with a backlog limit of
    40 entries, 150 later ops on other keys of the shard are all accepted and applied."""
    from keyserial.ledger import deposit

    note, gate = tmp_path / "stuck", tmp_path / "gate"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            running_worker(
                redis_url, namespace, shard_count=1, apps=["tests.apps"], max_backlog=40
            ),
            keyserial.connect(redis_url, shards=1, namespace=namespace, max_backlog=40) as ks,
            anyio.create_task_group() as group,
        ):
            group.start_soon(submit_quietly, ks, "stuck", apps.gated_hold(str(gate), str(note)))
            await eventually(note.exists, message="the stuck op running")
            for n in range(150):
                assert await ks.submit(f"other:{n % 7}", deposit(1), timeout=10) >= 1
            length = await client.xlen(ShardKeys(namespace, 0).stream)
            assert length < 40, f"{length} entries left in the stream"
            # (It ends now: the worker's stop has no op to wait a lease TTL for.)
            gate.touch()
            group.cancel_scope.cancel()


async def test_an_append_lost_before_any_worker_saw_it_is_appended_again(
    redis_url: str, namespace: str
) -> None:
    """A failover can lose an acknowledged push (replication is asynchronous): the entry is
    gone from the inbox and no outcome will ever come. The client's sweep notices the entry
    missing with no outcome and pushes the op again under its op id, so it applies once instead
    of leaving its caller waiting until the timeout."""
    key = "lost:1"
    inbox = ShardKeys(namespace, shard_for(key, 1)).inbox
    with anyio.fail_after(30):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=1, namespace=namespace, idle_poll=0.2) as ks,
        ):
            async with anyio.create_task_group() as group:
                results: list[int] = []

                async def submit() -> None:
                    results.append(await ks.submit(key, apps.record(), timeout=20))

                group.start_soon(submit)
                await eventually(lambda: client.llen(inbox))
                await client.delete(inbox)  # what the failover lost
                async with running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]):
                    await eventually(lambda: _done(results))
            assert results == [1]
            assert len(await ks.read(key)) == 1


async def _done(results: list[int]) -> bool:
    return bool(results)


async def test_an_op_unknown_to_the_worker_is_refused_without_storing_the_refusal(
    redis_url: str, namespace: str
) -> None:
    """During a rolling deploy that adds an op, a worker that lacks it refuses it, but must not
    make the refusal the op id's outcome: once a worker that knows the op serves the shard, the
    same op id runs."""
    async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
        async with running_worker(redis_url, namespace, shard_count=1):  # the ledger ops only
            with pytest.raises(keyserial.UnknownOperation, match="submit the same op id"):
                await ks.submit("evt:1", apps.record(), op_id="order-7", timeout=10)
        with pytest.raises(keyserial.ResultNotFound):
            await ks.result("order-7", key="evt:1")
        async with running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]):
            assert await ks.submit("evt:1", apps.record(), op_id="order-7", timeout=10) == 1


async def test_an_op_that_would_commit_a_state_over_the_limit_fails_and_writes_nothing(
    redis_url: str, namespace: str
) -> None:
    """A state is written whole at every commit that changes it: one over ``max_state_bytes``
    fails its op with a clear error instead of making the shard's steps too large to send."""
    async with (
        running_worker(
            redis_url, namespace, shard_count=1, apps=["tests.apps"], max_state_bytes=1000
        ),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("big", apps.append("x" * 400), timeout=10) == ["x" * 400]
        with pytest.raises(keyserial.OperationFailed, match="over max_state_bytes"):
            await ks.submit("big", apps.append("y" * 700), timeout=10)
        assert await ks.read("big") == ["x" * 400]
        assert await ks.submit("big", apps.append("z"), timeout=10) == ["x" * 400, "z"]


@pytest.mark.slow
async def test_a_stuck_op_does_not_hold_its_shard_through_a_careful_replay(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """The owner dies (kill -9) while an op that never returns runs. Its successor runs that op
    (the one the acquire blamed) alone, to see whether it kills this owner too; it waits at most
    a lease TTL for it, so an op on another key of the shard, appended after, still commits."""
    stuck_key, other_key = keys_on_shard(2, SHARDS, 2, prefix="careful")
    note = tmp_path / "holding"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            owner = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, owner.pid, timeout=15)
            await append_entry(
                client,
                namespace,
                2,
                [envelope("stuck", stuck_key, "hold", 3600, str(note))],
                fresh=True,
            )
            await eventually(note.exists, message="the stuck op running")
            owner.kill()
            successor = start(redis_url, namespace, lease_ttl=1.0)
            await wait_for_holder(client, namespace, successor.pid, timeout=15)
            assert len(await run_one(ks, other_key)) == 1
            assert "died with entries" in successor.log(), "the takeover replayed carefully"


@pytest.mark.slow
@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_takeover_with_many_stuck_ops_in_flight_stalls_its_shard_one_lease_ttl_at_most(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """The owner dies (kill -9) with eight ops that never return in flight, on eight keys of
    one shard, in two entries. The successor runs the op the acquire blamed alone, for a lease
    TTL at most, and the others side by side: an op on another key commits within a few lease
    TTLs of the takeover, not one lease TTL per stuck op (nemesis seeds 105 and 212)."""
    ttl = 1.0
    *stuck_keys, other_key = keys_on_shard(2, SHARDS, 9, prefix="stalled")
    note = tmp_path / "holding"
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            owner = start(redis_url, namespace, lease_ttl=ttl)
            await wait_for_holder(client, namespace, owner.pid, timeout=15)
            for keys in (stuck_keys[:4], stuck_keys[4:]):
                await append_entry(
                    client,
                    namespace,
                    2,
                    [envelope(f"stuck-{key}", key, "hold", 3600, str(note)) for key in keys],
                    fresh=True,
                )
            await eventually(
                lambda: note.exists() and len(note.read_text().split()) == 8,
                message="every stuck op running",
            )
            owner.kill()
            successor = start(redis_url, namespace, lease_ttl=ttl)
            await wait_for_holder(client, namespace, successor.pid, shards=[2], timeout=15)
            began = time.monotonic()
            assert len(await run_one(ks, other_key)) == 1
            stalled = time.monotonic() - began
            assert stalled < 3 * ttl, f"a new op waited {stalled:.1f}s (lease TTL {ttl}s)"
            assert "died with entries" in successor.log(), "the takeover was unclean"
            await eventually(
                lambda: len(note.read_text().split()) == 16,
                timeout=2 * ttl,
                message="every stuck op running again on the successor",
            )


@pytest.mark.slow
@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_poison_op_behind_slow_ops_is_dead_lettered_and_they_are_not(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """One entry: two slow ops, then an op that kills its worker, on three keys of one shard.
    Each death strikes the first op without a result: a slow op first, which then runs alone
    under the next owner and commits; the killer once both have. It is dead-lettered after
    ``max_strikes`` deaths in a row; the slow ops apply once each and are never dead-lettered.
    (One extra death per slow op ahead of the killer: the price of not running every in-flight
    op alone after a takeover.)"""
    slow_a, slow_b, poison_key = keys_on_shard(1, SHARDS, 3, prefix="behind")
    keys = ShardKeys(namespace, 1)
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
        ):
            workers = [start(redis_url, namespace, lease_ttl=0.5) for _ in range(6)]
            await all_held(client, namespace)
            await append_entry(
                client,
                namespace,
                1,
                [
                    envelope("slow-a", slow_a, "slow_record", 0.2),
                    envelope("slow-b", slow_b, "slow_record", 0.2),
                    envelope("killer", poison_key, "crash"),
                ],
                fresh=True,
            )

            async def killer_settled() -> Any:
                outcome = await stored(client, namespace, 1, "killer")
                if outcome is None and all(each.process.poll() is not None for each in workers):
                    return {"error": {"type": "(every worker died)"}}
                return outcome

            poisoned = await eventually(killer_settled, timeout=40)
            assert poisoned["error"]["type"] == "keyserial.PoisonOperation", poisoned
            assert poisoned["error"]["data"] == {"strikes": 3}
            dead = [worker for worker in workers if worker.process.poll() is not None]
            assert [worker.process.returncode for worker in dead] == [17] * len(dead)
            assert 3 <= len(dead) <= 3 + 2, f"{len(dead)} deaths"
            for op_id, key in (("slow-a", slow_a), ("slow-b", slow_b)):
                assert await stored(client, namespace, 1, op_id) == {"ok": 1}
                assert await ks.read(key) == [op_id]
            letters = await client.xrange(keys.dead)
            assert [json.loads(fields[b"raw"])["id"] for _, fields in letters] == ["killer"]
            assert len(await run_one(ks, poison_key)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_suspect_finishing_as_its_time_alone_ends_commits_its_result_with_its_state(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """After a takeover, the suspect (the op the acquire blamed) runs alone for a lease TTL at
    most. Here it finishes shortly before that time is up, and the step that commits it cannot
    reach Redis until after it: the successor's link holds every byte, then is reset. The
    commit must still land, the op's result together with its state. Giving up on the suspect
    must never give up on a step: the step has taken its batch out of memory, while the
    cache keeps the op's effect, so the next commit of the key wrote the effect with no result
    stored; a client that found the entry gone with no outcome then appended the op again,
    which ran it twice (nemesis seed 3145)."""
    ttl = 4.0
    [key] = keys_on_shard(2, SHARDS, 1, prefix="suspect")
    note, gate = tmp_path / "note", tmp_path / "gate"

    def started() -> int:
        return len(note.read_text().split()) if note.exists() else 0

    proxy = FaultProxy("successor", int(urlsplit(redis_url).port or 0))
    await proxy.start()
    try:
        with anyio.fail_after(90):
            async with (
                inspector(redis_url) as client,
                keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
            ):
                owner = start(redis_url, namespace, lease_ttl=ttl)
                await wait_for_holder(client, namespace, owner.pid, timeout=15)
                await append_entry(
                    client,
                    namespace,
                    2,
                    [envelope("x", key, "gated_append", "x", str(note), str(gate))],
                    fresh=True,
                )
                await eventually(lambda: started() == 1, message="the op running")
                owner.kill()
                successor = start(proxy.url, namespace, lease_ttl=ttl)
                await eventually(
                    lambda: started() == 2,
                    timeout=30,
                    message="the op running alone on the successor",
                )
                alone = time.monotonic()
                # Renewals every 0.5 s: the successor holds its lease through a stall of up to
                # 0.9 lease TTL minus that, here from 0.6 to 1.15 lease TTLs of running alone.
                await anyio.sleep(0.6 * ttl)
                proxy.hold(60)
                gate.touch()  # the suspect finishes; the step carrying it is held
                await anyio.sleep(alone + 1.15 * ttl - time.monotonic())
                proxy.reset()  # what was held is lost
                proxy.heal()
                assert await eventually(lambda: stored(client, namespace, 2, "x"), timeout=20) == {
                    "ok": ["x"]
                }
                state = await run_one(ks, key)  # ["x", the op id of the op run_one submits]
                assert state[0] == "x" and len(state) == 2, state
                assert successor.process.poll() is None, "the successor kept its lease"
                assert "died with entries" in successor.log(), "the takeover was unclean"
    finally:
        await proxy.aclose()


@pytest.mark.slow
async def test_a_takeover_with_every_op_answered_suspects_none_and_says_so(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """The last owner died with an entry in flight whose ops all have outcomes: nothing is
    suspected, and the log says so in words (not "the suspect op (none)")."""
    async with running_worker(redis_url, namespace, shard_count=1):
        pass  # records the namespace
    keys = ShardKeys(namespace, 0)
    async with inspector(redis_url) as client:
        entry = await append_entry(
            client, namespace, 0, [envelope("answered", "k", "deposit", 1)], fresh=False
        )
        await client.hset(keys.results, "answered", '{"ok":1}')
        await client.set(keys.horizon, entry)  # fetched by an owner that died
    worker = start(redis_url, namespace, shards="0", shard_count=1)
    await wait_for_log(worker, "each of their ops answered already: none is suspected")
    assert "(none)" not in worker.log()


async def test_a_server_out_of_memory_is_waited_out_and_blames_no_op(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server at its maxmemory refuses writes (OOM) until memory is freed: a "not now",
    like BUSY. An op whose commit it refuses is committed once the server takes writes again,
    by the same runner: no runner fails, no op takes a strike; and an append it refuses is
    sent again until it lands."""
    with keyserial.testing.LocalServer() as server:
        admin = redis.asyncio.Redis.from_url(server.url)
        keys = ShardKeys(namespace, 0)
        try:
            async with (
                running_worker(server.url, namespace, shard_count=1, apps=["tests.apps"]),
                keyserial.connect(server.url, shards=1, namespace=namespace) as ks,
            ):
                results: list[Any] = []

                async def submit(call: keyserial.Call[Any]) -> None:
                    results.append(await ks.submit("evt:1", call, timeout=30))

                async with anyio.create_task_group() as group:
                    group.start_soon(submit, apps.slow_append("slow", 1.0))
                    await eventually(lambda: _pushed_or_moved_in(admin, keys))
                    await admin.config_set("maxmemory", 1)  # (the op runs for a second more)
                    group.start_soon(submit, apps.append("later"))
                    await eventually(lambda: _oom_retried(caplog), message="a commit's OOM")
                    await admin.config_set("maxmemory", 0)
                assert sorted(results) == [["slow"], ["slow", "later"]]
                assert await ks.read("evt:1") == ["slow", "later"]
        finally:
            await admin.aclose()
    assert "runner failed" not in caplog.text
    assert "strike" not in caplog.text.lower()


async def _pushed_or_moved_in(client: Any, keys: ShardKeys) -> int:
    """The entries waiting in a shard's inbox and stream."""
    return int(await client.llen(keys.inbox)) + int(await client.xlen(keys.stream))


def _oom_retried(caplog: pytest.LogCaptureFixture) -> bool:
    """A runner's commit met OOM, and is sent again."""
    return any(
        "shard 0" in record.getMessage()
        and "maxmemory" in record.getMessage()
        and "retrying" in record.getMessage()
        for record in caplog.records
    )
