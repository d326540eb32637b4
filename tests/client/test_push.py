"""Wake-ups that carry the entry (docs/wire-format.md, pushes): a fresh entry travels to the
shard's owner in its wake-up, naming the entry that stood last in the stream before it, and the
owner takes it in without fetching it, only where it follows on from its cursor. An owner
records that it takes pushes before it takes any; a takeover from such an owner, and its
release, count every entry in the stream as fetched, and a takeover from one that took none
counts nothing more than it fetched."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio
from redis.asyncio.client import PubSub

import keyserial
from keyserial import PoisonOperation
from keyserial._backend.backend import Backend
from keyserial._scripts.commit import step
from keyserial._scripts.lease import AcquireArgs, LeaseGrant, ReleaseArgs, acquire, release
from keyserial._scripts.submit import SubmitArgs, submit
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import append_entry, envelope, step_args, stored
from tests.helpers import Starter
from tests.ownership import all_held

pytestmark = pytest.mark.parametrize("redis_url", ["standalone", "cluster"], indirect=True)


@pytest.fixture
async def wake_ups(redis_url: str, namespace: str) -> AsyncIterator[PubSub]:
    """Shard 0's wake channel, subscribed (one node is enough: PUBLISH reaches every node)."""
    node = redis.asyncio.Redis.from_url(redis_url)
    pubsub = node.pubsub()
    await pubsub.subscribe(ShardKeys(namespace, 0).wake_channel)
    await next_message(pubsub)  # the confirmation
    yield pubsub
    await pubsub.aclose()
    await node.aclose()


async def next_message(pubsub: PubSub) -> bytes:
    with anyio.fail_after(5):
        while True:
            message = await pubsub.get_message(timeout=1)
            if message is not None:
                data: bytes = message["data"] if message["type"] == "message" else b""
                return data


def ops_of(op_id: str) -> str:
    return json.dumps([envelope(op_id, "k", "deposit", 1)])


async def appended(backend: Backend, keys: ShardKeys, op_id: str, *, fresh: bool = True) -> str:
    """An entry of one deposit, appended as a client appends it."""
    call = submit(keys, SubmitArgs(0, "1", ops_of(op_id), keys.wake_channel, fresh=fresh))
    return (await backend.run_call(call)).decode()


async def owned(backend: Backend, keys: ShardKeys, attempt: str = "a") -> LeaseGrant:
    grant = await backend.run_call(acquire(keys, AcquireArgs(attempt, 5000, 3, attempt)))
    assert isinstance(grant, LeaseGrant)
    return grant


async def stepped(
    backend: Backend,
    keys: ShardKeys,
    epoch: int,
    cursor: str,
    *,
    pushed_to: str = "",
    takes_pushes: bool = False,
) -> list[str]:
    """The entry ids a step of the owner fetches after ``cursor`` (committing nothing), having
    taken in ``pushed_to`` from a push, recording that it takes pushes or not."""
    reply = await backend.run_call(
        step(
            keys,
            step_args(epoch, cursor=cursor, pushed_to=pushed_to, takes_pushes=takes_pushes),
        )
    )
    return [entry_id for entry_id, _ in reply.entries]


async def test_a_fresh_entry_is_pushed_naming_the_entry_before_it(
    backend: Backend, client: redis.asyncio.Redis, wake_ups: PubSub, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    first = await appended(backend, keys, "first")  # the stream was empty
    assert await next_message(wake_ups) == f"push - {first} 1\n{ops_of('first')}".encode()
    second = await appended(backend, keys, "second")
    assert await next_message(wake_ups) == f"push {first} {second} 1\n{ops_of('second')}".encode()
    # An entry that is not fresh is announced by its id, and the next push names it.
    again = await appended(backend, keys, "second", fresh=False)
    assert await next_message(wake_ups) == again.encode()
    third = await appended(backend, keys, "third")
    assert (await next_message(wake_ups)).startswith(f"push {again} {third} 1\n".encode())
    # An entry appended without the script stands between too.
    raw = await append_entry(client, namespace, 0, [envelope("raw", "k", "deposit", 1)], fresh=True)
    fourth = await appended(backend, keys, "fourth")
    assert (await next_message(wake_ups)).startswith(f"push {raw} {fourth} 1\n".encode())


async def test_an_append_goes_out_fresh_only_where_it_is_sent_once(
    backend: Backend, wake_ups: PubSub, namespace: str, request: pytest.FixtureRequest
) -> None:
    """A fresh entry's owner looks none of its op ids up, so it must land once: ``append``
    keeps it fresh (pushed) on keyserial's own connection to a standalone server, which never
    sends a command again, and sends it unmarked (announced by its id) where redis-py's
    connections serve, which may: a cluster's, or a client the caller passed in."""
    keys = ShardKeys(namespace, 0)
    standalone = "standalone" in request.node.callspec.id
    passed = await Backend.connect(
        redis.asyncio.Redis.from_url(request.getfixturevalue("redis_url"))
    )
    try:
        for through, pushed in ((backend, standalone), (passed, False)):
            args = SubmitArgs(0, "1", ops_of("op"), keys.wake_channel, fresh=True)
            [entry] = await through.append([(keys, args)])
            message = await next_message(wake_ups)
            assert message.startswith(b"push ") == pushed
            assert entry.decode() in message.decode()
    finally:
        await passed.aclose()
        await passed.transport.client.aclose()


async def test_a_step_raises_the_horizon_to_the_pushed_entry_it_took(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys)).epoch
    assert await stepped(backend, keys, epoch, "0-0", takes_pushes=True) == []
    assert await client.get(keys.pushes) == str(epoch).encode()
    pushed = await appended(backend, keys, "pushed")
    assert await stepped(backend, keys, epoch, pushed, pushed_to=pushed) == []
    assert await client.get(keys.horizon) == pushed.encode()
    # One it fetched after the pushed one comes later: the horizon goes to it.
    later = await appended(backend, keys, "later")
    assert await stepped(backend, keys, epoch, later, pushed_to=later) == []
    last = await appended(backend, keys, "last")
    assert await stepped(backend, keys, epoch, later, pushed_to=later) == [last]
    assert await client.get(keys.horizon) == last.encode()


async def test_a_takeover_counts_every_entry_as_fetched_if_the_dead_owner_took_pushes(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The owner may have run a pushed entry's op (and committed it, or died of it) before any
    write of its own: the next owner looks its outcome up, and suspects it."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "dead")).epoch
    assert await stepped(backend, keys, epoch, "0-0", takes_pushes=True) == []
    pushed = await appended(backend, keys, "pushed")
    await client.delete(keys.lease)  # the owner died; its lease ran out
    grant = await owned(backend, keys, "next")
    assert grant.replay_until == pushed
    assert grant.careful_until == pushed
    assert grant.suspect == "pushed"
    assert await client.get(keys.horizon) == pushed.encode()
    assert await client.get(keys.pushes) is None  # (until the new owner records itself)


async def test_a_takeover_from_an_owner_that_took_no_pushes_suspects_only_what_it_fetched(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An owner that died before it took pushes (or one of an older version) cannot have run
    an entry it never fetched: the next owner neither replays nor suspects it."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "dead")).epoch
    fetched = await appended(backend, keys, "fetched")
    assert await stepped(backend, keys, epoch, "0-0") == [fetched]
    await appended(backend, keys, "never fetched")
    await client.delete(keys.lease)
    grant = await owned(backend, keys, "next")
    assert (grant.replay_until, grant.careful_until, grant.suspect) == (fetched, fetched, "fetched")


async def test_a_clean_release_covers_what_was_pushed_and_stops_counting(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A drain that gave up on a pushed op still hands it over as fetched; an entry appended
    after the release is not counted: the owner that is gone took nothing more."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "me")).epoch
    assert await stepped(backend, keys, epoch, "0-0", takes_pushes=True) == []
    pushed = await appended(backend, keys, "pushed")
    assert await backend.run_call(release(keys, ReleaseArgs("me", clean=True)))
    assert await client.get(keys.horizon) == await client.get(keys.handover) == pushed.encode()
    assert await client.get(keys.pushes) is None
    await appended(backend, keys, "after")
    grant = await owned(backend, keys, "next")
    assert (grant.replay_until, grant.careful_until, grant.suspect) == (pushed, None, None)


async def test_a_worker_records_that_it_takes_pushes_before_it_takes_any(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        assert await client.get(keys.pushes) == await client.get(keys.epoch)


async def test_a_forged_push_is_run_but_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push is a hint. The owner runs a pushed entry that follows on from its cursor at once
    (this one is in no stream: only the push can have brought it), but the step that would
    commit it finds the stream does not hold it, writes nothing, and the owner gives the shard
    up to start again from what Redis has. A push that does not follow on is not taken at all."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        epoch = int(await client.get(keys.epoch) or 0)
        cursor = (await client.get(keys.horizon) or b"").decode()  # the entry it took last
        ms, seq = map(int, cursor.split("-"))
        for after, op_id in (("1-0", "elsewhere"), (cursor, "forged")):
            ops = json.dumps([envelope(op_id, "k", "deposit", 10)])
            await client.publish(keys.wake_channel, f"push {after} {ms}-{seq + 1} 1\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 101
        assert await ks.submit("k", deposit(1)) == 102
        assert await stored(client, namespace, 0, "forged") is None
        assert await stored(client, namespace, 0, "elsewhere") is None
        assert int(await client.get(keys.epoch) or 0) > epoch, "the forged push was not taken"


async def test_a_push_that_claims_the_largest_id_does_not_stop_the_shard(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push naming '-' (an empty stream) and an entry id past every real one is taken, and
    refused at the commit: progress never moves past the entries Redis holds, so every later
    op still runs, on this owner and any other."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        ops = json.dumps([envelope("forged", "k", "deposit", 10)])
        await client.publish(keys.wake_channel, f"push - 99999999999999-0 1\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 101
        assert await ks.submit("k", deposit(1)) == 102
        for marker in (keys.progress, keys.horizon):
            assert (await client.get(marker) or b"").split(b"-")[0] != b"99999999999999"
        assert await stored(client, namespace, 0, "forged") is None


async def test_a_push_with_the_fields_of_a_real_entry_changed_is_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push that names a real entry's id, but carries other ops, is refused at the commit:
    the ops the stream holds run, and the pushed ones never commit."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        cursor = (await client.get(keys.horizon) or b"").decode()
        real = await append_entry(
            client, namespace, 0, [envelope("real", "k", "deposit", 10)], fresh=True
        )
        ops = json.dumps([envelope("swapped", "k", "deposit", 1000)])
        await client.publish(keys.wake_channel, f"push {cursor} {real} 1\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 111
        assert await stored(client, namespace, 0, "real") == {"ok": 11}
        assert await stored(client, namespace, 0, "swapped") is None


async def test_a_push_that_adds_a_field_to_a_real_entry_is_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push of a real entry that was not appended fresh (a resubmit's, whose outcome must be
    looked up) claims it is: the pushed fields are the entry's and one more. The step compares
    every field and their number, so it refuses, the owner starts again from the stream, and
    the op runs once, from the entry as Redis holds it."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        epoch = int(await client.get(keys.epoch) or 0)
        cursor = (await client.get(keys.horizon) or b"").decode()
        ops = json.dumps([envelope("plain", "k", "deposit", 10)])
        real = await client.xadd(keys.stream, {"v": "1", "ops": ops})  # (not fresh)
        await client.publish(keys.wake_channel, f"push {cursor} {real.decode()} 1\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 111
        assert await stored(client, namespace, 0, "plain") == {"ok": 11}
        assert int(await client.get(keys.epoch) or 0) > epoch, "the push was confirmed"


async def test_an_entry_appended_without_a_wake_up_is_never_skipped_by_a_push(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An entry appended with a plain XADD and no PUBLISH stands between the owner's cursor
    and the next push: the owner fetches both, rather than taking the push and skipping it.
    (idle_poll is long, so only the chain's break can bring the plain entry in.)"""
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        await append_entry(
            client, namespace, 0, [envelope("plain", "k", "deposit", 10)], fresh=True
        )
        assert await ks.submit("k", deposit(100)) == 111
        assert await stored(client, namespace, 0, "plain") == {"ok": 11}


@pytest.mark.slow
async def test_a_pushed_op_that_kills_its_worker_is_struck_at_every_death(
    redis_url: str, client: redis.asyncio.Redis, namespace: str, start: Starter
) -> None:
    """A fresh op goes to its owner in its wake-up and kills it before any write of the
    owner's: the takeover must count it as fetched, or the death costs it no strike. With four
    workers it is dead-lettered after max_strikes (3) deaths; one more would leave no worker to
    answer the caller. (On a cluster a client's appends are not fresh, since redis-py may send
    one twice: the op is fetched, not pushed, and the count is the same.)"""
    key = "poison:pushed"
    with anyio.fail_after(60):
        async with keyserial.connect(redis_url, shards=4, namespace=namespace) as ks:
            workers = [start(redis_url, namespace, lease_ttl=0.5) for _ in range(4)]
            await all_held(client, namespace)
            assert await ks.submit(key, deposit(1)) == 1
            keys = ShardKeys(namespace, ks.shard_of(key))
            assert await client.get(keys.pushes) == await client.get(keys.epoch)
            with pytest.raises(PoisonOperation) as poisoned:
                await ks.submit(key, apps.crash(), timeout=50)  # its own op id: fresh, pushed
            assert poisoned.value.data["strikes"] == 3
            dead = [
                worker.process.returncode for worker in workers if worker.process.poll() is not None
            ]
            assert dead == [17, 17, 17]
            assert await ks.submit(key, deposit(1)) == 2
