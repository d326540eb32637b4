"""The step script's rules for timers, one by one: it fires only what is due by Redis's clock,
in the order of due times then ids, each once, never on a sealed shard or under an epoch that
moved on, and tells the owner when the next one is due."""

from __future__ import annotations

import json

import pytest
import redis.asyncio

from keyserial._backend.backend import Backend
from keyserial._scripts.commit import StepCommit, step
from keyserial._scripts.refusals import Fenced
from keyserial._scripts.submit import SubmitArgs, submit
from keyserial._wire.resharding import sealed_key
from keyserial.testing import ShardKeys
from tests.entries import envelope, step_args


async def _server_ms(client: redis.asyncio.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds * 1000 + micros // 1000)


async def _timer(
    client: redis.asyncio.Redis, keys: ShardKeys, place: int, due_ms: int, key: str = "k"
) -> None:
    timer_id = f"{place:016d}"
    await client.zadd(keys.timers, {timer_id: due_ms})
    ops = json.dumps([envelope(f"op-{place}", key, "deposit", 1)])
    await client.hset(keys.timed, timer_id, f"1 fresh\n{ops}")


@pytest.fixture
def keys(namespace: str) -> ShardKeys:
    return ShardKeys(namespace, 0)


async def test_a_step_fires_what_is_due_in_order_and_says_when_the_next_is_due(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 2)
    now = await _server_ms(client)
    # (Places 9 and 10 are due in the same millisecond: 9 was pushed first.)
    for place, due in [(10, now - 5), (9, now - 5), (3, now - 50), (4, now + 60_000)]:
        await _timer(client, keys, place, due)
    fetched = await backend.run_call(step(keys, step_args(2, fetch=10)))
    assert [fields[b"p"] for _, fields in fetched.entries] == [b"3", b"9", b"10"]
    assert fetched.entries[0][1][b"due"] == str(now - 50).encode()
    assert fetched.entries[0][1][b"fresh"] == b"1"
    assert fetched.next_timer_ms is not None and 59_000 < fetched.next_timer_ms <= 60_000
    assert await client.zrange(keys.timers, 0, -1) == [b"0000000000000004"]
    assert await client.hkeys(keys.timed) == [b"0000000000000004"]
    cursor = fetched.entries[-1][0]
    again = await backend.run_call(step(keys, step_args(2, fetch=10, cursor=cursor)))
    assert again.entries == [], "each fired once"


async def test_a_step_fires_at_most_what_it_fetches_and_says_more_are_due(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 2)
    now = await _server_ms(client)
    for place in range(1, 6):
        await _timer(client, keys, place, now - 10)
    fetched = await backend.run_call(step(keys, step_args(2, fetch=3)))
    assert [fields[b"p"] for _, fields in fetched.entries] == [b"1", b"2", b"3"]
    assert fetched.next_timer_ms == 0


async def test_a_step_that_does_not_fetch_fires_nothing(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 2)
    await _timer(client, keys, 1, await _server_ms(client) - 10)
    fetched = await backend.run_call(step(keys, step_args(2, fetch=0)))
    assert fetched.next_timer_ms is None
    assert await client.zcard(keys.timers) == 1 and await client.xlen(keys.stream) == 0


async def test_a_sealed_shard_fires_no_timer(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    """(A reshard moves its timers to the new layout's shards.)"""
    await client.set(keys.epoch, 2)
    await client.set(sealed_key(keys), '{"to":[1,8],"last":"0-0"}')
    await _timer(client, keys, 1, await _server_ms(client) - 10)
    fetched = await backend.run_call(step(keys, step_args(2, fetch=10)))
    assert fetched.entries == [] and fetched.sealed is not None
    assert await client.zcard(keys.timers) == 1 and await client.xlen(keys.stream) == 0


async def test_a_step_under_an_epoch_that_moved_on_fires_nothing(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 3)
    await _timer(client, keys, 1, await _server_ms(client) - 10)
    with pytest.raises(Fenced):
        await backend.run_call(step(keys, step_args(2, fetch=10)))
    assert await client.zcard(keys.timers) == 1 and await client.xlen(keys.stream) == 0


async def test_a_delayed_item_moved_out_of_the_inbox_waits_as_a_timer_under_its_place(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 2)
    due = await _server_ms(client) + 60_000
    ops = json.dumps([envelope("later", "k", "deposit", 1)])
    await client.rpush(keys.inbox, f"1\n{ops}", f"1 fresh at {due}\n{ops}")
    fetched = await backend.run_call(step(keys, step_args(2, fetch=10)))
    assert [fields[b"p"] for _, fields in fetched.entries] == [b"1"]
    assert await client.zrange(keys.timers, 0, -1, withscores=True) == [(b"0000000000000002", due)]
    assert await client.hget(keys.timed, "0000000000000002") == f"1 fresh\n{ops}".encode()
    assert fetched.taken == 2 and await client.llen(keys.inbox) == 0


@pytest.mark.parametrize("due", ["soon", "-5", "+", "1000000000000000", "+1000000000000000"])
async def test_the_submit_script_refuses_a_due_time_it_cannot_read_and_pushes_nothing(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys, due: str
) -> None:
    ops = json.dumps([envelope("x", "k", "deposit", 1)])
    args = SubmitArgs(0, "1", ops, "", False, due)
    with pytest.raises(Exception, match="due time of at most 15 digits"):
        await backend.run_call(submit(keys, args))
    assert await client.llen(keys.inbox) == 0


async def test_the_submit_script_marks_an_item_due_later_and_answers_its_due_time(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    ops = json.dumps([envelope("x", "k", "deposit", 1)])
    now = await _server_ms(client)
    later = await backend.run_call(submit(keys, SubmitArgs(0, "1", ops, "", True, "+5000")))
    assert later.delayed and later.due_ms == later.at_ms + 5000
    absolute = await backend.run_call(submit(keys, SubmitArgs(0, "1", ops, "", False, "1000")))
    assert not absolute.delayed and absolute.due_ms == absolute.at_ms >= now  # (due already)
    assert await client.lrange(keys.inbox, 0, -1) == [
        f"1 fresh at {later.due_ms}\n{ops}".encode(),
        f"1\n{ops}".encode(),
    ]


async def test_a_commit_sets_its_ops_timers_and_cancels_others_storing_their_answer(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    await client.set(keys.epoch, 2)
    await client.xadd(keys.stream, {"v": "1", "ops": "[]"}, id="1-1")
    await _timer(client, keys, 7, await _server_ms(client) + 60_000)
    await client.zadd(keys.timers, {"ran#t1": 1})
    await client.hset(keys.results, "ran#t1", '{"ok":1}')  # (it ran before the cancel)
    ops = json.dumps([envelope("setter#t1", "k", "deposit", 1)])
    commit = StepCommit.of(
        results=[("setter", '{"ok":null}')],
        timers=[("setter#t1", 5000, f"1\n{ops}")],
        cancelled=[(f"{7:016d}", '{"error":1}'), ("ran#t1", '{"error":1}')],
    )
    now = await _server_ms(client)
    await backend.run_call(step(keys, step_args(2, progress="1-1", cursor="1-1"), commit=commit))
    [(timer_id, due)] = await client.zrange(keys.timers, 0, -1, withscores=True)
    assert timer_id == b"setter#t1" and now + 5000 <= due <= now + 5000 + 1000
    assert await client.hget(keys.timed, "setter#t1") == f"1\n{ops}".encode()
    assert await client.hget(keys.results, f"{7:016d}") == b'{"error":1}'
    assert await client.hget(keys.results, "ran#t1") == b'{"ok":1}', "an outcome stays"


async def test_a_timer_an_op_set_fires_marked_as_one(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    """(Its entry may carry an op id with '#': see the worker's intake.)"""
    await client.set(keys.epoch, 2)
    ops = json.dumps([envelope("setter#t1", "k", "deposit", 1)])
    await client.zadd(keys.timers, {"setter#t1": 1})
    await client.hset(keys.timed, "setter#t1", f"1\n{ops}")
    fetched = await backend.run_call(step(keys, step_args(2, fetch=10)))
    [(_, fields)] = fetched.entries
    assert fields[b"timer"] == b"1" and fields[b"p"] == b"setter#t1"
    assert b"fresh" not in fields, "its op id is looked up: a cancel may have answered it"


async def test_delayed_items_that_came_due_in_the_inbox_fire_in_due_order_with_the_timers(
    backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys
) -> None:
    """(Pushed while the shard had no owner: by its first step they are all due, and their
    push order is not their due order.)"""
    await client.set(keys.epoch, 2)
    now = await _server_ms(client)
    await _timer(client, keys, 1, now - 10)  # (moved in before the owner died)
    ops = json.dumps([envelope("x", "k", "deposit", 1)])
    await client.set(keys.inbox_taken, 1)
    await client.rpush(keys.inbox, f"1 at {now - 5}\n{ops}", f"1 at {now - 20}\n{ops}")
    fetched = await backend.run_call(step(keys, step_args(2, fetch=10)))
    assert [fields[b"p"] for _, fields in fetched.entries] == [b"3", b"1", b"2"]
    assert [int(fields[b"due"]) for _, fields in fetched.entries] == [now - 20, now - 10, now - 5]
