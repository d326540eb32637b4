"""G3: clients push entries to a shard's inbox, and only its owner's scripts move them into the
stream: a step moves what its owner took in from pushes (and what it fetches), a seal moves the
inbox in before it names the last entry before it, and progress passes a pushed entry only once
its ops have finished."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

import keyserial
from keyserial._backend.backend import Backend
from keyserial._scripts.commit import step
from keyserial._scripts.refusals import PushUnconfirmed
from keyserial._scripts.reshard import seal
from keyserial._scripts.submit import Pushed, present
from keyserial._wire.codec import LARGEST_ID, parse_id
from keyserial._wire.layout import Layout
from keyserial._wire.resharding import Move, Seal, sealed_key
from keyserial.errors import BackendUnavailable
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests import apps
from tests.entries import step_args
from tests.helpers import eventually, submit_quietly
from tests.ownership import inspector


def _item(op_id: str, key: str) -> str:
    envelope = {"id": op_id, "key": key, "op": "deposit", "args": [1]}
    return "1\n" + json.dumps([envelope])


@contextlib.asynccontextmanager
async def _scripts_and_client(redis_url: str) -> AsyncIterator[tuple[Backend, Any]]:
    """keyserial's backend, to run its scripts as a worker would, and a plain client to set up
    and read the shard's keys."""
    backend = await Backend.connect(redis_url)
    try:
        async with inspector(redis_url) as client:
            yield backend, client
    finally:
        await backend.aclose()


async def test_a_seal_moves_the_inbox_into_the_stream_before_it_names_the_last_entry(
    redis_url: str, namespace: str
) -> None:
    """What a shard's inbox holds when a reshard seals it was pushed before the seal: it is
    moved into the stream, in order, each entry with its place, and the seal names the last of
    them, so the shard's owner runs those ops there instead of forwarding them past the seal."""
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old = move.source.keys(0)
    async with _scripts_and_client(redis_url) as (backend, client):
        await client.set(old.inbox_taken, 7)
        await client.rpush(old.inbox, _item("a", "k"), _item("b", "k"), "not an item")
        record = Seal.decode(namespace, await backend.run_call(seal(old, move)))
        entries = await client.xrange(old.stream)
        assert await client.llen(old.inbox) == 0
        assert await client.get(old.inbox_taken) == b"10"
        assert [fields.get(b"p") for _, fields in entries] == [b"8", b"9", b"10"]
        assert [json.loads(fields[b"ops"])[0]["id"] for _, fields in entries[:2]] == ["a", "b"]
        assert entries[2][1][b"raw"] == b"not an item"
        assert record.last == entries[-1][0].decode()
        assert await client.exists(sealed_key(old)) == 1


@contextlib.asynccontextmanager
async def _one_shard_taking_pushes(
    redis_url: str, namespace: str
) -> AsyncIterator[tuple[Any, keyserial.Client, TaskGroup]]:
    """A plain client, a client and a task group, beside a worker owning the namespace's one
    shard that takes pushes (a first op has gone through); the group is cancelled at the end."""
    with anyio.fail_after(60):
        async with (
            inspector(redis_url) as client,
            running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
            anyio.create_task_group() as group,
        ):
            await ks.submit("warm", deposit(1))  # (pushes are taken from now on)
            yield client, ks, group
            group.cancel_scope.cancel()


async def _gated_entries(client: Any, keys: ShardKeys) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The stream's entries of ``apps.gated_hold`` ops."""
    entries = await client.xrange(keys.stream)
    return [entry for entry in entries if b"gated_hold" in entry[1].get(b"ops", b"")]


async def _progress_reached(client: Any, keys: ShardKeys, entry_id: bytes) -> bool:
    progress = await client.get(keys.progress)
    return progress is not None and parse_id(progress.decode()) >= parse_id(entry_id.decode())


async def test_progress_never_passes_a_pushed_entry_whose_op_still_runs(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A step moves a pushed entry into the stream while its op still runs: progress stays
    below it, however many pushed entries behind it commit, so that a takeover runs it again.
    Once it has finished, progress passes it."""
    note, gate = tmp_path / "running", tmp_path / "gate"
    keys = ShardKeys(namespace, 0)
    async with _one_shard_taking_pushes(redis_url, namespace) as (client, ks, group):
        group.start_soon(submit_quietly, ks, "stuck", apps.gated_hold(str(gate), str(note)))
        await eventually(note.exists, message="the stuck op running")
        for n in range(20):
            await ks.submit(f"other:{n % 3}", deposit(1))
        ((stuck_id, _),) = await _gated_entries(client, keys)
        assert not await _progress_reached(client, keys, stuck_id)
        gate.touch()
        await ks.submit("other:0", deposit(1))
        await eventually(
            lambda: _progress_reached(client, keys, stuck_id),
            message="progress past the finished op's entry",
        )


async def test_a_pushed_entry_whose_op_runs_on_moves_into_the_stream_though_nothing_steps(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """The step that confirms an entry taken in from a push comes with the next commit; where
    none comes (its op runs on, and nothing else finishes), the worker's poll brings one, which
    moves the entry into the stream while its op still runs: an operator sees it waiting there,
    aged."""
    note, gate = tmp_path / "running", tmp_path / "gate"
    keys = ShardKeys(namespace, 0)
    async with _one_shard_taking_pushes(redis_url, namespace) as (client, ks, group):
        done = anyio.Event()

        async def stuck() -> None:
            await ks.submit("stuck", apps.gated_hold(str(gate), str(note)))
            done.set()

        group.start_soon(stuck)
        await eventually(note.exists, message="the stuck op running")
        moved = await eventually(lambda: _gated_entries(client, keys), message="moved in")
        ((entry_id, fields),) = moved
        assert fields[b"p"] == b"2"
        assert await client.llen(keys.inbox) == 0
        assert not done.is_set()  # (its op still runs)
        gate.touch()
        await done.wait()
        assert await _progress_reached(client, keys, entry_id)


async def test_the_sweep_finds_an_entry_in_the_inbox_or_moved_in_by_its_place(
    redis_url: str, namespace: str
) -> None:
    """``present.lua``, the sweep's look for the entry of an op whose reply is overdue: an item
    is there while the inbox holds its place; once moved in, while the stream holds the entry
    of its place, looked for from the time it was pushed, behind the items then ahead of it. A
    place the inbox never reached, or whose entry has left the stream, is gone."""
    keys = ShardKeys(namespace, 0)
    async with _scripts_and_client(redis_url) as (backend, client):
        await client.set(keys.inbox_taken, 3)
        ids = [await client.xadd(keys.stream, {"v": "1", "p": str(p)}) for p in (2, 3)]
        await client.rpush(keys.inbox, _item("x", "k"), _item("y", "k"))
        since = parse_id(ids[0].decode())[0]
        asked = [
            Pushed("2", since, 0),  # moved in, its entry there
            Pushed("3", since, 1),  # moved in, behind the one ahead of it
            Pushed("4", since, 0),  # in the inbox
            Pushed("5", since, 1),  # in the inbox
            Pushed("6", since, 2),  # past the inbox: lost
            Pushed("1", since, 0),  # moved in, and its entry gone (committed, or lost)
        ]
        assert await backend.run_call(present(keys, asked)) == [
            True,
            True,
            True,
            True,
            False,
            False,
        ]
        await client.xdel(keys.stream, ids[0])
        assert await backend.run_call(present(keys, asked[:1])) == [False]


async def test_a_keys_queued_ops_include_those_still_in_the_inbox(
    redis_url: str, namespace: str
) -> None:
    """The dashboard's queued ops of a shard (``Backend.queued``): the stream's entries past
    progress, then the inbox's items not moved in yet, each named by its place; an item not of
    the wire format's form is left out."""
    keys = ShardKeys(namespace, 0)
    async with _scripts_and_client(redis_url) as (backend, client):
        moved = await client.xadd(keys.stream, {"v": "1", "ops": "[]", "p": "5"})
        await client.set(keys.inbox_taken, 5)
        await client.rpush(keys.inbox, _item("x", "k"), "garbage", _item("y", "k"))
        found = await backend.queued(keys, 10)
        assert [name for name, _ in found] == [moved, b"inbox 6", b"inbox 8"]
        assert [fields.get(b"ops") for _, fields in found][1:] == [
            json.dumps([{"id": op_id, "key": "k", "op": "deposit", "args": [1]}]).encode()
            for op_id in ("x", "y")
        ]
        assert len(await backend.queued(keys, 2)) == 2


async def test_a_step_sent_again_after_its_reply_was_lost_moves_its_pushed_items_once(
    redis_url: str, namespace: str
) -> None:
    """A step is sent again when its reply was lost: the items its owner took in from pushes
    are then in the stream already, right after its cursor, each with its place. It takes
    them as moved, moving nothing twice; an entry there that is not the pushed item as it was
    moved in confirms nothing (``UNCONFIRMED``, nothing written)."""
    keys = ShardKeys(namespace, 0)
    items = [_item("a", "k").encode(), _item("b", "k").encode()]
    async with _scripts_and_client(redis_url) as (backend, client):
        await client.set(keys.epoch, 1)
        await client.rpush(keys.inbox, *items)
        call = step(keys, step_args(1, pushed="1 11", fetch=0), pushed=items)
        first = await backend.run_call(call)
        again = await backend.run_call(call)
        assert len(first.moved) == 2 and again.moved == first.moved
        assert await client.xlen(keys.stream) == 2
        assert await client.get(keys.inbox_taken) == b"2"
        # Another item pushed in the same place: not the one the stream holds there.
        forged = [items[0], _item("c", "k").encode()]
        refused = step(keys, step_args(1, pushed="1 11", fetch=0), pushed=forged)
        with pytest.raises(PushUnconfirmed):
            await backend.run_call(refused)
        assert await client.xlen(keys.stream) == 2


async def test_items_wait_in_the_inbox_while_the_stream_has_no_id_left(
    redis_url: str, namespace: str
) -> None:
    """A stream holding an entry under the largest id (appended by hand, or by a client of an
    earlier release) takes no entry until its owner has run that one and started it again: a
    step that took items in from pushes is refused with nothing written, and one that fetches
    leaves the inbox as it is, so no pushed op is lost."""
    keys = ShardKeys(namespace, 0)
    items = [_item("a", "k").encode()]
    async with _scripts_and_client(redis_url) as (backend, client):
        await client.set(keys.epoch, 1)
        await client.xadd(keys.stream, {"v": "1", "ops": "[]"}, id=LARGEST_ID)
        await client.rpush(keys.inbox, *items)
        with pytest.raises(PushUnconfirmed):
            await backend.run_call(step(keys, step_args(1, pushed="1 1", fetch=0), pushed=items))
        fetched = await backend.run_call(step(keys, step_args(1, cursor=LARGEST_ID)))
        assert fetched.entries == [] and fetched.taken == 0
        assert await client.lrange(keys.inbox, 0, -1) == items
        assert await client.xlen(keys.stream) == 1


async def test_a_move_refused_out_of_memory_writes_nothing_and_is_sent_again(
    namespace: str,
) -> None:
    """A server at its maxmemory refuses a script's first write: a step whose first write moves
    items into the stream (an op still runs; a fetch) is refused as "not now" with nothing
    written, never taken for a stream with no id left (which would give the shard up), and
    moves them once the server takes writes again."""
    keys = ShardKeys(namespace, 0)
    items = [_item("a", "k").encode()]
    with LocalServer() as server:
        async with _scripts_and_client(server.url) as (backend, client):
            await client.set(keys.epoch, 1)
            await client.rpush(keys.inbox, *items, _item("b", "k"))
            kept = step(keys, step_args(1, pushed="1 1", fetch=0), pushed=items)
            fetch = step(keys, step_args(1, fetch=10))
            await client.config_set("maxmemory", 1)
            for call in (kept, fetch):
                with pytest.raises(BackendUnavailable, match="maxmemory"):
                    await backend.run_call(call)
            assert await client.llen(keys.inbox) == 2 and await client.xlen(keys.stream) == 0
            await client.config_set("maxmemory", 0)
            (moved,) = (await backend.run_call(kept)).moved
            fetched = (await backend.run_call(fetch)).entries
            assert [fields[b"p"] for _, fields in fetched] == [b"1", b"2"]
            assert fetched[0][0] == moved


async def test_a_dead_letter_of_a_pushed_entry_names_the_entry_it_was_moved_in_as(
    redis_url: str, namespace: str
) -> None:
    """An element of a pushed entry that cannot be read is dead-lettered by the step that moves
    the entry in, naming the id the entry got there (the owner ran it before it had one)."""
    keys = ShardKeys(namespace, 0)
    async with (
        inspector(redis_url) as client,
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        await ks.submit("warm", deposit(1))  # (pushes are taken from now on)
        item = '1 fresh\n[{"no": "id"}, {"id": "fine", "key": "k", "op": "deposit", "args": [1]}]'
        taken = int(await client.get(keys.inbox_taken) or 0)
        ahead = await client.rpush(keys.inbox, item)
        await client.publish(keys.wake_channel, f"push {taken + ahead} {item}")
        ((_, letter),) = await eventually(lambda: client.xrange(keys.dead))
        moved = [
            entry_id
            for entry_id, fields in await client.xrange(keys.stream)
            if fields.get(b"p") == str(taken + ahead).encode()
        ]
        assert moved == [] or letter[b"entry"] == moved[0]  # (unless trimmed already)
        assert parse_id(letter[b"entry"].decode())  # (a stream id, not the step's '+1')
        assert await ks.result("fine", key="k") == 1


async def test_an_entry_under_the_largest_id_holds_pushed_ops_only_until_it_has_committed(
    redis_url: str, namespace: str
) -> None:
    """An entry under the largest id (appended by a user allowed to write streams: a client of
    an earlier release, or by hand; the documented client user may not) leaves no id for the
    next entry: ops pushed meanwhile wait in the inbox, and run once the owner has run that
    entry and started the stream again."""
    key = "acct:pushed"
    async with (
        inspector(redis_url) as client,
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit(key, deposit(1)) == 1
        stream = ShardKeys(namespace, 0).stream
        squatter = {"id": "squatter-1", "key": "acct:own", "op": "deposit", "args": [1]}
        await client.xadd(stream, {"v": "1", "ops": json.dumps([squatter])}, id=LARGEST_ID)
        assert await ks.submit(key, deposit(10), timeout=20) == 11
        assert await ks.submit(key, deposit(5), timeout=10) == 16
        assert await ks.read("acct:own") == 1


async def test_an_entry_appended_to_the_stream_itself_is_never_overtaken_by_a_push(
    redis_url: str, namespace: str
) -> None:
    """An entry appended to the stream itself (by hand, or by a client of an earlier release),
    with no wake-up: the owner took the next push in and ran it first, so the step that would
    move it in writes nothing, and the owner starts again from Redis, running the appended
    entry first. Both ops apply once, in the order they reached Redis."""
    keys = ShardKeys(namespace, 0)
    async with (
        inspector(redis_url) as client,
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", apps.append(0)) == [0]
        assert await ks.submit("k", apps.append(1)) == [0, 1]  # (pushes are taken from now on)
        direct = {"id": "direct-1", "key": "k", "op": "append", "args": ["direct"]}
        await client.xadd(keys.stream, {"v": "1", "ops": json.dumps([direct])})
        assert await ks.submit("k", apps.append(2), timeout=20) == [0, 1, "direct", 2]
        assert await ks.result("direct-1", key="k") == [0, 1, "direct"]


async def test_a_pushed_entry_whose_ops_have_committed_leaves_the_inbox_for_nowhere(
    redis_url: str, namespace: str
) -> None:
    """A step takes every pushed item out of the inbox, but moves into the stream only those its
    owner keeps (an op still runs): one whose ops have all committed, with that step or before,
    is appended nowhere, as a committed entry leaves the stream. Sent again after its reply was
    lost (the taken count is past the items), the step takes nothing twice."""
    keys = ShardKeys(namespace, 0)
    items = [_item("a", "k").encode(), _item("b", "k").encode(), _item("c", "k").encode()]
    async with _scripts_and_client(redis_url) as (backend, client):
        await client.set(keys.epoch, 1)
        await client.rpush(keys.inbox, *items, _item("d", "k"))
        call = step(keys, step_args(1, pushed="1 010", fetch=0), pushed=items)
        first = await backend.run_call(call)
        (kept,) = [entry_id for entry_id in first.moved if entry_id]
        assert first.moved == ["", kept, ""] and first.taken == 3
        assert [entry_id.decode() for entry_id, _ in await client.xrange(keys.stream)] == [kept]
        assert await client.lrange(keys.inbox, 0, -1) == [_item("d", "k").encode()]
        assert await client.get(keys.horizon) == kept.encode()
        assert (await backend.run_call(call)).moved == first.moved
        assert await client.xlen(keys.stream) == 1 and await client.llen(keys.inbox) == 1
        dropped = step(keys, step_args(1, pushed="4 0", fetch=0), pushed=[items[0]])
        with pytest.raises(PushUnconfirmed):  # (not the inbox's next item: "d" is)
            await backend.run_call(dropped)
