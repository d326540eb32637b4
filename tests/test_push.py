"""Wake-ups that carry the entry (docs/wire-format.md, the wake-up marker): the first fresh entry
appended to an idle shard is pushed to its owner, which runs it without fetching it. A push is
only ever the next entry of the stream, the owner takes it only at that place, and whatever reads
the horizon next (a step, a release, a takeover) counts a pushed entry as fetched."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio
from redis.asyncio.client import PubSub

import keyserial
from keyserial import PoisonOperation
from keyserial._backend import Backend
from keyserial._commit_scripts import StepArgs, step
from keyserial._lease_scripts import AcquireArgs, LeaseGrant, ReleaseArgs, acquire, release
from keyserial._submit_scripts import SubmitArgs, submit
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import append_entry, envelope, stored
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


async def appended(backend: Backend, keys: ShardKeys, op_id: str) -> str:
    """A fresh entry of one deposit, appended as a client appends it."""
    ops = json.dumps([envelope(op_id, "k", "deposit", 1)])
    call = submit(keys, SubmitArgs(0, "1", ops, keys.wake_channel, fresh=True))
    return (await backend.run_call(call)).decode()


async def owned(backend: Backend, keys: ShardKeys, attempt: str = "a") -> LeaseGrant:
    grant = await backend.run_call(acquire(keys, AcquireArgs(attempt, 5000, 3, attempt)))
    assert grant is not None
    return grant


async def fetched(backend: Backend, keys: ShardKeys, epoch: int, cursor: str,
                  pushed_to: str = "", *, busy: bool = False) -> list[str]:
    """The entry ids a step of the owner fetches after ``cursor`` (committing nothing), having
    taken in ``pushed_to`` from a push, knowing the marker ``busy`` already or not."""
    reply = await backend.run_call(step(keys, StepArgs(
        epoch=epoch, progress="", rotate=False, cursor=cursor, fetch=10, commit="",
        replaying=False, result_ttl_ms=60_000, trim_to="", trim_now=False, states_held=True,
        pushed_to=pushed_to, busy=busy,
    )))
    return [entry_id for entry_id, _ in reply.entries]


async def test_the_first_entry_for_an_idle_owner_is_pushed_and_the_rest_need_no_wake_up(
    backend: Backend, client: redis.asyncio.Redis, wake_ups: PubSub, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys)).epoch
    first = await appended(backend, keys, "before")  # no marker yet: a plain wake-up
    assert await next_message(wake_ups) == first.encode()
    assert await fetched(backend, keys, epoch, "0-0") == [first]
    assert await client.get(keys.wakeup) == b"busy"
    assert await fetched(backend, keys, epoch, first) == []
    assert await client.get(keys.wakeup) == f"idle {first}".encode()

    pushed = await appended(backend, keys, "pushed")
    ops = json.dumps([envelope("pushed", "k", "deposit", 1)])
    assert await next_message(wake_ups) == f"push {first} {pushed} 1\n{ops}".encode()
    assert await client.get(keys.wakeup) == f"pushed {pushed}".encode()
    assert await client.get(keys.horizon) == first.encode()

    # The owner took it in; its next fetch raises the horizon to it and finds the next entry,
    # which was announced by its id (the marker no longer said idle).
    later = await appended(backend, keys, "later")
    assert await next_message(wake_ups) == later.encode()
    assert await fetched(backend, keys, epoch, pushed) == [later]
    assert await client.get(keys.horizon) == later.encode()
    # Busy: an append sends nothing (the next message is the test's own).
    quiet = await appended(backend, keys, "quiet")
    await client.publish(keys.wake_channel, "mark")
    assert await next_message(wake_ups) == b"mark"
    # An owner that knows the marker says busy leaves it alone (here: expired meanwhile).
    await client.delete(keys.wakeup)
    assert await fetched(backend, keys, epoch, pushed, busy=True) == [later, quiet]
    assert await client.get(keys.wakeup) is None
    # A step of an owner that took a push in raises the horizon to it, fetching nothing.
    assert await fetched(backend, keys, epoch, later) == [quiet]
    assert await fetched(backend, keys, epoch, quiet) == []
    again = await appended(backend, keys, "again")
    assert (await next_message(wake_ups)).startswith(f"push {quiet} {again} ".encode())
    assert await fetched(backend, keys, epoch, again, pushed_to=again) == []
    assert await client.get(keys.horizon) == again.encode()
    assert await client.get(keys.wakeup) == f"idle {again}".encode()


async def test_an_entry_appended_without_the_script_is_never_skipped_by_a_push(
    backend: Backend, client: redis.asyncio.Redis, wake_ups: PubSub, namespace: str
) -> None:
    """An appender that does not read the marker (XADD, or an older client's script) puts an
    entry after the idle owner's cursor: the next append is then announced by its id, not
    pushed, so the owner fetches both."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys)).epoch
    assert await fetched(backend, keys, epoch, "0-0") == []
    assert await client.get(keys.wakeup) == b"idle 0-0"
    raw = await append_entry(client, namespace, 0, [envelope("raw", "k", "deposit", 1)],
                             fresh=True)
    entry = await appended(backend, keys, "scripted")
    assert await next_message(wake_ups) == entry.encode()
    assert await fetched(backend, keys, epoch, "0-0") == [raw, entry]


async def test_a_takeover_treats_an_entry_pushed_to_the_dead_owner_as_fetched(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The owner may have run the pushed entry's op (and committed it, or died of it) before
    any write of its own: the next owner looks its outcome up, and suspects it."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "dead")).epoch
    assert await fetched(backend, keys, epoch, "0-0") == []
    pushed = await appended(backend, keys, "pushed")
    assert await client.get(keys.wakeup) == f"pushed {pushed}".encode()
    await client.delete(keys.lease)  # the owner died; its lease ran out
    grant = await owned(backend, keys, "next")
    assert grant.replay_until == pushed
    assert grant.careful_until == pushed
    assert grant.suspect == "pushed"
    assert await client.get(keys.horizon) == pushed.encode()


async def test_a_clean_release_covers_a_pushed_entry_and_drops_the_marker(
    backend: Backend, client: redis.asyncio.Redis, wake_ups: PubSub, namespace: str
) -> None:
    """A drain that gave up on a pushed op still hands it over as fetched; an entry appended
    after the release is announced by its id, never pushed to the owner that is gone."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "me")).epoch
    assert await fetched(backend, keys, epoch, "0-0") == []
    pushed = await appended(backend, keys, "pushed")
    assert (await next_message(wake_ups)).startswith(b"push ")
    assert await backend.run_call(release(keys, ReleaseArgs("me", clean=True)))
    assert await client.get(keys.horizon) == await client.get(keys.handover) == pushed.encode()
    assert await client.get(keys.wakeup) is None
    after = await appended(backend, keys, "after")
    assert await next_message(wake_ups) == after.encode()
    grant = await owned(backend, keys, "next")
    assert (grant.replay_until, grant.careful_until, grant.suspect) == (pushed, None, None)


async def test_a_worker_takes_a_push_only_at_its_own_cursor(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The worker runs a pushed entry without fetching it (this one is in no stream, so only
    the push can have brought it), and ignores one that is not next to its cursor."""
    keys = ShardKeys(namespace, 0)
    async with (running_worker(redis_url, namespace, shards="0", shard_count=1),
                keyserial.connect(redis_url, shards=1, namespace=namespace) as ks):
        assert await ks.submit("k", deposit(1)) == 1
        with anyio.fail_after(5):
            while not (marker := await client.get(keys.wakeup) or b"").startswith(b"idle "):
                await anyio.sleep(0.01)
        cursor = marker.decode().split(" ")[1]
        ms, seq = map(int, cursor.split("-"))
        for after, op_id in (("1-0", "elsewhere"), (cursor, "next")):
            ops = json.dumps([envelope(op_id, "k", "deposit", 10)])
            await client.publish(keys.wake_channel, f"push {after} {ms}-{seq + 1} 1\n{ops}")
        assert await ks.submit("k", deposit(100)) == 111
        assert await stored(client, namespace, 0, "next") == {"ok": 11}
        assert await stored(client, namespace, 0, "elsewhere") is None


async def test_a_pushed_op_that_kills_its_worker_is_struck_at_every_death(
    redis_url: str, client: redis.asyncio.Redis, namespace: str, start: Starter
) -> None:
    """A fresh op appended to an idle shard goes to its owner in the wake-up and kills it before
    any write of the owner's: the takeover must count it as fetched, or the death costs it no
    strike. With four workers it is dead-lettered after max_strikes (3) deaths; one more would
    leave no worker to answer the caller. (On a cluster a client's appends are not fresh, since
    redis-py may send one twice: the op is fetched, not pushed, and the count is the same.)"""
    key = "poison:pushed"
    with anyio.fail_after(60):
        async with keyserial.connect(redis_url, shards=4, namespace=namespace) as ks:
            workers = [start(redis_url, namespace, lease_ttl=0.5) for _ in range(4)]
            await all_held(client, namespace)
            assert await ks.submit(key, deposit(1)) == 1
            wakeup = ShardKeys(namespace, ks.shard_of(key)).wakeup
            while not (await client.get(wakeup) or b"").startswith(b"idle "):
                await anyio.sleep(0.01)
            with pytest.raises(PoisonOperation) as poisoned:
                await ks.submit(key, apps.crash(), timeout=50)  # its own op id: fresh, pushed
            assert poisoned.value.data["strikes"] == 3
            dead = [worker.process.returncode for worker in workers
                    if worker.process.poll() is not None]
            assert dead == [17, 17, 17]
            assert await ks.submit(key, deposit(1)) == 2
