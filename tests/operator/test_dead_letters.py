"""``keyserial dead-letters list|show|replay|drop`` through the real command line: replay appends
the ops again under their op ids, so an op that already has an outcome never runs twice and one
that never ran runs once."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import PoisonOperation, ResultNotFound
from keyserial._backend.backend import Backend
from keyserial._scripts.lease import AcquireArgs, LeaseGrant, acquire
from keyserial._wire.codec import dead_letter_envelopes as envelopes
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests import apps
from tests.entries import append_entry, envelope
from tests.helpers import ROOT, Starter, WorkerProcess, keys_on_shard, wait_for_log
from tests.ownership import all_held

SHARDS = 2


async def cli(
    url: str, namespace: str | None, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``python -m keyserial dead-letters ARGS --redis URL --namespace NS`` (no
    ``--namespace`` for None), with ``env`` added to the environment."""
    named = [] if namespace is None else ["--namespace", namespace]
    with anyio.fail_after(30):
        result = await anyio.run_process(
            [sys.executable, "-m", "keyserial", "dead-letters", *args, "--redis", url, *named],
            cwd=ROOT,
            check=False,
            env={**os.environ, **(env or {})},
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def listed(url: str, namespace: str, *args: str) -> list[dict[str, Any]]:
    code, out, err = await cli(url, namespace, "list", "--json", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


async def dead_lettered(client: Any, namespace: str, shard: int, count: int) -> None:
    """Wait until the shard's dead-letter stream holds ``count`` letters."""
    with anyio.fail_after(10):
        while await client.xlen(ShardKeys(namespace, shard).dead) < count:
            await anyio.sleep(0.02)


async def append_raw(client: Any, namespace: str, shard: int, ops: str) -> None:
    """An entry another client wrote wrong, woken at once."""
    keys = ShardKeys(namespace, shard)
    entry = await client.xadd(keys.stream, {"v": "1", "ops": ops})
    await client.publish(keys.wake_channel, entry)


def single_envelope(op_id: str, key: str) -> str:
    """An entry's ``ops`` written as one envelope instead of an array of them: the entry is
    dead-lettered whole and no outcome is stored (the op never ran)."""
    return json.dumps({"id": op_id, "key": key, "op": "record"})


async def ran_then_dead_lettered(
    ks: keyserial.Client, client: Any, url: str, namespace: str, key: str, op_id: str
) -> dict[str, Any]:
    """Run ``record`` under ``op_id`` on ``key`` (of shard 0), then dead-letter a copy of its
    envelope another client wrote wrong; that letter, as ``list --json`` shows it."""
    assert await ks.submit(key, apps.record(), op_id=op_id, timeout=10) == 1
    await append_raw(client, namespace, 0, single_envelope(op_id, key))
    await dead_lettered(client, namespace, 0, 1)
    (letter,) = await listed(url, namespace, "--shard", "0")
    return letter


@pytest.mark.slow
async def test_replaying_an_op_that_never_ran_runs_it_once(redis_url: str, namespace: str) -> None:
    key = keys_on_shard(1, SHARDS, 1)[0]
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            await append_raw(client, namespace, 1, single_envelope("lonely-1", key))
            await dead_lettered(client, namespace, 1, 1)
            with pytest.raises(ResultNotFound):
                await ks.result("lonely-1", key=key)
            (letter,) = await listed(redis_url, namespace)
            assert letter["op_ids"] == ["lonely-1"] and letter["shard"] == 1

            code, out, err = await cli(redis_url, namespace, "replay", letter["id"])
            assert code == 0, err
            assert out.strip().startswith("replayed op 'lonely-1' to shard 1 at inbox place ")
            assert "stored outcome" not in out
            assert await ks.submit(key, apps.peek(), timeout=10) == ["lonely-1"]
            assert await ks.result("lonely-1", key=key) == 1
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_replaying_an_op_that_already_ran_does_not_run_it_again(
    redis_url: str, namespace: str
) -> None:
    key = keys_on_shard(0, SHARDS, 1)[0]
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            letter = await ran_then_dead_lettered(ks, client, redis_url, namespace, key, "done-1")

            code, out, err = await cli(redis_url, namespace, "replay", "--all")
            assert code == 0, err
            assert "replayed op 'done-1' to shard 0 at inbox place" in out
            assert "it has a stored outcome: the worker answers with it and does not run it" in out
            # Ops on a key run in stream order: once this one ran, the replayed one was handled.
            assert await ks.submit(key, apps.peek(), timeout=10) == ["done-1"]
            assert letter["op_ids"] == ["done-1"]
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_replaying_under_new_ids_runs_an_op_again_and_says_so(
    redis_url: str, namespace: str
) -> None:
    """``replay --new-id``: an op that has an outcome already runs again, under a new op id
    derived from its own, printed with the old one."""
    key = keys_on_shard(0, SHARDS, 1)[0]
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            letter = await ran_then_dead_lettered(ks, client, redis_url, namespace, key, "again-1")

            code, out, err = await cli(redis_url, namespace, "replay", "--new-id", letter["id"])
            assert code == 0, err
            replayed = re.fullmatch(
                r"replayed op 'again-1' under the new op id '(again-1\.replay-[0-9a-f]{16})' to"
                r" shard 0 at inbox place \S+ \(it runs again; its outcome is stored under the new"
                r" id\)",
                out.strip(),
            )
            assert replayed is not None, out
            new_id = replayed[1]
            assert await ks.submit(key, apps.peek(), timeout=10) == ["again-1", new_id]
            assert await ks.result(new_id, key=key) == 2
            assert await ks.result("again-1", key=key) == 1
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_replaying_a_poison_op_answers_its_stored_outcome_and_never_runs_it(
    standalone_server: LocalServer, namespace: str, start: Callable[..., WorkerProcess]
) -> None:
    url, key = standalone_server.url, keys_on_shard(0, SHARDS, 1)[0]
    with anyio.fail_after(90):
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            workers = [
                start(url, namespace, shards="0-1", shard_count=SHARDS, lease_ttl=0.5)
                for _ in range(4)
            ]
            for worker in workers:
                await wait_for_log(worker, "serving shards", timeout=15)
            with pytest.raises(PoisonOperation):
                await ks.submit(key, apps.crash(), op_id="crash-op", timeout=30)
            survivors = [worker for worker in workers if worker.process.poll() is None]
            assert len(survivors) == 1

            (letter,) = await listed(url, namespace)
            assert letter["op_ids"] == ["crash-op"] and "poison" in letter["reason"]
            code, out, err = await cli(url, namespace, "replay", letter["id"])
            assert code == 0, err
            assert "it has a stored outcome" in out
            # Behind the replayed entry in the key's order: had the crash run, no worker would
            # be left to run this.
            assert await ks.submit(key, apps.record(), timeout=15) == 1
            assert survivors[0].process.poll() is None, "the replayed poison op ran"
            with pytest.raises(PoisonOperation):
                await ks.result("crash-op", key=key)


@pytest.mark.slow
async def test_dead_letters_are_listed_shown_and_dropped(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    client = redis.asyncio.Redis.from_url(url)
    try:
        async with running_worker(url, namespace, shard_count=SHARDS):
            await append_raw(client, namespace, 0, "{not json")
            await append_raw(client, namespace, 1, json.dumps([{"op": "deposit", "key": "k"}]))
            await dead_lettered(client, namespace, 0, 1)
            await dead_lettered(client, namespace, 1, 1)
        first, second = await listed(url, namespace)
        assert (first["shard"], second["shard"]) == (0, 1)
        assert "not valid JSON" in first["reason"] and first["op_ids"] == []
        assert "no string 'id'" in second["reason"]
        assert await listed(url, namespace, "--shard", "1") == [second]

        code, out, _ = await cli(url, namespace, "show", second["id"], "--shard", "1")
        assert code == 0 and '"op": "deposit"' in out and second["reason"] in out
        code, out, _ = await cli(url, namespace, "replay", second["id"], "--shard", "1")
        assert code == 0 and "skipped from dead letter" in out and "no op id" in out

        code, out, _ = await cli(url, namespace, "drop", first["id"], "--shard", "0")
        assert (code, out.strip()) == (0, "dropped 1 dead letter(s)")
        assert await listed(url, namespace) == [second]
        code, out, _ = await cli(url, namespace, "drop", "--all")
        assert (code, out.strip()) == (0, "dropped 1 dead letter(s)")
        code, out, _ = await cli(url, namespace, "list")
        assert (code, out.strip()) == (0, "no dead letters")
        code, _, err = await cli(url, namespace, "show", first["id"])
        assert code == 1 and "no dead letter with id" in err
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_replay_takes_its_settings_from_the_environment_and_says_what_a_full_backlog_kept_out(
    standalone_server: LocalServer, namespace: str
) -> None:
    """``KEYSERIAL_NAMESPACE`` and ``KEYSERIAL_MAX_BACKLOG`` apply as they do to a worker. A
    letter whose ops route to two shards, the second full: the first shard's op is pushed to its
    inbox and reported, the second's is not, and the error says which."""
    url = standalone_server.url
    async with running_worker(url, namespace, shard_count=SHARDS):
        pass  # records the shard count
    here, full = keys_on_shard(0, SHARDS, 1)[0], keys_on_shard(1, SHARDS, 1)[0]
    ops = [
        {"id": "to-0", "key": here, "op": "deposit", "args": [1]},
        {"id": "to-1", "key": full, "op": "deposit", "args": [1]},
    ]
    client = redis.asyncio.Redis.from_url(url)
    try:
        await client.xadd(ShardKeys(namespace, 1).stream, {"v": "1", "ops": "[]"})
        await client.xadd(
            ShardKeys(namespace, 0).dead,
            {
                "entry": "1-0",
                "reason": "test",
                "raw": json.dumps({"v": "1", "ops": json.dumps(ops)}),
            },
        )
        env = {"KEYSERIAL_NAMESPACE": namespace, "KEYSERIAL_MAX_BACKLOG": "1"}
        code, out, err = await cli(url, None, "replay", "--all", env=env)
        assert code == 1, err
        assert out.startswith("replayed op 'to-0' to shard 0 at inbox place ")
        assert "shard 1's backlog is full" in err and "'to-1'" in err
        assert "the ops above were" in err
        assert await client.llen(ShardKeys(namespace, 0).inbox) == 1
        assert await client.llen(ShardKeys(namespace, 1).inbox) == 0
        assert await client.xlen(ShardKeys(namespace, 1).stream) == 1
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("raw", "ops", "skipped"),
    [
        # A poison op's envelope, as the server's cjson re-encodes it: [] comes back as {}.
        (
            '{"id":"p","key":"k","op":"x","args":{}}',
            [{"id": "p", "key": "k", "op": "x", "args": []}],
            [],
        ),
        # An unreadable entry's fields: ops as an array, or as one envelope.
        (
            '{"v":"2","ops":"[{\\"id\\":\\"a\\"},{\\"op\\":\\"x\\"}]"}',
            [{"id": "a"}],
            ['no op id: {"op": "x"}'],
        ),
        ('{"v":"1","ops":"{\\"id\\":\\"b\\"}"}', [{"id": "b"}], []),
        ('{"v":"1","ops":"{nope"}', [], ["the entry's ops are not JSON"]),
        # An element with no op id.
        ("7", [], ["no op id: 7"]),
    ],
)
def test_the_ops_of_each_kind_of_dead_letter_are_recovered(
    raw: str, ops: list[dict[str, Any]], skipped: list[str]
) -> None:
    assert envelopes(raw) == (ops, skipped)


@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_the_acquire_that_dead_letters_an_op_publishes_no_reply(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """One output gate: the acquire script stores the poison op's outcome but does not reply.
    The new owner's replay answers from the stored outcome through its step, so that with
    durable_replicas the caller hears only what the replicas have. (A sentinel published after
    the acquire must be the first message on the caller's channel.)"""
    keys = ShardKeys(namespace, 0)
    reply = f"ks:{namespace}:reply:victim"
    poison = {**envelope("poison", "k", "crash"), "reply": reply}
    entry = await append_entry(client, namespace, 0, [poison], fresh=False)
    await client.set(keys.horizon, entry)
    await client.hset(keys.suspect, mapping={"op": "poison", "strikes": 2})
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(reply)
        grant = await backend.run_call(acquire(keys, AcquireArgs("owner", 5000, 3, "a-1")))
        assert isinstance(grant, LeaseGrant) and grant.poisoned == "poison"
        await client.publish(reply, "sentinel")
        with anyio.fail_after(5):
            while (
                message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            ) is None:
                pass
    assert message["data"] == b"sentinel"
    assert b"PoisonOperation" in (await client.hget(keys.results, "poison") or b"")


@pytest.mark.slow
@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_an_unknown_op_beside_a_poison_op_is_never_struck_twice_nor_dead_lettered(
    redis_url: str, client: redis.asyncio.Redis, namespace: str, start: Starter
) -> None:
    """An op no worker knows shares an entry with an op that kills its worker. The unknown op
    is answered without a stored outcome, but recorded as answered: after the first death (it
    came first, and its answer had not committed yet) no takeover strikes it again, so it is
    never dead-lettered and its id stays free for a resubmit once it is deployed, while the
    killer is dead-lettered after max_strikes deaths of its own."""
    key = keys_on_shard(0, 4, 1, "poisoned")[0]
    keys = ShardKeys(namespace, 0)
    workers = [start(redis_url, namespace, lease_ttl=0.5) for _ in range(5)]
    await all_held(client, namespace)
    await append_entry(
        client,
        namespace,
        0,
        [envelope("unknown", key, "not_deployed_yet"), envelope("killer", key, "crash")],
        fresh=False,
    )
    with anyio.fail_after(60):
        while not await client.hexists(keys.results, "killer"):
            await anyio.sleep(0.05)
    assert json.loads(await client.hget(keys.results, "killer") or b"{}")["error"]["data"] == {
        "strikes": 3
    }
    assert not await client.hexists(keys.results, "unknown")
    assert await client.hexists(keys.results, "unknown#u")
    dead = [worker.process.returncode for worker in workers if worker.process.poll() is not None]
    assert dead == [17, 17, 17, 17]


@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_poison_op_whose_arguments_json_cannot_carry_is_dead_lettered_all_the_same(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """cjson reads 1e400 as infinity and cannot write it back: the dead letter's copy of the
    envelope must not fail the acquire (its writes before the error would stay, and every
    later acquire of the shard would fail the same way)."""
    keys = ShardKeys(namespace, 0)
    entry = await client.xadd(
        keys.stream, {"v": "1", "ops": '[{"id":"poison","key":"k","op":"crash","args":[1e400]}]'}
    )
    await client.set(keys.horizon, entry)
    await client.hset(keys.suspect, mapping={"op": "poison", "strikes": 2})
    grant = await backend.run_call(acquire(keys, AcquireArgs("owner", 5000, 3, "a-1")))
    assert isinstance(grant, LeaseGrant) and grant.poisoned == "poison"
    ((_, letter),) = await client.xrange(keys.dead)
    assert json.loads(letter[b"raw"])["id"] == "poison"
    assert b"PoisonOperation" in (await client.hget(keys.results, "poison") or b"")
