"""Wake-ups that carry the entry (docs/wire-format.md, pushes): a fresh entry travels to the
shard's owner in its wake-up with its place in the shard's inbox, and the owner takes it in
without fetching it, only where that place follows on from the last item it took; its next step
confirms that the inbox holds it first, as pushed, and moves it into the stream. An owner
records that it takes pushes before it takes any; a takeover from such an owner, and its
release, move the whole inbox into the stream and count every entry there as fetched, and a
takeover from one that took none counts nothing more than it fetched."""

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
from keyserial._scripts.commit import StepReply, step
from keyserial._scripts.lease import AcquireArgs, LeaseGrant, ReleaseArgs, acquire, release
from keyserial._scripts.refusals import PushUnconfirmed
from keyserial._scripts.submit import Pushed, SubmitArgs, submit
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import envelope, inbox_item, push_item, step_args, stored
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


def item_of(op_id: str, *, fresh: bool = True) -> bytes:
    """The inbox item of :func:`appended`'s entry."""
    return inbox_item([envelope(op_id, "k", "deposit", 1)], fresh=fresh).encode()


async def appended(backend: Backend, keys: ShardKeys, op_id: str, *, fresh: bool = True) -> str:
    """An entry of one deposit, pushed to the inbox as a client pushes it; its place."""
    call = submit(keys, SubmitArgs(0, "1", ops_of(op_id), keys.wake_channel, fresh=fresh))
    pushed = await backend.run_call(call)
    assert isinstance(pushed, Pushed)
    return pushed.place


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
    pushed: tuple[str, list[bytes]] = ("", []),
    takes_pushes: bool = False,
) -> StepReply:
    """A step of the owner that fetches after ``cursor`` (committing nothing), having taken in
    ``pushed`` from pushes (the place of the first item, and the items as pushed, each kept:
    moved into the stream), recording that it takes pushes or not."""
    place, items = pushed
    taken = f"{place} {'1' * len(items)}" if place else ""
    args = step_args(epoch, cursor=cursor, pushed=taken, takes_pushes=takes_pushes)
    return await backend.run_call(step(keys, args, pushed=items))


def fetched(reply: StepReply) -> list[str]:
    return [entry_id for entry_id, _ in reply.entries]


async def stream_entries(client: redis.asyncio.Redis, keys: ShardKeys) -> list[tuple[str, str]]:
    """The shard's stream entries: each its id and its place (field ``p``)."""
    return [
        (entry_id.decode(), fields[b"p"].decode())
        for entry_id, fields in await client.xrange(keys.stream)
    ]


async def test_a_fresh_entry_is_pushed_with_its_place_in_the_inbox(
    backend: Backend, client: redis.asyncio.Redis, wake_ups: PubSub, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    assert await appended(backend, keys, "first") == "1"  # the inbox was empty
    assert await next_message(wake_ups) == b"push 1 " + item_of("first")
    assert await appended(backend, keys, "second") == "2"
    assert await next_message(wake_ups) == b"push 2 " + item_of("second")
    # An entry that is not fresh is announced by its place alone, and counts.
    assert await appended(backend, keys, "second", fresh=False) == "3"
    assert await next_message(wake_ups) == b"3"
    assert await appended(backend, keys, "third") == "4"
    assert (await next_message(wake_ups)).startswith(b"push 4 1 fresh\n")
    # An item pushed without the script counts too.
    raw = await push_item(client, namespace, 0, [envelope("raw", "k", "deposit", 1)], fresh=True)
    assert raw == 5
    assert await appended(backend, keys, "fourth") == "6"
    assert (await next_message(wake_ups)).startswith(b"push 6 1 fresh\n")
    # Places go on from the items the owner moved into the stream.
    epoch = (await owned(backend, keys)).epoch
    assert len(fetched(await stepped(backend, keys, epoch, "0-0"))) == 6
    assert await client.llen(keys.inbox) == 0
    assert [place for _, place in await stream_entries(client, keys)] == list("123456")
    assert await appended(backend, keys, "fifth") == "7"
    assert await next_message(wake_ups) == b"push 7 " + item_of("fifth")


async def test_an_append_goes_out_fresh_only_where_it_is_sent_once(
    backend: Backend, wake_ups: PubSub, namespace: str, request: pytest.FixtureRequest
) -> None:
    """A fresh entry's owner looks none of its op ids up, so it must land once: ``append``
    keeps it fresh (pushed) on keyserial's own connection to a standalone server, which never
    sends a command again, and sends it unmarked (announced by its place) where redis-py's
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
            if pushed:
                assert message == f"push {entry.place} 1 fresh\n{ops_of('op')}".encode()
            else:
                assert message == entry.place.encode()
    finally:
        await passed.aclose()
        await passed.transport.client.aclose()


async def test_a_step_moves_the_pushed_entries_in_and_raises_the_horizon_to_them(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys)).epoch
    assert fetched(await stepped(backend, keys, epoch, "0-0", takes_pushes=True)) == []
    assert await client.get(keys.pushes) == str(epoch).encode()
    place = await appended(backend, keys, "pushed")
    reply = await stepped(backend, keys, epoch, "0-0", pushed=(place, [item_of("pushed")]))
    assert fetched(reply) == []
    [pushed] = reply.moved
    assert await stream_entries(client, keys) == [(pushed, place)]
    assert await client.llen(keys.inbox) == 0
    assert reply.taken == int(await client.get(keys.inbox_taken) or 0) == 1
    assert await client.get(keys.horizon) == pushed.encode()
    # One it fetched after the pushed one comes later: the horizon goes to it.
    place = await appended(backend, keys, "later")
    await appended(backend, keys, "last")
    reply = await stepped(backend, keys, epoch, pushed, pushed=(place, [item_of("later")]))
    [later] = reply.moved
    [last] = fetched(reply)
    assert [entry_id for entry_id, _ in await stream_entries(client, keys)] == [
        pushed,
        later,
        last,
    ]
    assert await client.get(keys.horizon) == last.encode()


async def test_a_step_whose_pushed_items_are_not_first_in_the_inbox_writes_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push is a hint: the step compares the items it was pushed with the inbox's first items,
    whole, before it commits or moves anything."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys)).epoch
    await stepped(backend, keys, epoch, "0-0", takes_pushes=True)
    await appended(backend, keys, "first")
    second = await appended(backend, keys, "second")
    for place, items in (
        (second, [item_of("second")]),  # not first
        ("1", [item_of("first", fresh=False)]),  # not as pushed
        ("1", [item_of("first"), item_of("second"), item_of("third")]),  # more than it holds
    ):
        with pytest.raises(PushUnconfirmed):
            await stepped(backend, keys, epoch, "0-0", pushed=(place, items))
    assert await client.lrange(keys.inbox, 0, -1) == [item_of("first"), item_of("second")]
    assert await client.get(keys.inbox_taken) is None
    assert await client.xlen(keys.stream) == 0
    assert await client.get(keys.horizon) is None


async def test_a_takeover_counts_every_entry_as_fetched_if_the_dead_owner_took_pushes(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The owner may have run a pushed entry's op (and committed it, or died of it) before any
    write of its own: the next owner moves the inbox into the stream, looks the op's outcome
    up, and suspects it."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "dead")).epoch
    assert fetched(await stepped(backend, keys, epoch, "0-0", takes_pushes=True)) == []
    place = await appended(backend, keys, "pushed")
    await client.delete(keys.lease)  # the owner died; its lease ran out
    grant = await owned(backend, keys, "next")
    [(pushed, moved_place)] = await stream_entries(client, keys)
    assert moved_place == place
    assert await client.llen(keys.inbox) == 0
    assert grant.replay_until == pushed
    assert grant.careful_until == pushed
    assert grant.suspect == "pushed"
    assert await client.get(keys.horizon) == pushed.encode()
    assert await client.get(keys.pushes) is None  # (until the new owner records itself)


async def test_a_takeover_from_an_owner_that_took_no_pushes_suspects_only_what_it_fetched(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An owner that died before it took pushes (or one of an older version) cannot have run
    an entry it never fetched: the next owner neither replays nor suspects it, and leaves it in
    the inbox for its own fetch."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "dead")).epoch
    await appended(backend, keys, "fetched")
    [entry] = fetched(await stepped(backend, keys, epoch, "0-0"))
    await appended(backend, keys, "never fetched")
    await client.delete(keys.lease)
    grant = await owned(backend, keys, "next")
    assert (grant.replay_until, grant.careful_until, grant.suspect) == (entry, entry, "fetched")
    assert await client.lrange(keys.inbox, 0, -1) == [item_of("never fetched")]


async def test_a_clean_release_covers_what_was_pushed_and_stops_counting(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A drain that gave up on a pushed op still hands it over as fetched (the release moves
    the inbox into the stream); an entry pushed after the release is not counted: the owner
    that is gone took nothing more."""
    keys = ShardKeys(namespace, 0)
    epoch = (await owned(backend, keys, "me")).epoch
    assert fetched(await stepped(backend, keys, epoch, "0-0", takes_pushes=True)) == []
    await appended(backend, keys, "pushed")
    assert await backend.run_call(release(keys, ReleaseArgs("me", clean=True)))
    [(pushed, _)] = await stream_entries(client, keys)
    assert await client.get(keys.horizon) == await client.get(keys.handover) == pushed.encode()
    assert await client.get(keys.pushes) is None
    await appended(backend, keys, "after")
    grant = await owned(backend, keys, "next")
    assert (grant.replay_until, grant.careful_until, grant.suspect) == (pushed, None, None)
    assert await client.lrange(keys.inbox, 0, -1) == [item_of("after")]


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


async def next_place(client: redis.asyncio.Redis, keys: ShardKeys) -> int:
    """The place the next item pushed to the shard's inbox takes."""
    return int(await client.get(keys.inbox_taken) or 0) + await client.llen(keys.inbox) + 1


async def test_a_forged_push_is_run_but_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push is a hint. The owner runs a pushed entry whose place follows on from the last
    item it took at once (this one is in no inbox: only the push can have brought it), but the
    step that would commit it finds the inbox does not hold it, writes nothing, and the owner
    gives the shard up to start again from what Redis has. A push that does not follow on is
    not taken at all."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        epoch = int(await client.get(keys.epoch) or 0)
        place = await next_place(client, keys)
        for at, op_id in ((place + 100, "elsewhere"), (place, "forged")):
            ops = json.dumps([envelope(op_id, "k", "deposit", 10)])
            await client.publish(keys.wake_channel, f"push {at} 1 fresh\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 101
        assert await ks.submit("k", deposit(1)) == 102
        assert await stored(client, namespace, 0, "forged") is None
        assert await stored(client, namespace, 0, "elsewhere") is None
        assert int(await client.get(keys.epoch) or 0) > epoch, "the forged push was not taken"


async def test_a_push_that_claims_a_place_far_past_the_inbox_is_never_taken(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push naming a place past every item pushed so far does not follow on from the last
    item the owner took: it is not run, its owner keeps the shard, and every later op still
    runs, at the place it was pushed to."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        epoch = await client.get(keys.epoch)
        ops = json.dumps([envelope("forged", "k", "deposit", 10)])
        await client.publish(keys.wake_channel, f"push 99999999999999 1 fresh\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 101
        assert await ks.submit("k", deposit(1)) == 102
        assert int(await client.get(keys.inbox_taken) or 0) == 3
        assert await stored(client, namespace, 0, "forged") is None
        assert await client.get(keys.epoch) == epoch, "the far push was taken"


async def test_a_push_of_a_real_place_with_other_ops_is_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push that names a real item's place, but carries other ops, is refused at the commit:
    the ops the inbox holds run, and the pushed ones never commit."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        real = await push_item(
            client, namespace, 0, [envelope("real", "k", "deposit", 10)], fresh=True
        )
        ops = json.dumps([envelope("swapped", "k", "deposit", 1000)])
        await client.publish(keys.wake_channel, f"push {real} 1 fresh\n{ops}")
        assert await ks.submit("k", deposit(100), timeout=30) == 111
        assert await stored(client, namespace, 0, "real") == {"ok": 11}
        assert await stored(client, namespace, 0, "swapped") is None


async def test_a_push_that_marks_a_real_item_fresh_is_never_committed(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A push of a real item that was not pushed fresh (a resubmit's, whose outcome must be
    looked up) claims it is: the pushed item is the real one with the fresh mark added. The
    step compares items whole, so it refuses, the owner starts again from the inbox, and the op
    runs once, from the entry as Redis holds it."""
    keys = ShardKeys(namespace, 0)
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        epoch = int(await client.get(keys.epoch) or 0)
        plain = [envelope("plain", "k", "deposit", 10)]
        real = await push_item(client, namespace, 0, plain, fresh=False)
        await client.publish(keys.wake_channel, f"push {real} {inbox_item(plain, fresh=True)}")
        assert await ks.submit("k", deposit(100), timeout=30) == 111
        assert await stored(client, namespace, 0, "plain") == {"ok": 11}
        assert int(await client.get(keys.epoch) or 0) > epoch, "the push was confirmed"


async def test_an_entry_pushed_without_a_wake_up_is_never_skipped_by_a_push(
    redis_url: str, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An item pushed with a plain RPUSH and no PUBLISH takes the place after the last item the
    owner took, so the next push does not follow on: the owner fetches both, rather than
    taking the push and skipping it. (idle_poll is long, so only the chain's break can bring
    the plain item in.)"""
    async with (
        running_worker(redis_url, namespace, shards="0", shard_count=1, idle_poll=60),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1)) == 1
        await push_item(client, namespace, 0, [envelope("plain", "k", "deposit", 10)], fresh=True)
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
