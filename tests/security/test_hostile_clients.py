"""A client-ACL user who publishes on every channel it can name: coordination messages are
hints. A worker acts on a grant or a decision only as its fenced record in Redis says, and takes
a grant request only from a message a listed worker signed for it, so a forged message costs a
read, never a write (the pushes' twin: tests/client/test_push.py)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial._backend.backend import Backend
from keyserial._scripts.cross import ResolveArgs, resolve
from keyserial._scripts.refusals import AttemptAhead
from keyserial._wire.codec import LARGEST_ID
from keyserial._wire.layout import decision_field, part_id, signers_key
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.entries import envelope, push_item, stored
from tests.helpers import (
    eventually,
    keys_on_shard,
    lends,
    looked_up,
    publish,
    subscribe,
    workers_split_around,
)
from tests.signers import (
    GRANT_OP,
    introduce,
    listed_signer,
    message,
    next_request,
    owner_of,
    request,
    request_channels,
)
from tests.users import Users, documented_users

SHARDS = 8
HOME, PARTICIPANT = 1, 5
#: What a worker logs of a request in a message no listed worker signed for it.
IGNORED = ("ignoring a grant request", "no listed worker signed for this")


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    """The documented worker and client users; the attacker connects as the client."""
    with documented_users(redis_url) as created:
        yield created


async def _append(
    attacker: redis.asyncio.Redis, shard: int, namespace: str, envelopes: list[dict[str, Any]]
) -> None:
    """An entry pushed to the shard's inbox as the documented wire format has it (a plain
    RPUSH, then a wake-up naming its place), with a client's rights: its owner moves it into
    the stream and runs it."""
    await push_item(attacker, namespace, shard, envelopes, fresh=False, wake=True)


@asynccontextmanager
async def _one_worker_and_an_attacker(
    users: Users, namespace: str, **options: Any
) -> AsyncIterator[tuple[keyserial.Client, redis.asyncio.Redis]]:
    """A worker on every shard (with ``options``), a client of the victim's, and the
    attacker's connection (the client user's too)."""
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS, **options),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            yield ks, attacker
    finally:
        await attacker.aclose()


@asynccontextmanager
async def _listening_for_requests(
    users: Users, attacker: redis.asyncio.Redis, namespace: str
) -> AsyncIterator[Any]:
    """The attacker subscribed where coordinators send the participant shard's owner its
    grant requests (the owner's channel, read off the shard's lease: a client user may
    subscribe to any worker's channel)."""
    async with attacker.pubsub() as pubsub:
        for channel in request_channels(users.admin, namespace, PARTICIPANT):
            await subscribe(pubsub, channel)
        yield pubsub


def _ignored(caplog: pytest.LogCaptureFixture) -> int:
    """How many grant requests the workers dropped so far for want of a listed signer."""
    return sum(all(text in record.getMessage() for text in IGNORED) for record in caplog.records)


@pytest.mark.slow
async def test_a_forged_decision_notice_never_writes_a_state(users: Users, namespace: str) -> None:
    """A grant request naming the attacker as coordinator (signed by a listed signer: a client
    user cannot sign one, see tests/crossshard/test_grant_requests.py), whose grant tells the
    attacker the participant's worker channel; the attacker publishes a decision that sets the
    victim's balance. The participant reads the decision record instead: there is none, so it
    holds the key until the home shard's epoch moves on, then aborts; the balance is intact.
    (On a cluster it stores its part as released; on one server, where it lent the key, it
    stores nothing, and the abort is the decision record's.)"""
    victim = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    own_channel = f"ks:attacker:{uuid.uuid4().hex}"
    try:
        async with (
            running_worker(
                users.worker_url, namespace, shard_count=SHARDS, shards=[PARTICIPANT]
            ) as worker,
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            attacker.pubsub() as pubsub,
        ):
            assert await ks.submit(victim, deposit(100)) == 100
            await pubsub.subscribe(own_channel)
            signer = listed_signer(users.admin, namespace)
            await introduce(attacker, worker, signer)
            asked = request(
                home=HOME,
                participant=PARTICIPANT,
                op="evil",
                attempt=0,
                channel=own_channel,
                keys=[victim],
            )
            owner = owner_of(users.admin, namespace, PARTICIPANT)
            await publish(attacker, owner, message(signer, owner, asked))
            grant = await _next_message(pubsub)
            assert grant["t"] == "g"
            notice = {
                "t": "d",
                "op": "evil",
                "a": 0,
                "d": {"w": {str(PARTICIPANT): [[victim, "1000000"]]}},
            }
            await publish(attacker, grant["c"], json.dumps(notice))
            # The home shard gets an owner: its epoch passes the attempt, which is aborted.
            async with running_worker(
                users.worker_url, namespace, shard_count=SHARDS, shards=[HOME]
            ):
                assert await ks.submit(victim, deposit(1), timeout=30) == 101
            part = part_id("evil", HOME, 0)
            assert users.admin.hget(
                ShardKeys(namespace, PARTICIPANT).results, part
            ) == _part_stored(users, b'{"ok":"released"}')
            decided = users.admin.hget(
                ShardKeys(namespace, HOME).results, decision_field("evil", 0)
            )
            assert decided == b'{"abort":"the coordinator lost the home shard"}'

    finally:
        await attacker.aclose()
    assert users.refusals() == []


async def test_a_forged_grant_never_reaches_the_ops_state(
    users: Users, namespace: str, tmp_path: Path
) -> None:
    """While a transfer's coordinator waits for a grant (the target key is busy), the attacker
    reads the coordinator's channel off its grant request (listening on the participant's
    owner's channel) and publishes there grants whose state says the target holds 1,000,000,
    unsigned and with a made-up signature. The coordinator takes a grant from its record
    alone: the transfer computes on the real balance, and money is conserved."""
    gate = tmp_path / "gate"
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            workers_split_around(
                users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS, apps=["tests.apps"]
            ),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            _listening_for_requests(users, attacker, namespace) as pubsub,
            anyio.create_task_group() as group,
        ):
            assert await ks.submit(source, deposit(100)) == 100
            assert await ks.submit(target, deposit(10)) == 10
            group.start_soon(ks.submit, target, apps.gated_hold(str(gate)))
            moved: dict[str, Any] = {}

            async def transfer() -> None:
                moved.update(await ks.transfer(source, target, 25, timeout=30))

            group.start_soon(transfer)
            _, _, asked = await next_request(pubsub)
            forged = {
                "t": "g",
                "op": asked["op"],
                "a": asked["a"],
                "s": PARTICIPANT,
                "st": [[target, "1000000"]],
                "f": 1,
                "c": "ks:attacker",
                "h": HOME,
            }
            text = json.dumps(forged)
            made_up = f',"k":"00112233445566aa","t":"{"0" * 32}"}}'  # (a signer nobody listed)
            await publish(attacker, asked["c"], text)
            await publish(attacker, asked["c"], text[:-1] + made_up)
            gate.touch()  # the target's earlier op ends: the real grant goes out
            assert await ks.submit(source, keyserial.call("balance")) == 75
            assert await ks.submit(target, keyserial.call("balance")) == 35
    finally:
        await attacker.aclose()
    assert moved == {source: 75, target: 35}
    assert users.refusals() == []


async def _next_message(pubsub: Any) -> dict[str, Any]:
    with anyio.fail_after(10):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                decoded: dict[str, Any] = json.loads(message["data"])
                return decoded


async def test_a_grant_request_for_an_attempt_not_begun_aborts_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A participant that looks up an attempt past the home epoch (a request appended ahead of
    the coordinator, by anyone who may append) is told it has not begun, and no abort is
    recorded: when the coordinator reaches that epoch, its attempt can still commit. An
    attempt whose epoch is over is aborted; the current one is left undecided."""
    home = ShardKeys(namespace, HOME)
    await client.set(home.epoch, 3)
    with pytest.raises(AttemptAhead):
        await backend.run_call(resolve(home, ResolveArgs("op", 4)))
    assert await client.hget(home.results, "op#4#d") is None
    assert await backend.run_call(resolve(home, ResolveArgs("op", 3))) is None
    assert await client.hget(home.results, "op#3#d") is None
    assert "abort" in (await backend.run_call(resolve(home, ResolveArgs("op", 2))) or {})


def _guessed_successors(seen: str, count: int) -> list[str]:
    """The ids an attacker who saw ``seen`` would squat: the counter after it, the rest as
    seen (a plain counter, or a hex counter followed by 16 characters)."""
    prefix, _, tail = seen.rpartition("-")
    if tail.isdigit():
        return [f"{prefix}-{int(tail) + step}" for step in range(1, count + 1)]
    counter, rest = tail[:-16], tail[-16:]
    return [f"{prefix}-{int(counter, 16) + step:x}{rest}" for step in range(1, count + 1)]


async def test_ops_appended_under_a_client_s_guessed_next_ids_never_answer_it(
    users: Users, namespace: str
) -> None:
    """The attacker sees one op id of the victim's client and appends ops ahead under the ids
    that would come next. The client's ids carry random bits: none is hit, and every one of
    the victim's deposits applies and returns its own balance."""
    key = keys_on_shard(0, SHARDS, 1, "acct")[0]
    async with _one_worker_and_an_attacker(users, namespace) as (ks, attacker):
        seen = ks.new_op_id()
        squatted = [
            {"id": op_id, "key": key, "op": "balance"} for op_id in _guessed_successors(seen, 20)
        ]
        await _append(attacker, 0, namespace, squatted)
        balances = [await ks.submit(key, deposit(100)) for _ in range(5)]
        assert balances == [100, 200, 300, 400, 500]


def _submit_script() -> str:
    """The submit script's text, as a foreign client sends it (docs/wire-format.md)."""
    return resources.files("keyserial._scripts").joinpath("lua/submit.lua").read_text()


async def _append_fresh(
    attacker: redis.asyncio.Redis,
    shard: int,
    namespace: str,
    envelopes: list[dict[str, Any]],
    *,
    pushed: bool,
) -> None:
    """An entry marked ``fresh``: with the submit script (so it is pushed to the owner with its
    wake-up) or a plain RPUSH to the shard's inbox and a plain wake-up naming its place (so the
    owner fetches it)."""
    keys = ShardKeys(namespace, shard)
    if pushed:
        ops = json.dumps(envelopes)
        await attacker.eval(_submit_script(), 1, keys.inbox, 0, "1", ops, keys.wake_channel, "1")
    else:
        place = await push_item(attacker, namespace, shard, envelopes, fresh=True)
        await attacker.publish(keys.wake_channel, str(place))


@pytest.mark.parametrize("pushed", [False, True], ids=["fetched", "pushed"])
async def test_an_op_appended_again_as_fresh_never_runs_twice(
    users: Users, namespace: str, pushed: bool
) -> None:
    """The attacker appends a committed op's envelope again, claiming its id is new
    (``fresh``), fetched or pushed. The owner may run it, but an outcome is written once: the
    commit is refused, the owner starts again from Redis and answers the op from its record.
    The balance and the stored outcome are the first run's; the shard keeps serving."""
    key = keys_on_shard(0, SHARDS, 1, "acct")[0]
    async with _one_worker_and_an_attacker(users, namespace) as (ks, attacker):
        op_id = ks.new_op_id()
        assert await ks.submit(key, deposit(10), op_id=op_id) == 10
        replay = {"id": op_id, "key": key, "op": "deposit", "args": [10]}
        for _ in range(3):
            await _append_fresh(attacker, 0, namespace, [replay], pushed=pushed)
        assert await ks.submit(key, deposit(1), timeout=30) == 11
        assert await stored(attacker, namespace, 0, op_id) == {"ok": 10}
        assert await ks.submit(key, deposit(1)) == 12
    assert users.refusals() == []


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["one-worker", "two-workers"])
async def test_a_transfer_appended_again_as_fresh_never_moves_money_twice(
    users: Users, namespace: str, split: bool
) -> None:
    """The same for a cross-shard op: committed in one script by a worker that owns both
    shards, or through a grant and a decision between two workers. Its replay's commit or
    decision finds the op's outcome stored and the writes not holding, and writes nothing."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    workers = (
        workers_split_around(users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS)
        if split
        else running_worker(users.worker_url, namespace, shard_count=SHARDS)
    )
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with workers, keyserial.connect(users.client_url, namespace=namespace) as ks:
            assert await ks.submit(source, deposit(100)) == 100
            op_id = ks.new_op_id()
            moved = await ks.transfer(source, target, 25, op_id=op_id, timeout=30)
            replay = {"id": op_id, "keys": [source, target], "op": "transfer", "args": [25]}
            for pushed in (False, True):
                await _append_fresh(attacker, HOME, namespace, [replay], pushed=pushed)
            assert await ks.submit(source, deposit(1), timeout=30) == 76
            assert await ks.submit(target, deposit(1), timeout=30) == 26
            assert await stored(attacker, namespace, HOME, op_id) == {"ok": moved}
    finally:
        await attacker.aclose()
    assert users.refusals() == []


@pytest.mark.parametrize("pushed", [False, True], ids=["fetched", "pushed"])
async def test_a_copy_of_an_answered_grant_request_appended_as_fresh_leaves_no_hold(
    users: Users, namespace: str, pushed: bool
) -> None:
    """The attacker captures a transfer's grant request (listening on the participant's
    owner's channel) and, once its part was applied, pushes it as fresh to the participant's
    inbox, fetched or pushed, as a ``keyserial.grant`` op under its part's id. Intake
    refuses it ('#' is reserved; so is the name): no hold is recorded, the part's answer is
    intact, money moved once, and the keys serve."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    participant = ShardKeys(namespace, PARTICIPANT)
    own_channel = f"ks:attacker:{uuid.uuid4().hex}"
    funded = _split_and_funded(users, namespace, ((source, 100), (target, 10)))
    async with (
        funded as (ks, attacker, _),
        _listening_for_requests(users, attacker, namespace) as pubsub,
        attacker.pubsub() as replies,
    ):
        await replies.subscribe(own_channel)
        assert await ks.transfer(source, target, 25, timeout=30) == {source: 75, target: 35}
        _, _, asked = await next_request(pubsub)
        answered = part_id(asked["op"], asked["h"], asked["a"])
        applied = _part_stored(users, b'{"ok":"applied"}')
        if applied is not None:
            await eventually(lambda: users.admin.hget(participant.results, answered))
        assert users.admin.hget(participant.results, answered) == applied
        copy = {"id": answered, "keys": asked["k"], "op": GRANT_OP, "kwargs": asked}
        await _append_fresh(
            attacker, PARTICIPANT, namespace, [{**copy, "reply": own_channel}], pushed=pushed
        )
        ((op_id, outcome),) = (await _next_message(replies))["r"]
        assert op_id == answered
        assert outcome["error"]["type"] == "keyserial.MalformedOperation"
        assert "'#' is reserved" in outcome["error"]["message"]
        assert await ks.submit(target, deposit(1), timeout=10) == 36
        assert users.admin.hgetall(participant.held) == {}
        assert users.admin.hget(participant.results, answered) == applied
        assert await ks.read(source) == 75


async def test_an_op_appended_ahead_under_a_callers_op_id_never_answers_the_caller(
    users: Users, namespace: str
) -> None:
    """The attacker guesses an op id a caller chooses (an order number) and appends its own op
    under it first, and two ops under another id in one entry. The caller's submit is refused
    with MalformedOperation (its id belongs to another op), never answered with the attacker's
    outcome as if its own op had applied, nor is its lookup of the id with its op; of two ops
    under one id, the second is refused while the first runs (its reply says so), never joined
    to it."""
    key = keys_on_shard(0, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    own_channel = f"ks:attacker:{uuid.uuid4().hex}"
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            attacker.pubsub() as pubsub,
        ):
            await pubsub.subscribe(own_channel)
            await _append(
                attacker,
                0,
                namespace,
                [
                    {"id": "order-7", "key": key, "op": "deposit", "args": [1]},
                    {"id": "order-8", "key": key, "op": "deposit", "args": [1]},
                    {
                        "id": "order-8",
                        "key": key,
                        "op": "deposit",
                        "args": [1000],
                        "reply": own_channel,
                    },
                ],
            )
            ((op_id, outcome),) = (await _next_message(pubsub))["r"]
            assert op_id == "order-8"
            assert outcome["error"]["type"] == "keyserial.MalformedOperation"
            with pytest.raises(keyserial.MalformedOperation, match="belongs to another op"):
                await ks.submit(key, deposit(100), op_id="order-7")
            # (Looked up by id with its op: refused too. With no op to check, the id's outcome.)
            with pytest.raises(keyserial.MalformedOperation, match="belongs to another op"):
                await ks.result("order-7", key=key, op=deposit(100))
            assert await ks.result("order-7", key=key) == 1
            assert await ks.read(key) == 2
            assert await stored(attacker, namespace, 0, "order-8") == {"ok": 2}
    finally:
        await attacker.aclose()
    assert users.refusals() == []


@asynccontextmanager
async def _split_and_funded(
    users: Users, namespace: str, balances: tuple[tuple[str, int], ...]
) -> AsyncIterator[tuple[keyserial.Client, redis.asyncio.Redis, int]]:
    """Two workers split around the participant shard, the accounts deposited, and an attacker
    connected as the client user: ``(client, attacker, the home shard's epoch)``. (The epoch is
    read as admin here; an attacker reads it off earlier grant requests.) By the end the server
    refused neither user anything (its ACL log)."""
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            workers_split_around(users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            for key, amount in balances:
                await ks.submit(key, deposit(amount))
            yield ks, attacker, int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0)
    finally:
        await attacker.aclose()
    assert users.refusals() == []


def _ahead_for(namespace: str, attempt: int, decoy: str) -> Any:
    """A grant request of op "order-9"'s current attempt for ``decoy``, not the transfer's
    key, as an attacker sends it ahead of the coordinator's."""
    return request(
        home=HOME,
        participant=PARTICIPANT,
        op="order-9",
        attempt=attempt,
        channel=f"ks:attacker:{uuid.uuid4().hex}",
        keys=[decoy],
    )


async def test_a_grant_request_appended_ahead_under_an_attempts_id_never_decides_the_op(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker guesses a transfer's op id (the caller's order number) and its attempt (the
    home shard's epoch), and asks the participant shard ahead of the coordinator for another
    key under that attempt: in its inbox (moved into its stream, and refused at intake) and in
    an unsigned message on its owner's channel (dropped). Neither holds a key or stores
    anything under the attempt's part there: the transfer then runs under that attempt, moves
    the money once, between the right keys, and the other key was never held."""
    caplog.set_level(logging.INFO, "keyserial.worker")
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target, decoy = keys_on_shard(PARTICIPANT, SHARDS, 2, "acct")
    participant = ShardKeys(namespace, PARTICIPANT)
    own_channel = f"ks:attacker:{uuid.uuid4().hex}"
    funded = _split_and_funded(users, namespace, ((source, 100), (target, 10), (decoy, 5)))
    async with funded as (ks, attacker, attempt), attacker.pubsub() as replies:
        await replies.subscribe(own_channel)
        ahead = _ahead_for(namespace, attempt, decoy)
        field = part_id("order-9", HOME, attempt)
        entry = {"id": field, "keys": [decoy], "op": GRANT_OP, "kwargs": ahead.to_wire()}
        await _append(attacker, PARTICIPANT, namespace, [{**entry, "reply": own_channel}])
        ((op_id, outcome),) = (await _next_message(replies))["r"]
        assert (op_id, outcome["error"]["type"]) == (field, "keyserial.MalformedOperation")
        before = _ignored(caplog)
        for channel in request_channels(users.admin, namespace, PARTICIPANT):
            await publish(attacker, channel, message(None, channel, ahead))
        await eventually(lambda: _ignored(caplog) >= before + 1)
        assert await stored(attacker, namespace, PARTICIPANT, field) is None
        assert users.admin.hlen(participant.held) == 0
        moved = await ks.transfer(source, target, 25, op_id="order-9", timeout=30)
        assert moved == {source: 75, target: 35}
        assert await ks.submit(decoy, deposit(1), timeout=30) == 6
        assert int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0) == attempt
        # (The transfer's own request was applied under the attempt, and holds nothing now.)
        assert users.admin.hget(participant.results, field) == _part_stored(
            users, b'{"ok":"applied"}'
        )
        assert users.admin.hlen(participant.held) == 0


@pytest.mark.slow
async def test_a_signed_grant_request_ahead_for_other_keys_never_decides_the_op(
    users: Users, namespace: str
) -> None:
    """The same request ahead, but signed for the participant's owner by a listed signer
    (what only a worker can send): the participant grants the other key as the attempt's part,
    and takes the coordinator's request as the same part's; the coordinator sees the
    grant is not of the keys it asked for, gives the home shard up, and the op runs under the
    next owner's attempt: it moves the money once, between the right keys, and the other key
    is released."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target, decoy = keys_on_shard(PARTICIPANT, SHARDS, 2, "acct")
    participant = ShardKeys(namespace, PARTICIPANT)
    funded = _split_and_funded(users, namespace, ((source, 100), (target, 10), (decoy, 5)))
    async with funded as (ks, attacker, attempt):
        signer = listed_signer(users.admin, namespace)
        owner = owner_of(users.admin, namespace, PARTICIPANT)
        asked = _ahead_for(namespace, attempt, decoy)
        ahead = message(signer, owner, asked)
        async with attacker.pubsub() as grants:
            await grants.subscribe(asked.channel)
            # (Sent again until taken: the owner reads the signer's entry when it first meets
            # it. Taken, it is held: its hold recorded, or its lent grant sent.)
            await eventually(
                lambda: _sent_then_held(
                    attacker, owner, ahead, participant, part_id("order-9", HOME, attempt), grants
                ),
                interval=0.2,
            )
        moved = await ks.transfer(source, target, 25, op_id="order-9", timeout=30)
        assert moved == {source: 75, target: 35}
        assert await ks.submit(decoy, deposit(1), timeout=30) == 6
        assert int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0) > attempt


async def test_an_op_under_a_callers_op_id_homed_on_another_shard_never_takes_its_part(
    users: Users, namespace: str
) -> None:
    """The attacker submits, under a caller's op id, a transfer of its own homed on another
    shard at the same epoch, to the caller's participant shard: both attempts are
    ``<op id>#<epoch>``, and only their homes tell their parts there apart. The caller's
    transfer, acknowledged, must still apply on both of its shards: money conserved, the
    attacker's op moving only its own, each part recorded under its own name."""
    source, other = (
        keys_on_shard(HOME, SHARDS, 1, "acct")[0],
        keys_on_shard(2, SHARDS, 1, "acct")[0],
    )
    target, decoy = keys_on_shard(PARTICIPANT, SHARDS, 2, "acct")
    participant = ShardKeys(namespace, PARTICIPANT)
    funded = _split_and_funded(users, namespace, ((source, 100), (other, 100)))
    async with funded as (ks, _, attempt):
        assert int(users.admin.get(ShardKeys(namespace, 2).epoch) or 0) == attempt
        moved = await ks.transfer(other, decoy, 7, op_id="order-9", timeout=30)
        assert moved == {other: 93, decoy: 7}
        moved = await ks.transfer(source, target, 25, op_id="order-9", timeout=30)
        assert moved == {source: 75, target: 25}
        assert await ks.submit(target, deposit(1), timeout=10) == 26
        assert await ks.read(decoy) == 7
        parts = [part_id("order-9", home, attempt) for home in (2, HOME)]
        applied = _part_stored(users, b'{"ok":"applied"}')
        if applied is not None:
            await eventually(lambda: all(users.admin.hmget(participant.results, parts)))
        assert users.admin.hmget(participant.results, parts) == [applied] * 2


async def _sent_then_held(
    attacker: redis.asyncio.Redis,
    owner: str,
    sent: str,
    participant: ShardKeys,
    field: str,
    grants: Any,
) -> bool:
    await publish(attacker, owner, sent)
    if await attacker.hget(participant.held, field):
        return True
    return await grants.get_message(ignore_subscribe_messages=True, timeout=0.1) is not None


def _part_stored(users: Users, answer: bytes) -> bytes | None:
    """What a participant stores under its part's name once done: ``answer`` where it records
    its holds (a cluster), nothing where it lends its grants (one server)."""
    return None if lends(users.worker_url) else answer


async def test_an_op_ahead_under_an_attempts_record_name_stores_nothing_there(
    users: Users, namespace: str
) -> None:
    """The attacker appends to the participant shard an op under the name of the record where
    that shard keeps what became of its part of a transfer (``<op id>#<home>.<attempt>``: the
    caller's order number, the home shard and its epoch). Refused ('#' is reserved), it is
    replied to and never stored: stored, the refusal would stand in for that record, and the
    participant, finding its part answered, would never apply it (money made from nothing)."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target, decoy = keys_on_shard(PARTICIPANT, SHARDS, 2, "acct")
    participant = ShardKeys(namespace, PARTICIPANT)
    funded = _split_and_funded(users, namespace, ((source, 100), (target, 10)))
    async with funded as (ks, attacker, attempt):
        record = part_id("order-9", HOME, attempt)
        await _append(
            attacker,
            PARTICIPANT,
            namespace,
            [
                envelope(record, target, "deposit", 1_000),
                envelope("after", decoy, "deposit", 5),
            ],
        )
        # (One entry, one step: the refusal would be stored with the op after it.)
        await eventually(lambda: attacker.hget(participant.results, "after"))
        assert await stored(attacker, namespace, PARTICIPANT, record) is None
        moved = await ks.transfer(source, target, 25, op_id="order-9", timeout=30)
        assert moved == {source: 75, target: 35}
        assert await ks.submit(target, deposit(1), timeout=10) == 36
        applied = None if lends(users.worker_url) else {"ok": "applied"}
        assert await stored(attacker, namespace, PARTICIPANT, record) == applied


async def test_a_signed_grant_request_copied_to_another_worker_is_dropped(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A genuine request (signed by the coordinator's worker for the participant's owner),
    captured and published on another worker's channel, as it is and rewritten for a shard
    that worker owns: signed for neither, each is dropped, holding nothing there and storing
    nothing under the attempt's part id (the name of that shard's own part of a transfer); the
    transfer of that op id then commits there too."""
    caplog.set_level(logging.INFO, "keyserial.worker")
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    elsewhere = keys_on_shard(PARTICIPANT + 1, SHARDS, 1, "acct")[0]
    other = ShardKeys(namespace, PARTICIPANT + 1)
    funded = _split_and_funded(users, namespace, ((source, 100), (target, 10), (elsewhere, 10)))
    async with (
        funded as (ks, attacker, _),
        _listening_for_requests(users, attacker, namespace) as pubsub,
    ):
        moved = await ks.transfer(source, target, 25, op_id="order-8", timeout=30)
        assert moved == {source: 75, target: 35}
        _, captured, asked = await next_request(pubsub)
        text = captured.decode()
        suffix = text[text.rindex(',"k":') :]  # (the signature)
        retargeted = asked | {"s": str(PARTICIPANT + 1), "k": [elsewhere]}
        copies = [captured, (json.dumps(retargeted)[:-1] + suffix).encode()]
        before = _ignored(caplog)
        for channel in request_channels(users.admin, namespace, PARTICIPANT + 1):
            for copy in copies:
                await publish(attacker, channel, copy)
        await eventually(lambda: _ignored(caplog) >= before + len(copies))
        field = part_id("order-8", asked["h"], asked["a"])
        assert await stored(attacker, namespace, PARTICIPANT + 1, field) is None
        assert users.admin.hlen(other.held) == 0
        assert await ks.submit(elsewhere, deposit(1), timeout=10) == 11
        moved = await ks.transfer(source, elsewhere, 25, op_id="order-9", timeout=30)
        assert moved == {source: 50, elsewhere: 36}
        assert await ks.read(target) == 35


_FORGED = (
    {"ok": 1_000_000},
    {"error": {"type": "x", "message": "forged"}},
    {"error": {"type": "keyserial.UnknownOperation", "message": "forged"}},
)
_MALFORMED = (5, {"error": 5}, {"neither": 1}, [1])


async def _waiting_entry(
    users: Users, attacker: redis.asyncio.Redis, namespace: str, shard: int
) -> tuple[int, list[Any]]:
    """The one entry waiting in the shard's inbox, once there is one: its place, as a client
    user reads it (the inbox's taken count and length), and its ops. (These are read as admin:
    a client user may not read a list's items, but learns an op's id and reply channel from a
    fresh entry's push on the wake channel, or from the entry once its owner moved it into the
    stream, which a client user may read.)"""
    keys = ShardKeys(namespace, shard)
    (item,) = await eventually(lambda: users.admin.lrange(keys.inbox, 0, -1))
    taken, length = await attacker.get(keys.inbox_taken), await attacker.llen(keys.inbox)
    return int(taken or 0) + length, json.loads(item.partition(b"\n")[2])


async def _forge_replies(
    users: Users,
    attacker: redis.asyncio.Redis,
    namespace: str,
    shard: int,
    caplog: pytest.LogCaptureFixture,
    *,
    forged: tuple[Any, ...] = _FORGED + _MALFORMED,
    logged: str = "no outcome for them",
) -> str:
    """Find the waiting op in the shard's inbox, publish ``forged`` outcomes for it on its reply
    channel, one by one, each once its client has logged the one before (``logged``); the op's
    id."""
    _, (envelope,) = await _waiting_entry(users, attacker, namespace, shard)
    op_id = envelope["id"]

    def handled() -> int:
        return sum(
            op_id in record.getMessage() and logged in record.getMessage()
            for record in caplog.records
        )

    for outcome in forged:
        before = handled()
        await publish(attacker, envelope["reply"], json.dumps({"v": 1, "r": [[op_id, outcome]]}))
        await eventually(lambda before=before: handled() > before, message=f"{outcome!r} handled")
    return op_id


@asynccontextmanager
async def _a_deposit_waiting(
    users: Users, namespace: str, key: str, **options: Any
) -> AsyncIterator[tuple[keyserial.Client, redis.asyncio.Redis, list[int]]]:
    """A caller's deposit(10) on ``key``, submitted while no worker serves, and the attacker's
    connection, both as the client user; the list gets the deposit's value once answered.
    (The shard count is recorded first, as a worker would: a client user may not.)"""
    await _record_shard_count(users, namespace)
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    answered: list[int] = []
    try:
        async with (
            keyserial.connect(users.client_url, namespace=namespace, **options) as ks,
            anyio.create_task_group() as group,
        ):

            async def deposit_10() -> None:
                answered.append(await ks.submit(key, deposit(10), timeout=30))

            group.start_soon(deposit_10)
            yield ks, attacker, answered
    finally:
        await attacker.aclose()


async def _served(users: Users, namespace: str, answered: list[int], **options: Any) -> None:
    """A worker on every shard, until it has answered the waiting caller."""
    async with running_worker(users.worker_url, namespace, shard_count=SHARDS, **options):
        await eventually(lambda: answered, message="the caller's answer")


async def test_a_forged_reply_never_answers_a_caller(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients of one service share a user, which may publish on their reply channels. A
    reply only says "look now": the caller reads its outcome from the shard's records, so a
    forged value, or a malformed one, never reaches it."""
    key = keys_on_shard(2, SHARDS, 1, "acct")[0]
    async with _a_deposit_waiting(users, namespace, key) as (_, attacker, answered):
        await _forge_replies(users, attacker, namespace, 2, caplog)
        assert answered == []
        await _served(users, namespace, answered)
        assert answered == [10]
    assert users.refusals() == []


async def test_a_refusal_recorded_for_an_earlier_entry_never_answers_a_resubmit(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An op no worker knew was refused (UnknownOperation) and the refusal recorded for its
    entry. Its resubmit after the deploy is a new entry: a wake-up that comes before it ran
    finds only the old entry's refusal, and settles nothing."""
    key = keys_on_shard(3, SHARDS, 1, "evt")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        await _record_shard_count(users, namespace)
        async with keyserial.connect(users.client_url, namespace=namespace) as ks:
            async with running_worker(users.worker_url, namespace, shard_count=SHARDS):
                with pytest.raises(keyserial.UnknownOperation):
                    await ks.submit(key, apps.record(), op_id="order-9", timeout=10)
                stream = ShardKeys(namespace, 3).stream
                await eventually(lambda: _empty(attacker, stream))
            async with _resubmitted(ks, key) as results:
                assert await _forge_replies(users, attacker, namespace, 3, caplog) == "order-9"
                assert results == []
                await _served(users, namespace, results, apps=["tests.apps"])
            assert results == [1]
    finally:
        await attacker.aclose()
    assert users.refusals() == []


async def test_a_signed_reply_replayed_for_a_resubmit_never_answers_it(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's signed reply answers only the entry it names. Its signed UnknownOperation for
    an op's first entry, replayed by a client user while the op's resubmit (a new entry)
    waits, is looked up instead, and settles nothing."""
    key = keys_on_shard(3, SHARDS, 1, "evt")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        await _record_shard_count(users, namespace)
        async with (
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            attacker.pubsub() as listener,
        ):
            reply = ks._reply_for(ks.layout.keys(3))  # (its shard's, on a cluster)
            await subscribe(listener, reply)  # (any client user may)
            async with running_worker(users.worker_url, namespace, shard_count=SHARDS):
                with pytest.raises(keyserial.UnknownOperation):
                    await ks.submit(key, apps.record(), op_id="order-9", timeout=10)
            signed = await _published(listener)
            signer = json.loads(signed)["k"]
            await eventually(lambda: ks._verifier.knows(signer))
            async with _resubmitted(ks, key) as results:
                await eventually(
                    lambda: any(pending.entry for pending in ks._waiting.get("order-9", ()))
                )
                await publish(attacker, reply, signed)
                await eventually(
                    lambda: any(
                        "no outcome for them" in record.getMessage() for record in caplog.records
                    )
                )
                assert results == []
                await _served(users, namespace, results, apps=["tests.apps"])
            assert results == [1]
    finally:
        await attacker.aclose()
    assert users.refusals() == []


@asynccontextmanager
async def _resubmitted(ks: keyserial.Client, key: str) -> AsyncIterator[list[int]]:
    """Op "order-9" (``record``) submitted again, waiting in a task for the block; the list
    gets its value once answered."""
    results: list[int] = []

    async def resubmit() -> None:
        results.append(await ks.submit(key, apps.record(), op_id="order-9", timeout=30))

    async with anyio.create_task_group() as group:
        group.start_soon(resubmit)
        yield results


async def _published(listener: redis.client.PubSub) -> bytes:
    """The next message published on a channel ``listener`` subscribed to."""
    with anyio.fail_after(10):
        while True:
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                data: bytes = message["data"]
                return data


async def test_a_signed_reply_of_another_shard_never_settles_a_submit(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The victim's deposit waits on shard 2, which no worker serves yet. A client user pushes
    a copy of its entry to shard 6's inbox, where it lands at the same place (a shard's places
    count its pushes from 1, and no item was pushed to shard 6 before; a client user may read
    any inbox's taken count and length, so knows the places of the items in it): shard 6's
    owner refuses the misrouted op with a genuine reply, signed for the victim and naming that
    place, but shard 6. The client looks the op up on its own shard instead, finds nothing, and
    keeps waiting: the deposit applies once, and its caller gets its outcome."""
    key, other = keys_on_shard(2, SHARDS, 1, "acct")[0], keys_on_shard(7, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    answered: list[Any] = []
    try:
        await _record_shard_count(users, namespace)
        async with (
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            anyio.create_task_group() as group,
        ):

            async def deposit_10() -> None:
                try:
                    answered.append(await ks.submit(key, deposit(10), timeout=30))
                except keyserial.KeyserialError as exc:
                    answered.append(exc)

            workers = running_worker(users.worker_url, namespace, shards=[6, 7], shard_count=SHARDS)
            async with workers:
                assert await ks.submit(other, deposit(1)) == 1  # (the client meets the signer)
                signers = await eventually(lambda: users.admin.hkeys(signers_key(namespace)))
                await eventually(lambda: ks._verifier.knows(signers[0].decode()))
                group.start_soon(deposit_10)
                place, envelopes = await _waiting_entry(users, attacker, namespace, 2)
                (envelope,) = envelopes
                await eventually(
                    lambda: any(pending.entry for pending in ks._waiting[envelope["id"]])
                )
                waiting = [pending.entry.place for pending in ks._waiting[envelope["id"]]]
                assert waiting == [str(place)]
                signed = await _refused_elsewhere(attacker, namespace, 6, place, envelopes)
                ((_, refusal),) = json.loads(signed)["r"]
                assert "t" in json.loads(signed), "signed for the victim"
                assert (refusal["s"], refusal["e"]) == (6, [str(place)])
                await publish(attacker, envelope["reply"], signed)  # (where the victim listens)
                await eventually(lambda: answered or looked_up(caplog, envelope["id"]))
                assert answered == [], "the refusal of another shard settled the submit"
            await _served(users, namespace, answered)
            assert answered == [10]
            assert await ks.read(key) == 10
    finally:
        await attacker.aclose()
    assert users.refusals() == []


async def _refused_elsewhere(
    attacker: redis.asyncio.Redis,
    namespace: str,
    shard: int,
    place: int,
    envelopes: list[Any],
) -> bytes:
    """Push a copy of an entry (its ops) to ``shard``'s inbox, where it must land at ``place``;
    the reply its owner publishes on the (first) op's channel."""
    async with attacker.pubsub() as listener:
        # (Published by another slot's script, so with PUBLISH, even on a cluster.)
        await listener.subscribe(envelopes[0]["reply"])
        copied = await push_item(attacker, namespace, shard, envelopes, fresh=False, wake=True)
        assert copied == place, "the copy landed at another place than the entry it copies"
        return await _published(listener)


@pytest.mark.slow
async def test_a_client_that_trusts_replies_ignores_malformed_ones(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``verify_replies=False`` a reply's outcome is taken as it is (for a client user
    no untrusted client shares), but one that is not an outcome is ignored, never raised at
    the caller as a TypeError."""
    key = keys_on_shard(2, SHARDS, 1, "acct")[0]
    async with _a_deposit_waiting(users, namespace, key, verify_replies=False) as (
        _,
        attacker,
        answered,
    ):
        await _forge_replies(
            users, attacker, namespace, 2, caplog, forged=_MALFORMED, logged="malformed reply"
        )
        assert answered == []
        await _served(users, namespace, answered)
        assert answered == [10]


async def _record_shard_count(users: Users, namespace: str) -> None:
    """What the first worker would do: a client user may not record the shard count."""
    async with keyserial.connect(users.worker_url, namespace=namespace, shards=SHARDS):
        pass


async def _empty(client: redis.asyncio.Redis, stream: str) -> bool:
    return not await client.xrange(stream)


async def test_a_client_user_cannot_xadd_under_any_id_nor_with_maxlen_0(
    users: Users, namespace: str, tmp_path: Path
) -> None:
    """Only a shard's owner writes its stream. While entries wait there behind a busy key, the
    client user's XADD is refused (NOPERM) in every form that once let a client stop or drop
    others' entries: under the largest id there is (which left none for the next append),
    under an id of its choosing just past the last, under ``*`` with ``MAXLEN 0`` (which
    dropped every entry not run yet), and plain. The stream is left as it was, the queued ops
    all run, and the same entry pushed to the inbox instead runs as any other."""
    gate = tmp_path / "gate"
    key, own = keys_on_shard(4, SHARDS, 2, "acct")
    stream = ShardKeys(namespace, 4).stream
    squatter = [envelope("squatter-1", own, "deposit", 1)]
    queued: list[int] = []
    async with _one_worker_and_an_attacker(users, namespace, apps=["tests.apps"]) as (
        ks,
        attacker,
    ):

        async def deposit_10() -> None:
            queued.append(await ks.submit(key, deposit(10), timeout=30))

        async with anyio.create_task_group() as group:
            group.start_soon(ks.submit, key, apps.gated_hold(str(gate)))
            await eventually(lambda: attacker.xlen(stream), message="the held op's entry")
            group.start_soon(deposit_10)
            waiting = await eventually(
                lambda: _entries_carrying(attacker, stream, 2), message="both ops in the stream"
            )
            ms, _, seq = waiting[-1][0].decode().partition("-")
            fields = ["v", "1", "ops", json.dumps(squatter)]
            for where in ([LARGEST_ID], [f"{ms}-{int(seq) + 1}"], ["MAXLEN", "0", "*"], ["*"]):
                with pytest.raises(redis.exceptions.NoPermissionError, match="'xadd' command"):
                    await attacker.execute_command("XADD", stream, *where, *fields)
            assert await attacker.xrange(stream) == waiting
            await push_item(attacker, namespace, 4, squatter, fresh=False, wake=True)
            gate.touch()
        assert queued == [10]
        assert await ks.submit(key, deposit(5), timeout=10) == 15
        assert await ks.read(own) == 1
        assert await stored(attacker, namespace, 4, "squatter-1") == {"ok": 1}
    assert users.refusals() == [f"{users.names[1]}: xadd"]


async def _entries_carrying(
    client: redis.asyncio.Redis, stream: str, count: int
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The stream's entries, once they carry ``count`` ops (else none)."""
    entries: list[tuple[bytes, dict[bytes, bytes]]] = await client.xrange(stream)
    carried = sum(len(json.loads(fields[b"ops"])) for _, fields in entries)
    return entries if carried >= count else []


@pytest.mark.slow
async def test_a_client_user_can_neither_drop_nor_reorder_an_inbox_s_entries(
    users: Users, namespace: str
) -> None:
    """A client user may push to a shard's inbox (RPUSH appends: it cannot choose its place)
    and nothing else there: while a caller's deposit waits in the inbox, trimming, popping,
    removing, deleting, prepending, overwriting or inserting items, and moving the inbox's
    taken count (which would shift every place), are refused (NOPERM) and change nothing. The
    deposit applies once, and its caller gets its outcome."""
    key = keys_on_shard(5, SHARDS, 1, "acct")[0]
    shard = ShardKeys(namespace, 5)
    forged = "1\n[]"
    attempts = [
        ("LTRIM", shard.inbox, 1, 0),
        ("LPOP", shard.inbox),
        ("RPOP", shard.inbox),
        ("LREM", shard.inbox, 0, forged),
        ("DEL", shard.inbox),
        ("LPUSH", shard.inbox, forged),
        ("LSET", shard.inbox, 0, forged),
        ("LINSERT", shard.inbox, "BEFORE", forged, forged),
        ("INCRBY", shard.inbox_taken, 1),
        ("SET", shard.inbox_taken, 0),
    ]
    async with _a_deposit_waiting(users, namespace, key) as (ks, attacker, answered):
        waiting = await eventually(lambda: users.admin.lrange(shard.inbox, 0, -1))
        taken = users.admin.get(shard.inbox_taken)
        for attempt in attempts:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await attacker.execute_command(*attempt)
        assert users.admin.lrange(shard.inbox, 0, -1) == waiting
        assert users.admin.get(shard.inbox_taken) == taken
        await _served(users, namespace, answered)
        assert answered == [10]
        assert await ks.read(key) == 10
    refused = {str(attempt[0]).lower() for attempt in attempts if attempt[0] != "SET"}
    assert sorted(users.refusals()) == sorted(
        [f"{users.names[1]}: {name}" for name in refused | {shard.inbox_taken}]
    )
