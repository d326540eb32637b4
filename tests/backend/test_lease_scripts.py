"""The lease scripts act for the lease's holder only, and a release fences its holder out: a
zombie (an owner frozen past its lease, whose shard another worker took) can neither free the
new owner's lease, nor hear that it still owns, nor write after it gave the shard up."""

from __future__ import annotations

import pytest
import redis.asyncio

from keyserial._backend.backend import Backend
from keyserial._scripts.commit import step
from keyserial._scripts.lease import (
    AcquireArgs,
    LeaseGrant,
    ReleaseArgs,
    RenewArgs,
    acquire,
    release,
    renew,
)
from keyserial._scripts.refusals import Fenced, StreamRestarted
from keyserial._wire.codec import LARGEST_ID
from keyserial.testing import ShardKeys
from tests.entries import step_args

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)

TTL_MS = 60_000


async def _owned(backend: Backend, keys: ShardKeys, token: str) -> LeaseGrant:
    grant = await backend.run_call(acquire(keys, AcquireArgs(token, TTL_MS, 3, f"{token}-1")))
    assert isinstance(grant, LeaseGrant)
    return grant


async def _taken_over(backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys) -> None:
    """The zombie's lease expires (as if it froze past it), and "new" takes the shard."""
    await client.delete(keys.lease)
    await _owned(backend, keys, "new")


@pytest.mark.slow
async def test_a_zombie_s_release_leaves_the_new_owner_s_lease_and_epoch_alone(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    await _owned(backend, keys, "zombie")
    await _taken_over(backend, client, keys)
    epoch = await client.get(keys.epoch)
    for clean in (True, False):
        assert not await backend.run_call(release(keys, ReleaseArgs("zombie", clean=clean)))
    assert await client.get(keys.lease) == b"new"
    assert await client.get(keys.epoch) == epoch


async def test_a_zombie_s_renewal_is_told_it_no_longer_owns_and_extends_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    await _owned(backend, keys, "zombie")
    await _taken_over(backend, client, keys)
    await client.pexpire(keys.lease, 5_000)
    assert not await backend.run_call(renew(keys, RenewArgs("zombie", TTL_MS)))
    assert 0 < await client.pttl(keys.lease) <= 5_000
    assert await backend.run_call(renew(keys, RenewArgs("new", TTL_MS)))
    assert await client.pttl(keys.lease) > 5_000


async def test_a_step_that_lands_after_its_owner_s_release_is_fenced(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A drain that gave up cancels its runner, whose last step may still be on its way: once
    the release is in, the step is refused, so it can neither commit nor lower the horizon
    the release handed over."""
    keys = ShardKeys(namespace, 0)
    epoch = (await _owned(backend, keys, "me")).epoch
    first = (await client.xadd(keys.stream, {"v": "1", "ops": "[]"})).decode()
    await client.xadd(keys.stream, {"v": "1", "ops": "[]"})
    await client.set(keys.horizon, "9999999999999-0")
    assert await backend.run_call(release(keys, ReleaseArgs("me", clean=True)))
    late = step(keys, step_args(epoch, progress=first))
    with pytest.raises(Fenced):
        await backend.run_call(late)
    assert await client.get(keys.horizon) == b"9999999999999-0"
    assert await client.get(keys.progress) is None


async def test_a_stream_emptied_after_an_entry_under_the_largest_id_starts_again(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A sealed shard forwards what follows its seal and deletes it, so its progress never
    reaches an entry a client user XADDed there under the largest id: once its owner has taken
    that entry in and the stream is empty, the step starts the stream again, and the grant
    requests of the old shards still draining go in again (else the move waits for ever)."""
    keys = ShardKeys(namespace, 0)
    await client.xadd(keys.stream, {"v": "1", "ops": "[]"}, id=LARGEST_ID)
    await client.xdel(keys.stream, LARGEST_ID)
    with pytest.raises(redis.exceptions.ResponseError, match="exhausted"):
        await client.xadd(keys.stream, {"v": "1", "ops": "[]"})
    epoch = (await _owned(backend, keys, "me")).epoch
    await client.set(keys.progress, "1-1")
    with pytest.raises(StreamRestarted):
        await backend.run_call(step(keys, step_args(epoch, cursor=LARGEST_ID)))
    assert await client.get(keys.progress) is None
    assert await client.xadd(keys.stream, {"v": "1", "ops": "[]"})


async def test_nothing_is_fetched_or_replayed_after_the_largest_id_and_nothing_fails(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An entry a client user XADDed under the largest id there is, run or forwarded: a step
    whose cursor is that id fetches nothing, and a takeover whose horizon is that id finds no
    op to suspect after it (an XRANGE that starts after it is an error in Redis, not an empty
    range: the shard's runner, or its acquire, failed at every try)."""
    keys = ShardKeys(namespace, 0)
    await client.xadd(keys.stream, {"v": "1", "ops": "[]"}, id=LARGEST_ID)
    epoch = (await _owned(backend, keys, "me")).epoch
    fetched = await backend.run_call(
        step(keys, step_args(epoch, cursor=LARGEST_ID, replaying=True))
    )
    assert fetched.entries == []
    await client.set(keys.horizon, LARGEST_ID)
    await client.set(keys.progress, "0-1")
    assert await backend.run_call(release(keys, ReleaseArgs("me", clean=False)))
    await _owned(backend, keys, "next")  # (its replay reads up to the horizon: no error)
