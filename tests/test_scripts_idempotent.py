"""Every script keyserial may send twice (its reply lost to a reset or a timeout, so the caller
cannot tell "not executed" from "executed") gives the same answer the second time and writes
nothing more. Each test sends the call as the runtime builds it, twice."""

from __future__ import annotations

import json

import pytest
import redis.asyncio

import keyserial
from keyserial._backend import Backend
from keyserial._commit_scripts import CommitAcrossArgs, ShardWrites, commit_across
from keyserial._cross_scripts import DecideArgs, Decided, GrantArgs, decide, grant
from keyserial._lease_scripts import AcquireArgs, LeaseGrant, acquire
from keyserial._refusals import Fenced, RequestGone
from keyserial.testing import ShardKeys, running_worker
from tests.entries import envelope
from tests.helpers import keys_on_shard, stored_outcome

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


async def acquired(
    backend: Backend, keys: ShardKeys, token: str, attempt: str
) -> LeaseGrant | None:
    return await backend.run_call(acquire(keys, AcquireArgs(token, 5000, 3, attempt)))


async def test_an_acquire_sent_again_by_its_owner_returns_the_same_grant_and_no_strike(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """After a crash (horizon past progress), the acquire strikes the first unfinished op. Its
    reply lost, the same worker asks again: same epoch, same grant, no second strike."""
    keys = ShardKeys(namespace, 0)
    entry = await client.xadd(keys.stream, {"v": "1", "ops": json.dumps(
        [{"id": "suspect", "key": "k", "op": "record"}])})
    await client.set(keys.horizon, entry)
    first = await acquired(backend, keys, "me", "try-1")
    again = await acquired(backend, keys, "me", "try-1")
    assert again == first
    assert first is not None
    assert first.suspect == "suspect", "the grant names the struck op: the new owner runs it alone"
    assert await client.get(keys.epoch) == b"1"
    assert await client.hgetall(keys.suspect) == {b"op": b"suspect", b"strikes": b"1"}
    for token, attempt in (("other", "try-1"), ("me", "try-2")):
        # Another worker, or a new attempt of this one (its old runner's calls may still land),
        # gets nothing while the lease lives.
        assert await acquired(backend, keys, token, attempt) is None


async def test_a_grant_request_left_unfinished_by_a_crash_is_never_a_suspect(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A grant request waits for its coordinator and runs no code: the op behind it takes the
    strike, and a grant request can never be dead-lettered."""
    keys = ShardKeys(namespace, 2)
    grant = {"id": "x#1", "keys": ["k"], "op": "keyserial.grant",
             "kwargs": {"home": 0, "op": "x", "attempt": 1, "channel": "c"}}
    await client.xadd(keys.stream, {"v": "1", "ops": json.dumps([grant])})
    entry = await client.xadd(keys.stream, {"v": "1", "ops": json.dumps(
        [{"id": "after", "key": "k2", "op": "record"}])})
    await client.set(keys.horizon, entry)
    for strike in (1, 2, 3):
        await client.delete(keys.lease)
        await acquired(backend, keys, f"w{strike}", "a")
    assert await client.hget(keys.suspect, "op") == b"after"
    dead = await client.xrange(keys.dead)
    assert [json.loads(fields[b"raw"])["id"] for _, fields in dead] == ["after"]


async def test_a_grant_for_a_request_whose_entry_is_gone_is_refused_and_records_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A participant holds the keys at its grant request's place in the stream. If a failover
    lost that entry (its coordinator appends the request again, perhaps behind another request
    for the same keys), a grant sent there, as a resend after the failover would be, must not
    be recorded: the coordinator would compute on keys held out of the stream's new order."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 1)
    kept = (await client.xadd(keys.stream, {"v": "1", "ops": "[]"})).decode()
    lost = (await client.xadd(keys.stream, {"v": "1", "ops": "[]"})).decode()
    await client.xdel(keys.stream, lost)  # as the promoted replica never had it
    granted = GrantArgs(epoch=1, field="kept#1#g", grant='{"s": []}', channel="",
                        entry_id=kept)
    await backend.run_call(grant(keys, granted))
    assert await client.hget(keys.results, "kept#1#g") == b'{"s": []}'
    with pytest.raises(RequestGone, match=lost):
        await backend.run_call(grant(keys, GrantArgs(
            epoch=1, field="lost#1#g", grant='{"s": []}', channel="", entry_id=lost)))
    assert not await client.hexists(keys.results, "lost#1#g")


async def test_a_grant_under_an_epoch_that_moved_on_is_refused_and_records_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A zombie participant (its epoch is over) cannot grant: nothing is recorded or sent."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    entry = (await client.xadd(keys.stream, {"v": "1", "ops": "[]"})).decode()
    with pytest.raises(Fenced):
        await backend.run_call(grant(keys, GrantArgs(
            epoch=1, field="op#1#g", grant='{"s": []}', channel="", entry_id=entry)))
    assert not await client.hexists(keys.results, "op#1#g")


async def test_a_decide_sent_again_after_it_won_reports_the_win(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 7)
    call = decide(keys, DecideArgs(7, "op", 7, '{"w":{}}', [("a", "5")], '{"ok":5}', []))
    assert await backend.run_call(call) == Decided(won=True)
    await client.hset(keys.state, "a", "6")  # a later op moved the key on
    assert await backend.run_call(call) == Decided(won=True)
    assert await client.hget(keys.state, "a") == b"6", "the second call wrote nothing"


async def test_a_decide_never_wins_over_an_abort(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 7)
    abort = '{"abort":"the coordinator lost the home shard"}'
    await client.hset(keys.results, "op#7#d", abort)
    reply = await backend.run_call(
        decide(keys, DecideArgs(7, "op", 7, '{"w":{}}', [], '{"ok":5}', [])))
    assert reply == Decided(won=False, abort=abort)


async def test_a_commit_across_sent_again_after_it_landed_writes_nothing_more(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Sent again after a lost reply, when a participant has changed hands meanwhile, it must
    not answer ELSEWHERE (the caller would run the op again through grants): it landed."""
    home, other = ShardKeys(namespace, 0), ShardKeys(namespace, 1)
    await client.set(home.epoch, 3)
    await client.set(other.epoch, 4)
    call = commit_across(CommitAcrossArgs("op", '{"ok":1}', "[]", [
        ShardWrites(home, 3, [("a", "9")]), ShardWrites(other, 4, [("b", "11")])]))
    assert call.args == ["op", '{"ok":1}', "[]", 3, '[["a","9"]]', 4, '[["b","11"]]']
    await backend.run_call(call)  # committed (a refusal would raise)
    await client.incr(other.epoch)  # the participant shard changed hands
    await client.hset(other.state, "b", "12")  # and its new owner moved b on
    await backend.run_call(call)  # committed: ELSEWHERE would raise
    assert await client.hget(other.state, "b") == b"12"
    assert await client.hget(home.results, "op") == b'{"ok":1}'


async def test_reserved_op_names_and_ids_are_refused(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """A client cannot submit keyserial's own grant op, and a worker refuses a foreign entry
    whose op id holds '#' (coordination records are named with it) or a forged grant."""
    with pytest.raises(ValueError, match="keyserial"):
        keyserial.call("keyserial.grant", home=0)

    key = keys_on_shard(0, 4, 1, prefix="reserved")[0]
    forged = {"id": "victim", "keys": [key], "op": "keyserial.grant",
              "kwargs": {"home": 0, "op": "x", "attempt": 1, "channel": "c"}}
    async with running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]), \
            keyserial.connect(redis_url, shards=4, namespace=namespace) as ks:
        with pytest.raises(ValueError, match="keyserial's own"):
            await ks.submit(key, keyserial.Call("keyserial.grant"))
        await client.xadd(ShardKeys(namespace, 0).stream, {"v": "1", "ops": json.dumps(
            [envelope("a#1#d", key, "record"), forged])})
        with pytest.raises(keyserial.MalformedOperation, match="reserved"):
            await stored_outcome(ks, "a#1#d", key)
        with pytest.raises(keyserial.MalformedOperation, match="grant request"):
            await stored_outcome(ks, "victim", key)
        assert await ks.submit(key, keyserial.call("record"), timeout=10) == 1
