"""``keyserial reshard``: a live namespace moves to another shard count under load, with every
acknowledged op applied once, in order per key, and money conserved across the cut."""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.exceptions
from anyio.streams.text import TextReceiveStream

import keyserial
from keyserial import Settings, shard_for
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import (
    Progress,
    QuietReadings,
    Resharded,
    _drained,
    move_namespace,
)
from keyserial._scripts.reshard import (
    flip,
    forwarded,
    quiet,
    record_drained,
    record_move,
    seal,
)
from keyserial._wire.codec import LARGEST_ID, decode_reply, parse_id
from keyserial._wire.layout import Layout, ShardKeys, part_id, signers_key
from keyserial._wire.resharding import (
    LAYOUT_CHANGED,
    Drained,
    LayoutRecord,
    Move,
    Seal,
    layout_channel,
)
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests import apps
from tests.entries import inbox_item, push_raw_item
from tests.helpers import (
    Starter,
    cli,
    eventually,
    keys_on_shard,
    looked_up,
    publish,
    stored_outcome,
)
from tests.ownership import holder_pid, stream_empty, takes_pushes
from tests.users import Users, documented_users

#: Accounts of the bank load, each opened with this balance.
ACCOUNTS, OPENING = 12, 100
COUNTERS = 16


@dataclass
class Load:
    """Ops submitted while the namespace moves: each key's appends, awaited in turn (so the
    acknowledged ones are the key's exact list, in order), and transfers between accounts."""

    ks: keyserial.Client
    #: Names this load's counters apart from an earlier load's.
    round: int = 0
    appended: dict[str, list[int]] = field(default_factory=dict)
    transfers: int = 0
    stopped: bool = False

    async def counter(self, key: str) -> None:
        done = self.appended.setdefault(key, [])
        while not self.stopped:
            await self.ks.submit(key, apps.append(len(done)), timeout=60)
            done.append(len(done))

    async def bank(self, seed: int) -> None:
        pick = random.Random(seed)
        while not self.stopped:
            source, target = pick.sample(range(ACCOUNTS), 2)
            with contextlib.suppress(keyserial.InsufficientFunds):
                await self.ks.transfer(f"acct:{source}", f"acct:{target}", 1, timeout=60)
            self.transfers += 1

    async def run(self, during: Callable[[], Any]) -> Any:
        """Run the load, ``during()`` once it is under way, and the load a while after it."""
        result: list[Any] = []
        async with anyio.create_task_group() as group:
            for n in range(COUNTERS):
                group.start_soon(self.counter, f"counter:{self.round}:{n}")
            for seed in range(4):
                group.start_soon(self.bank, seed)
            await anyio.sleep(0.5)
            result.append(await during())
            await anyio.sleep(1.0)
            self.stopped = True
        return result[0]


async def _check(ks: keyserial.Client, load: Load) -> None:
    """Every acknowledged append applied once, in order; money conserved."""
    for key, done in load.appended.items():
        assert await ks.read(key) == done, key
    # (Through a queued op: read() of a participant key may trail the reply, a documented limit.)
    balances = [
        await ks.submit(f"acct:{n}", keyserial.ledger.balance(), timeout=30)
        for n in range(ACCOUNTS)
    ]
    assert sum(balances) == ACCOUNTS * OPENING
    assert min(balances) >= 0
    assert load.transfers > 0


async def _open_accounts(ks: keyserial.Client) -> None:
    for n in range(ACCOUNTS):
        await ks.submit(f"acct:{n}", keyserial.ledger.deposit(OPENING))


async def _move(
    url: str, namespace: str, shards: int, progress: Progress | None = None
) -> Resharded | None:
    backend = await Backend.connect(url)
    settings = Settings(namespace=namespace)
    try:
        if progress is None:
            return await move_namespace(backend, settings, shards)
        return await move_namespace(backend, settings, shards, progress)
    finally:
        await backend.aclose()


@pytest.mark.slow
async def test_a_namespace_grows_and_shrinks_under_load_losing_nothing(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """4 -> 16 -> 8 shards while clients append to counters and transfer money between
    accounts, with two workers each serving half the shards: every acknowledged op applied
    once and in order per key, money conserved, and the clients routing by the new layout."""
    start(redis_url, namespace, shards="0-1")
    start(redis_url, namespace, shards="2-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await _open_accounts(ks)
        for shards, generation in ((16, 1), (8, 2)):
            load = Load(ks, generation)
            moved = await load.run(lambda shards=shards: _move(redis_url, namespace, shards))
            assert moved is not None and moved.target == Layout(namespace, shards, generation)
            await _check(ks, load)
            assert ks.layout == Layout(namespace, shards, generation)


@pytest.mark.slow
async def test_a_reshard_resumes_the_same_move_and_refuses_another(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """The move recorded, the mover gone (no worker drains the shards yet): asked for another
    count it refuses, naming the move under way; run again for the same count it finishes it."""
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.enqueue("k", apps.append(1))
        with anyio.move_on_after(1.0):  # no worker: the shards never drain
            await _move(redis_url, namespace, 8)
        with pytest.raises(keyserial.KeyserialError, match="to 8 shards is under way"):
            await _move(redis_url, namespace, 16)
        start(redis_url, namespace, shards="0-3")
        assert await _move(redis_url, namespace, 8) is not None
        assert await ks.submit("k", apps.append(2), timeout=30) == [1, 2]
        assert await _move(redis_url, namespace, 8) is None  # (nothing to do)


@pytest.mark.slow
async def test_ops_committed_before_a_reshard_answer_resubmits_and_lookups_after_it(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """An op resubmitted under its id after the move, which routes it to another shard, is
    answered with the outcome stored before it, never run again; ``result()`` finds it too."""
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        ids = {f"k{n}": ks.new_op_id() for n in range(8)}
        for key, op_id in ids.items():
            assert await ks.submit(key, apps.append("once"), op_id=op_id) == ["once"]
        await _open_accounts(ks)
        paid_id = ks.new_op_id()
        paid = await ks.transfer("acct:0", "acct:1", 5, op_id=paid_id)
        await _move(redis_url, namespace, 16)
        for key, op_id in ids.items():
            assert await ks.submit(key, apps.append("once"), op_id=op_id, timeout=30) == ["once"]
            assert await ks.result(op_id, key=key) == ["once"]
            assert await ks.read(key) == ["once"]
        assert await ks.transfer("acct:0", "acct:1", 5, op_id=paid_id, timeout=30) == paid
        assert await ks.read("acct:0") == OPENING - 5


async def test_a_client_user_cannot_steer_a_reshard_nor_lose_an_op_past_a_seal(
    redis_url: str, namespace: str
) -> None:
    """The client's ACL user may not record, seal or flip a move, and a forged wake-up of the
    layout channel changes nothing (workers and clients read the records). It may not XADD to
    a sealed shard's stream (NOPERM); an op it pushes with a plain RPUSH to the shard's inbox
    past the seal is not lost: the shard forwards it to the new layout."""
    key = "victim"
    with documented_users(redis_url) as users:
        attacker = redis.asyncio.Redis.from_url(users.client_url)
        as_client = await Backend.connect(users.client_url)
        as_worker = await Backend.connect(users.worker_url)
        try:
            async with (
                running_worker(users.worker_url, namespace, shard_count=4, apps=["tests.apps"]),
                keyserial.connect(users.client_url, namespace=namespace) as ks,
            ):
                await ks.submit(key, apps.append(0))
                move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
                old = Layout(namespace, 4).keys(shard_for(key, 4))
                for forged in (record_move(move), seal(old, move), flip(move, "[]")):
                    with pytest.raises(keyserial.ConfigError):
                        await as_client.run_call(forged)
                await attacker.publish(layout_channel(namespace), LAYOUT_CHANGED)
                assert (await as_client.layout_record(namespace)) == LayoutRecord(move.source)
                await as_worker.run_call(record_move(move))
                await as_worker.run_call(seal(old, move))
                envelope = {"id": "past-the-seal", "key": key, "op": "append", "args": [1]}
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await attacker.xadd(old.stream, {"v": "1", "ops": json.dumps([envelope])})
                await push_raw_item(attacker, old, inbox_item([envelope], fresh=False))
                await move_namespace(as_worker, Settings(namespace=namespace), 16)
                assert await ks.submit(key, apps.append(2), timeout=30) == [0, 1, 2]
        finally:
            await attacker.aclose()
            await as_client.aclose()
            await as_worker.aclose()


def _reshard_command(url: str, namespace: str, shards: int) -> list[str]:
    options = ["--to", str(shards), "--redis", url, "--namespace", namespace]
    return [sys.executable, "-m", "keyserial", "reshard", *options]


async def _killed_after(command: list[str], step: str) -> None:
    """Run ``command`` and SIGKILL it once it printed ``step``."""
    async with await anyio.open_process(command) as mover:
        assert mover.stdout is not None
        printed = ""
        async for chunk in TextReceiveStream(mover.stdout):
            printed += chunk
            if step in printed:
                break
        else:
            raise AssertionError(f"the mover ended before {step!r}: {printed}")
        mover.kill()
        await mover.wait()


@pytest.mark.slow
@pytest.mark.parametrize("killed_after", ["recorded the move", "sealed the"])
async def test_a_mover_killed_mid_move_is_finished_by_running_it_again(
    redis_url: str, namespace: str, start: Starter, killed_after: str
) -> None:
    """``keyserial reshard`` killed with SIGKILL right after a step, under load: the move stays
    recorded (clients queue on the new shards), and running the command again finishes it,
    with nothing lost or applied twice."""
    start(redis_url, namespace, shards="0-1")
    start(redis_url, namespace, shards="2-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await _open_accounts(ks)

        async def killed_then_run_again() -> None:
            await _killed_after(_reshard_command(redis_url, namespace, 16), killed_after)
            record = await _record(redis_url, namespace)
            assert record.move is not None and record.live == Layout(namespace, 4)
            again = await anyio.run_process(_reshard_command(redis_url, namespace, 16))
            assert b"flipped" in again.stdout

        load = Load(ks, 1)
        await load.run(killed_then_run_again)
        await _check(ks, load)
        assert ks.layout == Layout(namespace, 16, 1)


async def _record(url: str, namespace: str) -> LayoutRecord:
    backend = await Backend.connect(url)
    try:
        record = await backend.layout_record(namespace)
        assert record is not None
        return record
    finally:
        await backend.aclose()


async def test_a_reshard_refuses_to_start_while_a_worker_of_an_older_version_runs(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """A worker that lists no layout generation on the roster would go on serving the old
    shards' names with the new count: the move does not start, and says which worker."""
    async with keyserial.connect(redis_url, namespace=namespace, shards=4, service=""):
        pass
    older = {"shards": [0, 1, 2, 3], "ops": ["deposit"], "at": time.time()}
    await client.hset(f"ks:{namespace}:workers", "old-host:7:abc", json.dumps(older))
    with pytest.raises(keyserial.ReshardRefused, match="old-host:7:abc"):
        await _move(redis_url, namespace, 8)
    assert (await _record(redis_url, namespace)).move is None


@pytest.mark.slow
async def test_dead_letters_move_with_the_namespace(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """A dead letter of an old shard is listed, and replayable, in the new layout."""
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.submit("k", apps.append(0))
        old = Layout(namespace, 4).keys(1)
        await client.xadd(old.stream, {"v": "1", "ops": "not json"})
        await eventually(lambda: client.xlen(old.dead))
        ((letter_id, dead),) = await client.xrange(old.dead)
        await _move(redis_url, namespace, 16)
        letters = [
            fields
            for keys in Layout(namespace, 16, 1).all_keys()
            for _, fields in await client.xrange(keys.dead)
        ]
        assert letters == [{**dead, b"moved": b"1 " + letter_id}]
        assert await client.xlen(old.dead) == 0


async def _holds(client: redis.asyncio.Redis, stream: str, count: int) -> bool:
    return int(await client.xlen(stream)) == count


@pytest.mark.slow
async def test_a_mover_interrupted_mid_dead_letters_lists_each_letter_once_after_its_rerun(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """Killed between copying an old shard's dead letters and deleting them, the rerun copies
    none of them again: each letter is listed once, so ``replay --new-id`` runs it once."""
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.submit("k", apps.append(0))
        old = Layout(namespace, 4).keys(1)
        for n in range(3):
            await client.xadd(old.stream, {"v": "1", "ops": f"not json {n}"})
        await eventually(lambda: _holds(client, old.dead, 3))
        dead_before = [fields for _, fields in await client.xrange(old.dead)]
        with pytest.raises(_Interrupted):
            await _move(redis_url, namespace, 16, _interrupted_after("copied the dead letters"))
        assert await client.xlen(old.dead) == 3  # (copied, not deleted yet)
        await _move(redis_url, namespace, 16)
        letters = [
            fields[b"raw"]
            for keys in Layout(namespace, 16, 1).all_keys()
            for _, fields in await client.xrange(keys.dead)
        ]
        assert sorted(letters) == sorted(fields[b"raw"] for fields in dead_before)
        assert await client.xlen(old.dead) == 0


async def test_an_op_copied_as_fresh_into_the_new_layout_never_runs_twice(
    redis_url: str, namespace: str
) -> None:
    """A client user copies an op that ran before the move into its new shard's inbox, marked
    ``fresh`` (so its owner would skip looking up its own results), and pushes it to the owner
    with a wake-up, as the submit script does (it may not XADD it to the stream: NOPERM): the
    owner finds the outcome stored in the old layout and answers it, never running it again."""
    with documented_users(redis_url) as users:
        attacker = redis.asyncio.Redis.from_url(users.client_url)
        try:
            async with (
                running_worker(users.worker_url, namespace, shard_count=4, apps=["tests.apps"]),
                keyserial.connect(users.client_url, namespace=namespace) as ks,
            ):
                op_id = ks.new_op_id()
                assert await ks.submit("victim", apps.append(0), op_id=op_id) == [0]
                await _move(users.worker_url, namespace, 16)
                there = Layout(namespace, 16, 1).keys(shard_for("victim", 16))
                copy = {"id": op_id, "key": "victim", "op": "append", "args": [0]}
                fields = {"v": "1", "ops": json.dumps([copy]), "fresh": "1"}
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await attacker.xadd(there.stream, fields)  # type: ignore[arg-type]
                item = inbox_item([copy], fresh=True)
                await push_raw_item(attacker, there, item, wake=True)
                assert await ks.submit("victim", apps.append(1), timeout=30) == [0, 1]
        finally:
            await attacker.aclose()


@pytest.mark.slow
async def test_a_forged_push_to_a_sealed_shard_is_never_forwarded(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A sealed shard forwards the ops of entries pushed past its seal, at once, so it must
    forward only entries it read from its stream: a push (which any client user may publish,
    and which only the next step confirms), at the inbox's next place, of an op no caller made
    (nothing was pushed to the inbox) is never forwarded, nor taken in (it would run, and its
    step, refused on a sealed shard, would cost the shard a restart)."""
    key = "victim"
    with documented_users(redis_url) as users:
        attacker = redis.asyncio.Redis.from_url(users.client_url)
        as_worker = await Backend.connect(users.worker_url)
        try:
            async with (
                running_worker(
                    users.worker_url, namespace, shard_count=4, apps=["tests.apps"]
                ) as worker,
                keyserial.connect(users.client_url, namespace=namespace) as ks,
            ):
                await ks.submit(key, apps.append(0))
                move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
                old = move.source.keys(shard_for(key, 4))
                await as_worker.run_call(record_move(move))
                await as_worker.run_call(seal(old, move))
                runner = worker._owned[old.shard].runner
                await eventually(lambda: _true_soon(runner.sealed))
                forged = [{"id": "forged-1", "key": key, "op": "append", "args": ["forged"]}]
                taken = int(await attacker.get(old.inbox_taken) or 0)
                waiting = await attacker.llen(old.inbox)  # type: ignore[misc]
                place = taken + int(waiting) + 1
                push = f"push {place} {inbox_item(forged, fresh=True)}"
                await attacker.publish(old.wake_channel, push)
                await move_namespace(as_worker, Settings(namespace=namespace), 16)
                assert await ks.submit(key, apps.append(1), timeout=30) == [0, 1]
            gone = ("runner failed", "giving the shard up")
            failed = [
                r.getMessage() for r in caplog.records if any(g in r.getMessage() for g in gone)
            ]
            assert failed == [], "the sealed shard took the forged push in and restarted"
        finally:
            await attacker.aclose()
            await as_worker.aclose()


async def _true_soon(value: bool) -> bool:
    return value


@dataclass
class _Cut:
    """An op waiting in the new layout for the flip, as a client user can see it."""

    attacker: redis.asyncio.Redis
    #: The op's old shard (shard 1 of 4, sealed, its owner knowing it) and new one (1 of 16).
    old: ShardKeys
    new: ShardKeys
    #: The waiting op's id, its place in the new shard's inbox (what a reply names it by), and
    #: its reply channel.
    op_id: str
    place: str
    reply: str
    #: What the op's submit returned, or raised, once it has.
    answered: list[Any]


@contextlib.asynccontextmanager
async def _an_op_waiting_for_the_flip(
    users: Users, namespace: str, *, ahead: int = 0
) -> AsyncIterator[_Cut]:
    """The victim's key holds ``[0]``; a move from 4 to 16 shards is recorded and the key's old
    shard sealed; the victim's ``append(1)``, refused there, waits on its new shard (of the same
    number, 1) for the flip, in its inbox (no worker serves the new layout before the flip),
    behind ``ahead`` items of junk the attacker pushed there first (its place is ``ahead + 1``;
    the new owner dead-letters them after the flip). After the block the move finishes: the op
    must then have applied once, and its caller must have got ``[0, 1]``.

    The attacker learns the op's id, place and reply channel as a client user can: from the
    push on the new shard's wake channel, which it may subscribe to (read here, as the same,
    from the inbox)."""
    key = keys_on_shard(1, 16, 1, "victim")[0]  # (shard 1 of 16, so of 4 too)
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    as_worker = await Backend.connect(users.worker_url)
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old, new = move.source.keys(1), move.target.keys(1)
    try:
        async with (
            running_worker(
                users.worker_url, namespace, shard_count=4, apps=["tests.apps"]
            ) as worker,
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(key, apps.append(0)) == [0]
            signers = await eventually(lambda: users.admin.hkeys(signers_key(namespace)))
            await eventually(lambda: ks._verifier.knows(signers[0].decode()))
            await as_worker.run_call(record_move(move))
            await as_worker.run_call(seal(old, move))
            runner = worker._owned[old.shard].runner
            await eventually(lambda: runner.sealed)
            for n in range(ahead):
                await push_raw_item(attacker, new, f"junk {n}")
            answered: list[Any] = []

            async def victim() -> None:
                try:
                    answered.append(await ks.submit(key, apps.append(1), timeout=60))
                except keyserial.KeyserialError as exc:
                    answered.append(exc)

            async with anyio.create_task_group() as group:
                group.start_soon(victim)
                items = await eventually(lambda: users.admin.lrange(new.inbox, ahead, -1))
                (item,) = items
                (envelope,) = json.loads(item.partition(b"\n")[2])
                op_id = envelope["id"]
                (pending,) = await eventually(
                    lambda: [pending for pending in ks._waiting[op_id] if pending.entry]
                )
                place = pending.entry.place
                assert place == str(ahead + 1)
                yield _Cut(attacker, old, new, op_id, place, envelope["reply"], answered)
                await move_namespace(as_worker, Settings(namespace=namespace), 16)
            assert answered == [[0, 1]], "the op's caller got its own outcome"
            assert await ks.read(key) == [0, 1], "the op applied once"
    finally:
        await attacker.aclose()
        await as_worker.aclose()


def _misrouted(cut: _Cut, reply: str) -> str:
    """The ``ops`` of an entry for the waiting op's old shard: its op id, with a key that
    routes to another old shard, and ``reply``."""
    elsewhere = keys_on_shard((cut.old.shard + 1) % 4, 4, 1, "elsewhere")[0]
    envelope = {"id": cut.op_id, "key": elsewhere, "op": "append", "args": [], "reply": reply}
    return json.dumps([envelope])


async def _next_message(listener: Any) -> bytes:
    """The next message on a channel ``listener`` subscribed to."""
    with anyio.fail_after(10):
        while True:
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                data: bytes = message["data"]
                return data


@pytest.mark.slow
async def test_an_outcome_stored_past_a_seal_never_answers_an_op_of_the_new_layout(
    redis_url: str, namespace: str
) -> None:
    """A client of an earlier release, whose user may XADD (the documented client user may only
    push, and what it pushes to a sealed shard is forwarded from the inbox, never refused there),
    reads the id of an op waiting in the new layout for the flip, and appends it past the seal
    of the op's old shard, with a key that routes elsewhere. The sealed shard refuses that entry
    on the attacker's channel but stores nothing for it: after the flip, the new owner finds no
    outcome of the op in the old layout, runs it, once, and its caller gets its own outcome,
    not the refusal."""
    with documented_users(redis_url) as users:
        async with _an_op_waiting_for_the_flip(users, namespace) as cut:
            channel = f"ks:{namespace}:reply:attacker"
            async with cut.attacker.pubsub() as listener:
                await listener.subscribe(channel)
                users.admin.xadd(cut.old.stream, {"v": "1", "ops": _misrouted(cut, channel)})
                await publish(cut.attacker, cut.old.wake_channel, "1")
                ((op_id, refusal),) = decode_reply(await _next_message(listener))
            assert op_id == cut.op_id
            assert refusal["error"]["type"] == keyserial.MalformedOperation.wire_type
        assert users.admin.hget(cut.old.results, cut.op_id) is None


@pytest.mark.slow
async def test_a_reply_of_an_older_layout_never_settles_a_submit(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The victim's op waits on shard 1 of the new layout, at place 4 of its inbox. A client
    of an earlier release, whose user may XADD (the documented client user may not: NOPERM;
    what it pushes to a sealed shard is forwarded from the inbox, never refused there), appends
    to the stream of shard 1 of the old one the op's id with a key that routes elsewhere, the
    victim's reply channel and the victim's own place. The old owner's refusal is genuine,
    signed for the victim, and names shard 1 and that place, but of the old layout: the client
    looks the op up instead, finds nothing, and keeps waiting; after the flip the op runs once
    and its caller gets its own outcome."""
    with documented_users(redis_url) as users:
        async with _an_op_waiting_for_the_flip(users, namespace, ahead=3) as cut:
            attacker, old = cut.attacker, cut.old
            entry = {"v": "1", "ops": _misrouted(cut, cut.reply), "p": cut.place}
            with pytest.raises(redis.exceptions.NoPermissionError):
                await attacker.xadd(old.stream, entry)  # type: ignore[arg-type]
            async with attacker.pubsub() as listener:
                # (Published by another slot's script, so with PUBLISH, even on a cluster.)
                await listener.subscribe(cut.reply)
                users.admin.xadd(old.stream, entry)  # type: ignore[arg-type]
                await publish(attacker, old.wake_channel, "1")
                signed = await _next_message(listener)
            ((_, refusal),) = decode_reply(signed)
            assert "t" in json.loads(signed), "signed for the victim"
            assert (refusal["s"], refusal["e"]) == (cut.new.shard, [cut.place])
            assert refusal["error"]["type"] == keyserial.MalformedOperation.wire_type
            await publish(cut.attacker, cut.reply, signed)  # (where the victim listens)
            await eventually(lambda: cut.answered or looked_up(caplog, cut.op_id))
            assert cut.answered == [], "the refusal of the old layout settled the submit"


@pytest.mark.slow
async def test_a_client_reads_its_own_write_across_the_cut(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """An op appended during the move runs on its new shard after the flip; the client that
    awaited it reads its write at once, before it would read the layout record again (a long
    ``idle_poll``): not the old shard's state, frozen at the cut."""
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4, idle_poll=60.0) as ks:
        await ks.submit("k", apps.append(0))
        async with anyio.create_task_group() as group:
            group.start_soon(_move, redis_url, namespace, 16)
            await anyio.sleep(0.05)
            assert await ks.submit("k", apps.append(1), timeout=30) == [0, 1]
            assert await ks.read("k") == [0, 1]


async def test_an_op_pushed_with_a_plain_rpush_to_a_retired_shard_is_forwarded_and_runs_once(
    redis_url: str, namespace: str
) -> None:
    """After the flip no worker serves the old shards, but a client user that pushes with a
    plain RPUSH (the submit script refuses a sealed shard) may still route by the count it
    read before, and may not XADD there (NOPERM): the owner of the old shard's heir (shard
    ``old % M``) reads what the old shard's inbox holds and forwards its ops to their new
    shards, each running once (a copy of an op that ran before the move is answered, not run),
    dead-letters what cannot run there (a malformed entry, an item not of the documented form,
    a grant request), and takes the items out. None is ever moved into the old stream, where
    a client user could read its op id and push another op under it to its new shard first."""
    key = "victim"
    with documented_users(redis_url) as users:
        stale = redis.asyncio.Redis.from_url(users.client_url)
        try:
            async with (
                running_worker(users.worker_url, namespace, shard_count=4, apps=["tests.apps"]),
                keyserial.connect(users.client_url, namespace=namespace) as ks,
            ):
                before = ks.new_op_id()
                assert await ks.submit(key, apps.append(0), op_id=before) == [0]
                await _move(users.worker_url, namespace, 16)
                old = Layout(namespace, 4).keys(shard_for(key, 4))
                heir = Layout(namespace, 16, 1).keys(old.shard % 16)
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await stale.xadd(old.stream, {"v": "1", "ops": "[]"})
                for envelope in (
                    {"id": before, "key": key, "op": "append", "args": [0]},
                    {"id": "stray-1", "key": key, "op": "append", "args": [1]},
                    {"id": "stray-grant", "key": key, "op": "keyserial.grant", "args": []},
                ):
                    await push_raw_item(stale, old, inbox_item([envelope], fresh=False))
                await push_raw_item(stale, old, "1\nnot json")
                await push_raw_item(stale, old, "no form at all")
                assert await stored_outcome(ks, "stray-1", key, timeout=30) == [0, 1]
                assert await ks.submit(key, apps.append(2), timeout=30) == [0, 1, 2]
                record = Drained.decode(users.admin.get(f"{old.tag}:drained").decode())
                assert record is not None
                drained = record.through
                await eventually(lambda: users.admin.llen(old.inbox) == 0)
                never_appended = users.admin.xinfo_stream(old.stream)["last-generated-id"]
                assert parse_id(never_appended.decode()) <= parse_id(drained)
                reasons = [
                    fields[b"reason"].decode() for _, fields in users.admin.xrange(heir.dead)
                ]
                assert len(reasons) == 3 and any("grant" in r for r in reasons), reasons
        finally:
            await stale.aclose()


async def test_forwarded_strays_leave_a_retired_inbox_once_and_only_those_read(
    redis_url: str, namespace: str
) -> None:
    """The heir's owner takes the items it forwarded out of a retired shard's inbox only if
    its taken count is still the one read with them: a second worker that forwarded them too
    (the heir changing owner) takes out nothing, so no item that neither read is lost."""
    keys = Layout(namespace, 4).keys(1)
    backend = await Backend.connect(redis_url)
    try:
        await backend.call("SET", keys.inbox_taken, 5)
        await backend.call("RPUSH", keys.inbox, "a", "b", "c")
        assert await backend.run_call(forwarded(keys, 4, 2)) == 0
        assert await backend.call("LLEN", keys.inbox) == 3
        assert await backend.run_call(forwarded(keys, 5, 2)) == 1
        assert await backend.call("LRANGE", keys.inbox, 0, -1) == [b"c"]
        assert await backend.call("GET", keys.inbox_taken) == b"7"
        assert await backend.run_call(forwarded(keys, 5, 2)) == 0  # (the other forwarder)
        assert await backend.call("LRANGE", keys.inbox, 0, -1) == [b"c"]
    finally:
        await backend.aclose()


@pytest.mark.slow
async def test_a_move_finishes_while_a_stale_client_keeps_appending_to_an_old_shard(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """A client that appends with plain XADDs by the old count, without pause, before, during
    and after the move: its ops past the seal are forwarded, not run there, so they never keep
    the old shard from counting as drained (the move finishes), and every op it appended runs
    once, in the order it appended them."""
    key = "stale"
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.submit(key, apps.append("first"))
        old = Layout(namespace, 4).keys(shard_for(key, 4))
        stale = redis.asyncio.Redis.from_url(redis_url)
        appended: list[int] = []
        try:
            stop = anyio.Event()
            async with anyio.create_task_group() as group:

                async def append_by_the_old_count() -> None:
                    # (Stopped between appends, never cancelled inside one: an XADD that reached
                    # Redis must be counted as appended.)
                    while not stop.is_set():
                        envelope = {"id": f"stale-{len(appended)}", "key": key, "op": "append"}
                        envelope["args"] = [len(appended)]
                        entry = {"v": "1", "ops": json.dumps([envelope])}
                        await stale.xadd(old.stream, entry)  # type: ignore[arg-type]
                        appended.append(len(appended))
                        await anyio.sleep(0.002)

                group.start_soon(append_by_the_old_count)
                await anyio.sleep(0.3)
                with anyio.fail_after(30):
                    await _move(redis_url, namespace, 16)
                await anyio.sleep(0.3)
                stop.set()
        finally:
            await stale.aclose()
        expected = ["first", *appended]
        with anyio.fail_after(30):
            while (state := await ks.read(key)) != expected:
                assert state == expected[: len(state)], "each stale op once, in order"
                await anyio.sleep(0.05)


@pytest.mark.slow
async def test_a_worker_that_takes_a_sealed_shard_over_forwards_what_follows_the_seal(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """A worker that takes over an old shard before it has read the layout again (here: its
    poll a minute away; after a flip, a worker that has not noticed it yet) reads the shard's
    seal first: an op a stale client pushed past the seal (a plain RPUSH to the inbox: the
    submit script refuses a sealed shard) is forwarded to the new layout, never run where its
    effects would be left behind. The dead owner took pushes, so the takeover counts every
    entry it may have been pushed as fetched, but moves nothing of a sealed shard's inbox into
    its stream: what waits there was pushed past the seal."""
    key = "victim"
    first = start(redis_url, namespace, shards="0-3")
    as_worker = await Backend.connect(redis_url)
    stale = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
            await ks.submit(key, apps.append(0))
            move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
            old = move.source.keys(shard_for(key, 4))
            await eventually(lambda: takes_pushes(stale, old), timeout=15)
            await as_worker.run_call(record_move(move))
            await as_worker.run_call(seal(old, move))
            first.kill()
            envelope = {"id": "past-the-seal", "key": key, "op": "append", "args": [1]}
            await push_raw_item(stale, old, inbox_item([envelope], fresh=False))
            start(redis_url, namespace, shards="0-3", env={"KEYSERIAL_IDLE_POLL": "60"})
            there = move.target.keys(shard_for(key, 16))
            await eventually(lambda: _holds_op(stale, there, "past-the-seal"))
            assert await stale.hget(old.results, "past-the-seal") is None
            await _never_moved_past_the_seal(stale, old)
    finally:
        await stale.aclose()
        await as_worker.aclose()


async def _never_moved_past_the_seal(client: redis.asyncio.Redis, old: ShardKeys) -> None:
    """Nothing was appended to the sealed shard's stream after its seal, and its inbox is
    empty: what was pushed there past the seal went from the inbox to the new layout."""
    seal_record = json.loads(await client.get(f"{old.tag}:sealed"))
    last = "0-0"  # (a stream that never existed: every op came pushed and left no entry)
    if await client.exists(old.stream):
        last = (await client.xinfo_stream(old.stream))["last-generated-id"].decode()
    assert last == seal_record["last"]
    await eventually(lambda: _empty(client, old.inbox))


async def _empty(client: redis.asyncio.Redis, key: str) -> bool:
    return int(await client.llen(key)) == 0  # type: ignore[misc]


async def _holds_op(client: redis.asyncio.Redis, shard: ShardKeys, op_id: str) -> bool:
    """Whether an op of ``op_id`` waits in the shard's inbox (where it is forwarded to: no
    worker serves a move's target before the flip) or is in its stream."""
    entries = [fields[b"ops"] for _, fields in await client.xrange(shard.stream)]
    items = await client.lrange(shard.inbox, 0, -1)  # type: ignore[misc]
    return any(op_id.encode() in found for found in (*entries, *items))


@pytest.mark.slow
async def test_a_worker_that_takes_a_sealed_idle_shard_over_forwards_a_push_past_the_seal(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """The same takeover of a sealed shard, its stream and inbox empty: the new owner's replay
    fetches no entry (a step reads the seal only with the entries it fetches, or with items it
    leaves in the inbox), and the first entry past the seal comes in its push, as
    ``submit.lua`` writes one (a client user may ``RPUSH`` the item to the inbox and
    ``PUBLISH`` the push). The owner read the seal as it took the shard over, so it takes no
    push in: its next step leaves the item in the inbox, and it forwards the item's op from
    there (one that kills the worker that runs it)."""
    key = "victim"
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old = move.source.keys(shard_for(key, 4))
    first = start(redis_url, namespace, shards="0-3")
    as_worker = await Backend.connect(redis_url)
    try:
        async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
            await ks.submit(key, apps.append(0))
        await eventually(lambda: stream_empty(client, old), timeout=15)
        await as_worker.run_call(record_move(move))
        await as_worker.run_call(seal(old, move))
        first.kill()
        await eventually(lambda: _subscribers(client, old.wake_channel, 0))
        second = start(redis_url, namespace, shards="0-3", env={"KEYSERIAL_IDLE_POLL": "60"})
        await eventually(lambda: _held_by(client, old, second.pid), timeout=15)
        await eventually(lambda: takes_pushes(client, old), timeout=15)
        await eventually(lambda: _subscribers(client, old.wake_channel, 1), timeout=15)
        crash = [{"id": "past-the-seal", "key": key, "op": "crash", "args": []}]
        item = inbox_item(crash, fresh=True)
        place = await push_raw_item(client, old, item)
        assert place == int(await client.get(old.inbox_taken) or 0) + 1  # (the inbox's next item)
        # (The push reached the new owner alone.)
        assert await publish(client, old.wake_channel, f"push {place} {item}") == 1
        there = move.target.keys(shard_for(key, 16))

        async def forwarded_or_ran() -> bool:
            ran = second.process.poll() is not None
            return ran or await _holds_op(client, there, "past-the-seal")

        await eventually(forwarded_or_ran, timeout=15)
        assert second.process.poll() is None, "the op past the seal ran on the old shard"
        assert await _holds_op(client, there, "past-the-seal")
        assert await client.hget(old.results, "past-the-seal") is None
    finally:
        await as_worker.aclose()


async def _subscribers(client: redis.asyncio.Redis, channel: str, count: int) -> bool:
    """``count`` connections subscribe to ``channel`` (a killed worker's no longer does)."""
    ((_, subscribed),) = await client.pubsub_numsub(channel)
    return bool(subscribed == count)


async def _held_by(client: redis.asyncio.Redis, shard: ShardKeys, pid: int) -> bool:
    return await holder_pid(client, shard.namespace, shard.shard) == pid


@pytest.mark.slow
async def test_an_old_shard_drains_when_the_entries_before_its_seal_are_gone(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """A step deletes the entries of ops that committed behind one still running; a new owner
    after a crash then finds nothing to fetch between its cursor and the seal's last entry.
    Once a fetch reaches the end of the stream it counts as drained through the seal (nemesis
    seed 5275: the move waited for that shard forever)."""
    key = "victim"
    old = Layout(namespace, 4).keys(shard_for(key, 4))
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    envelope = {"id": "before", "key": key, "op": "append", "args": [0]}
    await client.xadd(old.stream, {"v": "1", "ops": json.dumps([envelope])})
    gone = await client.xadd(old.stream, {"v": "1", "ops": json.dumps([envelope])})
    await client.xdel(old.stream, gone)
    as_worker = await Backend.connect(redis_url)
    try:
        await as_worker.ensure_layout(namespace, 4)
        await as_worker.run_call(record_move(move))
        await as_worker.run_call(seal(old, move))
        start(redis_url, namespace, shards="0-3")
        with anyio.fail_after(20):
            moved = await _move(redis_url, namespace, 16)
        assert moved is not None and moved.target == move.target
    finally:
        await as_worker.aclose()


class _Interrupted(Exception):
    """Raised by the mover's progress callback: the mover stops right after that step."""


def _interrupted_after(step: str) -> Progress:
    def progress(message: str) -> None:
        if message.startswith(step):
            raise _Interrupted(message)

    return progress


async def _held_until_resumed(ks: keyserial.Client, url: str, namespace: str, key: str) -> None:
    """``key`` is paused on its shard (balance 1): a deposit waits while an op of a neighbour
    on that shard, appended after it, runs; once resumed through the CLI, the deposit runs."""
    neighbour = next(k for k in keys_on_shard(shard_for(key, 16), 16, 2, "acct") if k != key)
    answers: dict[str, Any] = {}

    async def held() -> None:
        answers["held"] = await ks.submit(key, deposit(10), timeout=30)

    async with anyio.create_task_group() as group:
        group.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        assert await ks.submit(neighbour, deposit(5), timeout=30) == 5
        assert answers == {}, "a paused key's op ran on its new shard"
        code, out, _ = await cli(url, namespace, "keys", "resume", key)
        assert code == 0 and "(it was not paused)" not in out
    assert answers == {"held": 11}


@pytest.mark.slow
async def test_a_reshard_carries_a_paused_key(redis_url: str, namespace: str) -> None:
    """A key paused before the move stays paused on its new shard: its op waits there while
    the shard flows, and runs once resumed."""
    key = "acct:paused"
    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
    ):
        assert await ks.submit(key, deposit(1)) == 1
        assert (await cli(redis_url, namespace, "keys", "pause", key))[0] == 0
        assert await _move(redis_url, namespace, 16) is not None
        await _held_until_resumed(ks, redis_url, namespace, key)


@pytest.mark.slow
async def test_a_rerun_move_leaves_each_key_paused_as_the_operator_last_set_it(
    redis_url: str, namespace: str
) -> None:
    """The mover is interrupted right after the copy, which carried one paused key to the new
    layout; the operator then resumes that key and pauses another (the CLI writes the live,
    old layout); the rerun finishes the move. After the flip the resumed key's ops run and the
    paused key's wait, as the CLI said, not as the first copy left them."""
    resumed, paused = "acct:resumed", "acct:paused"
    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
    ):
        for key in (resumed, paused):
            assert await ks.submit(key, deposit(1)) == 1
        assert (await cli(redis_url, namespace, "keys", "pause", resumed))[0] == 0
        with pytest.raises(_Interrupted, match="copied"):
            await _move(redis_url, namespace, 16, _interrupted_after("copied"))
        assert (await _record(redis_url, namespace)).move is not None
        code, out, _ = await cli(redis_url, namespace, "keys", "resume", resumed)
        assert code == 0 and f"resumed {resumed!r}" in out
        assert (await cli(redis_url, namespace, "keys", "pause", paused))[0] == 0
        assert await _move(redis_url, namespace, 16) is not None
        assert await ks.submit(resumed, deposit(10), timeout=10) == 11
        await _held_until_resumed(ks, redis_url, namespace, paused)


async def test_a_resume_between_the_copys_reading_and_its_writes_is_not_undone(
    redis_url: str, namespace: str
) -> None:
    """The operator resumes a paused key just after the mover read the old layout's paused
    keys, and before it wrote them to the new layout: the resume writes both layouts, and the
    mover's writes, made from the reading before, pause the key in the new one again. Its next
    reading of the old layout finds the change, and the round after makes the new paused keys
    the old ones again, removing what is no longer paused: after the flip the key's ops run."""
    key = "acct:resumed"
    backend = await Backend.connect(redis_url)
    read_paused = backend.all_paused
    readings = 0

    async def all_paused(shards: Sequence[ShardKeys]) -> list[dict[bytes, bytes]]:
        nonlocal readings
        paused = await read_paused(shards)
        readings += 1
        if readings == 1:  # (the copy's first reading, of the old layout)
            code, out, _ = await cli(redis_url, namespace, "keys", "resume", key)
            assert code == 0 and f"resumed {key!r}" in out
        return paused

    backend.all_paused = all_paused  # type: ignore[method-assign]
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=4),
            keyserial.connect(redis_url, namespace=namespace, shards=4) as ks,
        ):
            assert await ks.submit(key, deposit(1)) == 1
            assert (await cli(redis_url, namespace, "keys", "pause", key))[0] == 0
            assert await move_namespace(backend, Settings(namespace=namespace), 16) is not None
            assert readings >= 3  # (the change found, and a round made from it confirmed)
            assert await ks.submit(key, deposit(10), timeout=10) == 11
    finally:
        await backend.aclose()


async def test_a_reshard_keeps_old_layouts_as_long_as_the_workers_keep_results(
    redis_url: str, namespace: str
) -> None:
    """A mover run with a short ``result_ttl`` keeps the layouts it leaves in the history for
    as long as the running workers keep results (an hour here): a resubmit of an op committed
    two moves ago is still answered from its outcome, not run again."""
    backend = await Backend.connect(redis_url)
    mover = Settings(namespace=namespace, result_ttl=0.001)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            assert await ks.submit("k", apps.append(0), op_id="first") == [0]
            await move_namespace(backend, mover, 8)
            await anyio.sleep(0.01)
            await move_namespace(backend, mover, 16)
            record = await _record(redis_url, namespace)
            assert [layout.generation for layout, _ in record.history] == [0, 1]
            assert await ks.submit("k", apps.append(0), op_id="first") == [0]
            assert await ks.read("k") == [0]
    finally:
        await backend.aclose()


@pytest.mark.slow
async def test_a_stale_client_packing_entries_faster_than_they_are_forwarded_holds_no_move_up(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """A client appends to a sealed old shard, with plain XADDs, entries of 200 ops each,
    faster than its owner can forward them one by one: the strays past the drained record only
    grow. The mover reads none of them (what follows the seal is forwarded, never run there),
    counts the shard drained, and the move finishes while the flood goes on."""
    start(redis_url, namespace, shards="0-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.submit("warm", deposit(1))
    old = Layout(namespace, 4).keys(1)
    keys = keys_on_shard(1, 4, 200, "flood")
    backend = await Backend.connect(redis_url)
    stale = redis.asyncio.Redis.from_url(redis_url)
    sent = 0

    async def one_entry() -> None:
        nonlocal sent
        ops = [
            {"id": f"flood-{sent}-{n}", "key": key, "op": "deposit", "args": [1]}
            for n, key in enumerate(keys)
        ]
        await stale.xadd(old.stream, {"v": "1", "ops": json.dumps(ops)})
        sent += 1

    try:
        move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
        await backend.run_call(record_move(move))
        await backend.run_call(seal(old, move))
        for _ in range(150):
            await one_entry()
        async with anyio.create_task_group() as group:

            async def flood() -> None:
                while True:
                    await one_entry()
                    await anyio.sleep(0.02)

            group.start_soon(flood)
            # (A move held up never finishes; one that keeps up takes 3-15 s, by the load.)
            with anyio.fail_after(60):
                await move_namespace(backend, Settings(namespace=namespace), 16)
            group.cancel_scope.cancel()
        assert (await _record(redis_url, namespace)).live.shards == 16
        assert await stale.xlen(old.stream) > 100  # (the strays outran their forwarding)
    finally:
        await stale.aclose()
        await backend.aclose()


@contextlib.asynccontextmanager
async def _sealed_and_drained(
    redis_url: str, namespace: str
) -> AsyncIterator[tuple[ShardKeys, Callable[[], Any]]]:
    """Old shard 1 of a move from 4 shards, sealed and drained through its seal by an owner at
    epoch 1 (written as that owner would), with no worker: what follows the seal is what a
    client appends. Yields the shard and a check: whether the mover counts it drained now."""
    backend = await Backend.connect(redis_url)
    try:
        async with keyserial.connect(redis_url, namespace=namespace, shards=4):
            pass  # (records the count)
        move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
        old = move.source.keys(1)
        await backend.call("XADD", old.stream, "*", "v", "1", "ops", "[]")
        await backend.run_call(record_move(move))
        await backend.run_call(seal(old, move))
        await backend.call("SET", old.epoch, 1)
        sealed = Seal.decode(namespace, (await backend.run_call(quiet(old))).sealed)
        await backend.run_call(record_drained(old, 1, sealed.last, 0))

        async def drained() -> bool:
            return _drained(old, await backend.run_call(quiet(old)))

        yield old, drained
    finally:
        await backend.aclose()


async def _append_past_the_seal(redis_url: str, old: ShardKeys, envelopes: list[Any]) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        await client.xadd(old.stream, {"v": "1", "ops": json.dumps(envelopes)})
    finally:
        await client.aclose()


def _stray(n: int) -> dict[str, Any]:
    return {"id": f"stray-{n}", "key": keys_on_shard(1, 4, 1, "k")[0], "op": "deposit", "args": [1]}


@pytest.mark.slow
async def test_the_mover_counts_strays_past_the_seal_as_drained_however_many(
    redis_url: str, namespace: str
) -> None:
    """Ops a client appended past the seal are forwarded, not run: however many of them (the
    mover reads none of them) leave the shard drained."""
    async with _sealed_and_drained(redis_url, namespace) as (old, drained):
        for n in range(250):
            await _append_past_the_seal(redis_url, old, [_stray(n)])
        assert await drained()


async def test_an_old_shard_holding_keys_for_another_shard_s_op_is_not_drained(
    redis_url: str, namespace: str
) -> None:
    """A hold in the old shard's held hash (its keys held for a cross-shard op homed on another
    shard, until that op's decision) keeps the shard from counting as drained, however drained
    its stream is: quiet.lua reads how many holds there are with the seal and the record."""
    async with _sealed_and_drained(redis_url, namespace) as (old, drained):
        assert await drained()
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await client.hset(old.held, part_id("order", 0, 1), _grant_record(old))
            assert not await drained()
            await client.hdel(old.held, part_id("order", 0, 1))
            assert await drained()
        finally:
            await client.aclose()


async def test_the_mover_never_flips_while_an_old_shard_holds_keys_for_another_shard_s_op(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """An old shard's keys held for a cross-shard op (a hold its owner recorded, as a
    participant does until the op's decision applies there): every old shard drains through its
    seal, yet the mover waits and does not flip, since the op under way would apply on a shard
    that no longer serves; once the hold ends, the move finishes."""
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old = move.source.keys(2)
    backend = await Backend.connect(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            key = keys_on_shard(2, 4, 1, "held")[0]
            assert await ks.submit(key, apps.append(0)) == [0]
            await client.hset(old.held, part_id("order", 0, 1), _grant_record(old))
            settings = Settings(namespace=namespace)
            async with anyio.create_task_group() as group:
                group.start_soon(move_namespace, backend, settings, 16)
                # Every old shard drained but for its hold, for several of the mover's reads:
                await eventually(lambda: _drained_but_for_holds(backend, move.source))
                await anyio.sleep(0.5)
                record = await backend.layout_record(namespace)
                assert record is not None and record.live == move.source, "flipped while held"
                await client.hdel(old.held, part_id("order", 0, 1))
            assert (await _record(redis_url, namespace)).live == move.target
            assert await ks.submit(key, apps.append(1), timeout=30) == [0, 1]
    finally:
        await backend.aclose()


def _grant_record(old: ShardKeys) -> str:
    """A hold's record, as a participant writes it: the grant of a key of ``old`` to attempt 1
    of op ``order``, homed on shard 0."""
    key = keys_on_shard(old.shard, 4, 1, "acct")[0]
    grant = {"t": "g", "op": "order", "a": 1, "s": old.shard, "st": [[key, None]], "f": 1}
    return json.dumps({**grant, "c": "c", "h": 0})


async def _drained_but_for_holds(backend: Backend, layout: Layout) -> bool:
    for keys in layout.all_keys():
        shard = await backend.run_call(quiet(keys))
        if not _drained(keys, replace(shard, held=0)):
            return False
    return True


async def test_a_grant_op_appended_past_a_seal_never_holds_the_move_up(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """A client appends keyserial's grant op past an old shard's seal, as a coordinator of an
    earlier version appended a request (under a part's name, an attempt's, or a plain id): the
    owner refuses each as reserved and holds nothing, so the move finishes, and the key they
    named answers ops after it."""
    key = keys_on_shard(1, 16, 1, "granted")[0]  # (shard 1 of 16, so of 4 too)
    async with _sealed_to_16(redis_url, namespace, key) as (ks, backend, old):
        request = {"home": 0, "op": "order", "attempt": 1, "channel": "c", "to": "1"}
        grants = [
            {"id": op_id, "keys": [key], "op": "keyserial.grant", "kwargs": request}
            for op_id in (part_id("order", 0, 1), "order#1", "order")
        ]
        for grant in grants:
            await client.xadd(old.stream, {"v": "1", "ops": json.dumps([grant])})
        with anyio.fail_after(30):
            await move_namespace(backend, Settings(namespace=namespace), 16)
        assert await client.hlen(old.held) == 0
        assert await ks.submit(key, apps.append(1), timeout=30) == [0, 1]


@contextlib.asynccontextmanager
async def _sealed_to_16(
    redis_url: str, namespace: str, key: str
) -> AsyncIterator[tuple[keyserial.Client, Backend, ShardKeys]]:
    """A worker serving 4 shards, ``key`` appended to on shard 1, and a move to 16 shards
    recorded and shard 1 sealed (not drained): the client, a backend, and shard 1's keys."""
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old = move.source.keys(1)
    backend = await Backend.connect(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(key, apps.append(0)) == [0]
            await backend.run_call(record_move(move))
            await backend.run_call(seal(old, move))
            yield ks, backend, old
    finally:
        await backend.aclose()


def test_the_drain_ends_only_after_two_readings_in_a_row_find_the_same_work() -> None:
    """One all-drained reading is not enough; the next must find each shard's owner and count
    of ops run unchanged, and a busy shard in between starts the count again."""
    readings = QuietReadings()
    assert not readings.settled([], [("1", "5"), ("1", "0")])
    assert not readings.settled([], [("1", "6"), ("1", "0")])  # an op ran between
    assert not readings.settled([], [("2", "6"), ("1", "0")])  # another owner
    assert readings.settled([], [("2", "6"), ("1", "0")])
    readings = QuietReadings()
    assert not readings.settled([], [("1", "5")])
    assert not readings.settled([1], [("1", "5")])
    assert not readings.settled([], [("1", "5")])
    assert readings.settled([], [("1", "5")])


async def test_an_owner_that_has_not_heard_of_its_seal_forwards_what_follows_it(
    redis_url: str, namespace: str
) -> None:
    """The seal is written and no wake-up says so (lost, or late): the old shard's owner,
    polling once in 30 s, is woken by a stale client's own wake-up (its place) for an op it
    pushed past the seal (a plain RPUSH to the inbox: the submit script refuses a sealed
    shard). The step leaves the item in the inbox and reads the seal: the op is forwarded to
    the new layout from the inbox, not run where, after the flip, nobody would read its
    effect, and never moved into the old stream, where a client user could read its id."""
    key = keys_on_shard(1, 16, 1, "late")[0]  # (shard 1 of 16, so of 4 too)
    move = Move(Layout(namespace, 4), Layout(namespace, 16, 1))
    old, new = move.source.keys(1), move.target.keys(1)
    backend = await Backend.connect(redis_url)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(
                redis_url, namespace, shard_count=4, apps=["tests.apps"], idle_poll=30.0
            ) as worker,
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(key, apps.append(0)) == [0]
            await backend.run_call(record_move(move))
            await backend.run_call(seal(old, move))
            runner = worker._owned[old.shard].runner
            assert not runner.sealed
            envelope = {"id": "past-the-seal", "key": key, "op": "append", "args": [1]}
            place = await push_raw_item(client, old, inbox_item([envelope], fresh=False))
            await push_raw_item(client, old, "no form at all")
            await publish(client, old.wake_channel, str(place))
            await eventually(lambda: _holds_op(client, new, "past-the-seal"))
            assert runner.sealed
            assert json.loads(await client.hget(old.state, key)) == [0]
            await _never_moved_past_the_seal(client, old)
            # (What cannot run goes where the heir's would after the flip: the mover copies
            # the old shards' dead letters to the new layout before it.)
            letters = await client.xrange(new.dead)
            assert [fields[b"entry"] for _, fields in letters] == [f"inbox {place + 1}".encode()]
            assert await client.xlen(old.dead) == 0
    finally:
        await client.aclose()
        await backend.aclose()


async def test_an_entry_under_the_largest_id_past_a_seal_holds_no_move_up(
    redis_url: str, namespace: str
) -> None:
    """A client user XADDs an op under the largest stream id there is to a sealed old shard
    (the nemesis's forger found it): the owner forwards it, and no script then asks Redis for
    the entries after that id (an error, not an empty range), so the shard drains, the move
    finishes and the key's ops are answered."""
    key = keys_on_shard(1, 16, 1, "largest")[0]  # (shard 1 of 16, so of 4 too)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with _sealed_to_16(redis_url, namespace, key) as (ks, backend, old):
            envelope = {"id": "at-the-end", "key": key, "op": "append", "args": [1]}
            await client.xadd(old.stream, {"v": "1", "ops": json.dumps([envelope])}, id=LARGEST_ID)
            with anyio.fail_after(30):
                await move_namespace(backend, Settings(namespace=namespace), 16)
            assert await ks.submit(key, apps.append(2), timeout=30) == [0, 1, 2]
    finally:
        await client.aclose()


async def test_strays_are_read_after_every_cursor_but_the_largest_id(
    backend: Backend, namespace: str
) -> None:
    """The owners of retired shards' heirs and the mover read an old shard's strays after its
    drained record, which may name an entry under the largest id there is: no entry can follow
    it, and Redis refuses a range that starts after it (an error, not an empty range), so none
    is asked for, and the other shards of the same read are still read."""
    full, other = ShardKeys(namespace, 0), ShardKeys(namespace, 1)
    await backend.call("XADD", full.stream, LARGEST_ID, "v", "1", "ops", "[]")
    stray = (await backend.call("XADD", other.stream, "*", "v", "1", "ops", "[]")).decode()
    after_full, after_other = await backend.entries_since([(full, LARGEST_ID), (other, "0-0")], 10)
    assert after_full == []
    assert [entry_id.decode() for entry_id, _ in after_other] == [stray]
