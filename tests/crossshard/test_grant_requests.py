"""Only a worker asks a worker to hold keys. A coordinator sends a grant request in a
coordination message signed for the participant shard's owner; that owner takes it only from
such a message (a listed worker signed it for this very worker), and then only if it is for
its own shard, from a coordinator's shard below it, for that shard's keys, and made lately. A
client user may push to any shard's inbox (whose owner moves what it holds into the shard's
stream) and publish on any worker's channel: a request in a stream is refused as a reserved op,
and one in a message no listed worker signed is dropped, so it holds no key and stores
nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib import resources
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import move_namespace
from keyserial._wire.layout import decision_field, part_id, signers_key, worker_channel
from keyserial._wire.messages import GrantRequest, KeyGrant
from keyserial._wire.signing import ReplySigner, ReplyVerifier, without_signature
from keyserial._worker.crossshard.participant import Participant
from keyserial._worker.keystates import KeyStates
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests.entries import push_item
from tests.helpers import (
    eventually,
    keys_on_shard,
    lends,
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
from tests.users import Users, documented_rules, documented_users

SHARDS = 8
HOME, PARTICIPANT = 1, 5
#: What the mailbox logs of a request in a message no listed worker signed for this one.
_IGNORED = ("ignoring a grant request", "no listed worker signed for this")


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    """The documented worker and client users; the attacker connects as the client."""
    with documented_users(redis_url) as created:
        yield created


@dataclass
class _Served:
    """One worker on every shard, a client, the attacker's connection (the client user's),
    and a victim key on the participant shard holding 100."""

    worker: keyserial.Worker
    ks: keyserial.Client
    attacker: redis.asyncio.Redis
    victim: str
    users: Users
    namespace: str

    @property
    def participant(self) -> ShardKeys:
        return ShardKeys(self.namespace, PARTICIPANT)

    @property
    def home(self) -> ShardKeys:
        return ShardKeys(self.namespace, HOME)

    def epoch(self) -> int:
        """The home shard's epoch: a request of an attempt below it is taken and aborted at
        once; one of the epoch itself is held until its decision is written."""
        return int(self.users.admin.get(self.home.epoch) or 0)

    def owner(self) -> str:
        return owner_of(self.users.admin, self.namespace, PARTICIPANT)

    def held(self) -> dict[bytes, bytes]:
        return self.users.admin.hgetall(self.participant.held)

    def outcome(self, part: str) -> bytes | None:
        """What became of a part on the participant shard (``part_id``), if anything."""
        return self.users.admin.hget(self.participant.results, part)

    @property
    def lent(self) -> bool:
        """Whether the participant lends its grants (one server: it records no hold and stores
        no part's outcome) rather than records them (a cluster)."""
        return lends(self.users.worker_url)

    def holding(self, caplog: pytest.LogCaptureFixture, op: str, attempt: int) -> bool:
        """Whether the participant has granted the victim to ``op``'s attempt: its hold
        recorded (a cluster), or its grant made (lent: as it logs it)."""
        if self.lent:
            return _granted(caplog, f"{op}#{attempt}") > 0
        return part_id(op, HOME, attempt).encode() in self.held()

    def released(self, op: str, attempt: int) -> bool:
        """Whether the participant let go of what it held for ``op``'s attempt, released (the
        attempt aborted, or never begun): its part's outcome says so (a cluster), or (lent:
        nothing is stored there) the attempt's decision in the home shard is an abort, which
        the participant read or wrote before letting go."""
        if not self.lent:
            return self.outcome(part_id(op, HOME, attempt)) == b'{"ok":"released"}'
        decided = self.users.admin.hget(self.home.results, decision_field(op, attempt))
        return self.outcome(part_id(op, HOME, attempt)) is None and decided is not None

    def decide(self, op: str, attempt: int, decision: str) -> None:
        """Write the home shard's decision of an attempt, as its coordinator would."""
        self.users.admin.hset(self.home.results, decision_field(op, attempt), decision)

    def request(self, op: str, attempt: int, *keys: str, **changes: Any) -> GrantRequest:
        """A request for ``keys`` (the victim's by default) on the participant shard, its
        grant to go to a channel of the attacker's."""
        made = request(
            home=HOME,
            participant=PARTICIPANT,
            op=op,
            attempt=attempt,
            channel=f"ks:{self.namespace}:attacker:{uuid.uuid4().hex}",
            keys=keys or (self.victim,),
        )
        return dataclasses.replace(made, **changes)

    async def send(self, signer: ReplySigner | None, *items: GrantRequest) -> None:
        """``items`` in one message to the participant's owner, signed for it by ``signer``."""
        owner = self.owner()
        await publish(self.attacker, owner, message(signer, owner, *items))

    async def serves_the_victim(self) -> None:
        """The victim's keys are free: its next op is answered."""
        before = await self.ks.read(self.victim)
        assert await self.ks.submit(self.victim, deposit(1), timeout=10) == before + 1


@asynccontextmanager
async def _served(users: Users, namespace: str, **settings: Any) -> AsyncIterator[_Served]:
    victim = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS, **settings) as worker,
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(victim, deposit(100)) == 100
            yield _Served(worker, ks, attacker, victim, users, namespace)
    finally:
        await attacker.aclose()


def _logged(caplog: pytest.LogCaptureFixture, *texts: str) -> int:
    """How many of the worker's log lines so far say every one of ``texts``."""
    return sum(
        all(text in record.getMessage() for text in texts)
        for record in caplog.records
        if record.name == "keyserial.worker"
    )


async def _next_grant(pubsub: Any) -> dict[str, Any]:
    """The next grant published to ``pubsub``'s channel (signed for it: the signature's fields
    are left out)."""
    with anyio.fail_after(10):
        while True:
            got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if got is not None:
                grant: dict[str, Any] = json.loads(without_signature(got["data"]))
                assert grant["t"] == "g", grant
                return grant


def _granted(caplog: pytest.LogCaptureFixture, attempt: str) -> int:
    """How many times the participant shard made a grant for ``attempt`` (``<op>#<attempt>``,
    as logged: a request taken and held, or held again)."""
    return _logged(caplog, f"shard {PARTICIPANT} ", "granting keys", f" to {attempt} of shard")


# -- in a stream (pushed to the inbox), as the documented client user: refused -----------------


def _submit_script() -> str:
    return resources.files("keyserial._scripts").joinpath("lua/submit.lua").read_text()


async def _append(
    served: _Served, envelopes: list[dict[str, Any]], *, pushed: bool = False
) -> None:
    """An entry for the participant shard's stream, pushed to its inbox: a plain RPUSH and a
    wake-up naming its place (the owner moves it in and fetches it), or with the submit script
    as fresh (pushed to the owner with its wake-up)."""
    keys = served.participant
    if pushed:
        ops = json.dumps(envelopes)
        await served.attacker.eval(
            _submit_script(), 1, keys.inbox, 0, "1", ops, keys.wake_channel, "1"
        )
    else:
        await push_item(
            served.attacker, served.namespace, PARTICIPANT, envelopes, fresh=False, wake=True
        )


async def _replies(pubsub: Any, count: int) -> dict[str, list[Any]]:
    """The outcomes of the next ``count`` replies published to ``pubsub``'s channel, by op id."""
    found: dict[str, list[Any]] = {}
    with anyio.fail_after(10):
        while sum(map(len, found.values())) < count:
            got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if got is not None:
                for op_id, outcome in json.loads(got["data"])["r"]:
                    found.setdefault(op_id, []).append(outcome)
    return found


def _refused(outcomes: list[Any], reason: str) -> None:
    for outcome in outcomes:
        assert outcome["error"]["type"] == "keyserial.MalformedOperation", outcome
        assert reason in outcome["error"]["message"], outcome


_RESERVED_NAME = f"{GRANT_OP!r} is reserved"
_RESERVED_ID = "'#' is reserved in op ids"


@pytest.mark.parametrize("pushed", [False, True], ids=["fetched", "pushed"])
async def test_a_grant_request_appended_to_a_stream_is_refused_as_reserved(
    users: Users, namespace: str, pushed: bool
) -> None:
    """A client user pushes grant requests to the participant shard's inbox, which its owner
    moves into the stream, in every shape (a real request's wire item under its part's id, the
    same under a plain id, the old signed stream form, a bare one), for the home's live
    attempt. Each is refused at intake, answered MalformedOperation and never stored under a
    '#' id; nothing is held, and the victim's next op is answered at once."""
    reply = f"ks:{namespace}:attacker:{uuid.uuid4().hex}"
    async with _served(users, namespace) as served, served.attacker.pubsub() as pubsub:
        await pubsub.subscribe(reply)
        attempt, victim = served.epoch(), served.victim
        live = served.request("grab", attempt)
        field = part_id("grab", HOME, attempt)  # (its run's op id, had it been taken)
        old = {"home": HOME, "op": "old", "attempt": attempt, "channel": reply, "to": "5"}
        old |= {"at": live.at, "k": "0123456789abcdef", "sig": "A" * 86}
        envelopes = [
            {"id": field, "keys": [victim], "op": GRANT_OP, "kwargs": live.to_wire()},
            {"id": "grab-1", "keys": [victim], "op": GRANT_OP, "kwargs": live.to_wire()},
            {"id": f"old#{attempt}", "keys": [victim], "op": GRANT_OP, "kwargs": old},
            {"id": "grab-2", "key": victim, "op": GRANT_OP},
        ]
        await _append(
            served, [{**envelope, "reply": reply} for envelope in envelopes], pushed=pushed
        )
        answered = await _replies(pubsub, len(envelopes))
        _refused(answered[field] + answered[f"old#{attempt}"], _RESERVED_ID)
        _refused(answered["grab-1"] + answered["grab-2"], _RESERVED_NAME)
        await served.serves_the_victim()
        assert served.held() == {}
        results = users.admin.hkeys(served.participant.results)
        assert [name for name in results if b"#" in name] == []
        assert served.epoch() == attempt
    assert users.refusals() == []


async def test_an_op_id_with_a_hash_never_joins_a_grant_requests_run(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While a (signed) request's run holds the victim, a client user pushes ops under the
    run's id: a copy of the run's own envelope (which would join the run and get its outcome)
    and a deposit. Both are refused at once, while the hold stands, and the run ends as its
    decision says."""
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    reply = f"ks:{namespace}:attacker:{uuid.uuid4().hex}"
    async with _served(users, namespace) as served, served.attacker.pubsub() as pubsub:
        await pubsub.subscribe(reply)
        signer = listed_signer(users.admin, namespace)
        await introduce(served.attacker, served.worker, signer)
        attempt = served.epoch()
        field = part_id("held", HOME, attempt)  # (the run's op id, and its hold's field)
        await served.send(signer, served.request("held", attempt))
        await eventually(lambda: served.holding(caplog, "held", attempt))
        grant = served.held()
        await _append(
            served, [{"id": field, "keys": [served.victim], "op": GRANT_OP, "reply": reply}]
        )
        await _append(
            served,
            [{"id": field, "key": served.victim, "op": "deposit", "args": [1], "reply": reply}],
        )
        answered = await _replies(pubsub, 2)
        _refused(answered[field], _RESERVED_ID)
        assert served.held() == grant  # (still held: nothing joined it)
        assert _granted(caplog, f"held#{attempt}") == 1
        served.decide("held", attempt, '{"abort":"the test ended it"}')
        await eventually(lambda: served.held() == {})
        await eventually(lambda: served.released("held", attempt))
        await served.serves_the_victim()
        assert await served.ks.read(served.victim) == 101
    assert users.refusals() == []


# -- in a message: only one a listed worker signed for this one ------------------------------


def _tampered(signer: ReplySigner, channel: str, signed: GrantRequest, sent: GrantRequest) -> str:
    """``signed``'s signature for ``channel`` on ``sent``'s text."""
    text = json.dumps(signed.to_wire())
    suffix = signer.sign(channel, text)[len(text) - 1 :]
    return json.dumps(sent.to_wire())[:-1] + suffix


@pytest.mark.parametrize("how", ["unsigned", "for-another-worker", "unlisted-signer", "tampered"])
async def test_a_request_is_taken_only_from_a_message_a_listed_worker_signed_for_this_one(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A request in a message that is unsigned, signed for another worker's channel, signed by
    a signer not listed, or changed after signing is dropped by the mailbox: it holds nothing
    and stores nothing. The same request, signed by the listed signer for this worker, is
    taken (the control: the test reaches the mailbox with a request it would take)."""
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    async with _served(users, namespace) as served:
        signer = listed_signer(users.admin, namespace)
        await introduce(served.attacker, served.worker, signer)
        attempt, owner = served.epoch() - 1, served.owner()
        assert attempt >= 0
        wanted = served.request("wanted", attempt)
        field, part = f"wanted#{attempt}", part_id("wanted", HOME, attempt)
        if how == "unsigned":
            sent = message(None, owner, wanted)
        elif how == "for-another-worker":
            elsewhere = ReplyVerifier(worker_channel(namespace, "elsewhere")).channel
            sent = message(signer, elsewhere, wanted)
        elif how == "unlisted-signer":
            sent = message(ReplySigner(), owner, wanted)
        else:
            other = served.request("wanted", attempt, keys_on_shard(PARTICIPANT, SHARDS, 2)[1])
            sent = _tampered(signer, owner, other, wanted)
        before = _logged(caplog, *_IGNORED)
        await publish(served.attacker, owner, sent)
        await eventually(lambda: _logged(caplog, *_IGNORED) > before)
        await served.serves_the_victim()
        assert served.held() == {}
        assert served.outcome(part) is None
        assert _granted(caplog, field) == 0
        await served.send(signer, wanted)  # the control
        await eventually(lambda: served.released("wanted", attempt))
        assert _granted(caplog, field) == 1
    assert users.refusals() == []


# -- signed, for this worker: each of the runner's rules -----------------------------------


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"target": f"{PARTICIPANT}@1"}, f"it is for shard '{PARTICIPANT}@1'"),
        ({"home": PARTICIPANT}, "its home or op id cannot be a coordinator's"),
        ({"home": SHARDS - 1}, "its home or op id cannot be a coordinator's"),
        ({"op_id": "order#9"}, "its home or op id cannot be a coordinator's"),
        ({"keys": "elsewhere"}, "it names keys of other shards"),
        # (Half of the default result_ttl, an hour, and a minute: a copy, or clocks too far.)
        ({"at": -1_860_000}, "it was made more than half of result_ttl away from now"),
        ({"at": 1_860_000}, "it was made more than half of result_ttl away from now"),
    ],
    ids=[
        "another-generation",
        "home-itself",
        "home-above",
        "hash-in-op-id",
        "keys-elsewhere",
        "too-old",
        "from-the-future",
    ],
)
async def test_a_signed_request_that_breaks_a_rule_is_dropped(
    users: Users,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
    why: str,
) -> None:
    """A request a listed worker signed for this one reaches the shard's runner, which drops
    it (logged with why) if it is for another shard name, from a home that is not below the
    shard or under an op id with '#', for keys routed elsewhere, or made more than result_ttl
    (an hour) from now by this worker's clock: no key held, nothing stored."""
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    async with _served(users, namespace) as served:
        signer = listed_signer(users.admin, namespace)
        await introduce(served.attacker, served.worker, signer)
        attempt = served.epoch() - 1
        if change.get("keys") == "elsewhere":
            change = {"keys": (served.victim, keys_on_shard(PARTICIPANT + 1, SHARDS, 1)[0])}
        if "at" in change:
            change = {"at": int(time.time() * 1000) + change["at"]}
        broken = served.request("broken", attempt, **change)
        field = f"{broken.op_id}#{attempt}"
        await served.send(signer, broken)
        dropped = f"dropping the grant request of {field}: {why}"
        await eventually(lambda: _logged(caplog, dropped), message=repr(dropped))
        await served.serves_the_victim()
        assert served.held() == {}
        assert served.outcome(part_id(broken.op_id, broken.home, attempt)) is None
        assert _granted(caplog, field) == 0
    assert users.refusals() == []


# -- replayed: holds nothing ---------------------------------------------------------------


async def test_a_request_replayed_after_its_part_was_applied_holds_nothing(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client user captures a transfer's signed request on the participant's owner's channel
    and publishes it again once its part was applied. It is signed for that worker, so it is
    taken, but the decision is not applied again (its states would undo the deposit made
    since). On a cluster the step records no hold for an attempt with an outcome there: the
    keys are let go at once. On one server the grant is lent: the copy holds the keys until the
    participant reads the attempt's decision, which names the first grant, not the copy's, so
    nothing of it is taken into the cache (the next op on the key builds on the deposit)."""
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    participant = ShardKeys(namespace, PARTICIPANT)
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            workers_split_around(users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS) as (
                alone,
                _,
            ),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            attacker.pubsub() as pubsub,
        ):
            assert await ks.submit(source, deposit(100)) == 100
            assert await ks.submit(target, deposit(10)) == 10
            for channel in request_channels(users.admin, namespace, PARTICIPANT):
                await subscribe(pubsub, channel)
            moved = await ks.transfer(source, target, 25, op_id="order-9", timeout=30)
            assert moved == {source: 75, target: 35}
            channel, captured, item = await next_request(pubsub)
            field, part = f"order-9#{item['a']}", part_id("order-9", HOME, item["a"])
            assert (item["op"], item["h"]) == ("order-9", HOME)
            lent = lends(users.worker_url)
            applied = None if lent else b'{"ok":"applied"}'
            if not lent:
                await eventually(lambda: users.admin.hget(participant.results, part))
            assert users.admin.hget(participant.results, part) == applied
            await eventually(lambda: not users.admin.exists(participant.held))
            assert await ks.submit(target, deposit(1)) == 36  # (a decision applied again undoes it)
            grants = _granted(caplog, field)
            signer = listed_signer(users.admin, namespace)
            await introduce(attacker, alone, signer)
            epoch = int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0)
            after = request(
                home=HOME,
                participant=PARTICIPANT,
                op="after",
                attempt=epoch - 1,
                channel=f"ks:{namespace}:attacker",
                keys=[target],
            )
            await publish(attacker, channel, captured)  # the replay
            # (Behind it on the target: answered once the replay's run has ended.)
            await publish(attacker, channel, message(signer, channel, after))
            after_part = part_id("after", HOME, epoch - 1)
            after_decided = decision_field("after", epoch - 1)
            await eventually(  # (its run ended: it let go of the target, the copy's before it)
                lambda: (
                    users.admin.hget(ShardKeys(namespace, HOME).results, after_decided)
                    if lent
                    else users.admin.hget(participant.results, after_part)
                ),
                timeout=15,
            )
            assert _granted(caplog, field) == grants + 1  # (taken)
            assert users.admin.hgetall(participant.held) == {}
            assert users.admin.hget(participant.results, part) == applied
            assert await ks.read(source) == 75
            assert await ks.read(target) == 36
            assert await ks.submit(target, deposit(1)) == 37  # (its owner's cache kept 36)
    finally:
        await attacker.aclose()
    assert users.refusals() == []


@pytest.mark.parametrize("copied", [False, True], ids=["replayed", "copy refused first"])
async def test_a_request_replayed_while_its_attempt_is_held_is_ignored(
    users: Users, namespace: str, caplog: pytest.LogCaptureFixture, copied: bool
) -> None:
    """A signed request's message published again while its attempt holds the keys: the
    attempt is running, so the copy holds nothing more: one hold, released once. A lent grant
    is sent again, the same (its coordinator asks again when the first was lost); a recorded
    one is read from its record instead. ``copied``: before the replay, a client user pushes
    a copy of the request under its run's id, refused as reserved; the run stays the part's
    own all the same (had the refusal ended it in memory, the replay would be held a second
    time, and a lost lent grant never sent again)."""
    caplog.set_level(logging.DEBUG, "keyserial.worker")
    reply = f"ks:{namespace}:attacker:{uuid.uuid4().hex}"
    async with (
        _served(users, namespace) as served,
        served.attacker.pubsub() as pubsub,
        served.attacker.pubsub() as replies,
    ):
        await replies.subscribe(reply)
        signer = listed_signer(users.admin, namespace)
        await introduce(served.attacker, served.worker, signer)
        attempt, owner = served.epoch(), served.owner()
        field, part = f"held#{attempt}", part_id("held", HOME, attempt)
        held = served.request("held", attempt)
        await subscribe(pubsub, held.channel)
        sent = message(signer, owner, held)
        await publish(served.attacker, owner, sent)
        await eventually(lambda: served.holding(caplog, "held", attempt))
        first = await _next_grant(pubsub)
        if copied:
            copy = {"id": part, "keys": [served.victim], "op": GRANT_OP, "kwargs": held.to_wire()}
            await _append(served, [{**copy, "reply": reply}])
            _refused((await _replies(replies, 1))[part], _RESERVED_ID)
        await publish(served.attacker, owner, sent)  # the replay
        if served.lent:
            assert await _next_grant(pubsub) == first
        # (Behind both on the victim: answered once a copy's run, if any, has ended.)
        await served.send(signer, served.request("after", attempt - 1))
        served.decide("held", attempt, '{"abort":"the test ended it"}')
        await eventually(lambda: served.released("after", attempt - 1), timeout=15)
        assert _granted(caplog, field) == 1
        assert served.released("held", attempt)
        assert served.held() == {}
        await served.serves_the_victim()
    assert users.refusals() == []


# -- what a forged request cannot do ----------------------------------------------------------


async def test_a_forged_grant_request_never_holds_a_reshard_up(
    users: Users, namespace: str
) -> None:
    """A client user's forged requests for the victim, in the inbox and in an unsigned
    message, then a reshard. Held, a request would keep its shard from draining, and the move
    would never flip; they hold nothing, so the move finishes and ops are answered."""
    backend = await Backend.connect(users.worker_url)
    try:
        async with _served(users, namespace) as served:
            attempt = served.epoch()
            forged = served.request("never-begun", attempt)
            envelope = {"id": "never", "keys": [served.victim], "op": GRANT_OP}
            await _append(served, [{**envelope, "kwargs": forged.to_wire()}])
            await served.send(None, forged)
            with anyio.fail_after(30):
                await move_namespace(backend, Settings(namespace=namespace), 2 * SHARDS)
            assert await served.ks.submit("unrelated", deposit(5), timeout=10) == 5
            assert await served.ks.submit(served.victim, deposit(1), timeout=10) == 101
    finally:
        await backend.aclose()
    assert users.refusals() == []


async def test_an_entry_under_a_far_future_id_stops_no_transfer(
    users: Users, namespace: str
) -> None:
    """A participant shard's stream holds an entry under an id two hours ahead, so every entry
    its owner moves in after it gets a later id still (XADD ``*`` follows the last id): as
    after a failover to a server whose clock is behind the old one's. (Only the owner appends
    to a stream now, so the entry is added as admin: a client user's XADD is refused, see
    tests/security/test_hostile_clients.py.) A request's age is judged by the participant's
    clock against the time its coordinator made it, never by an entry id, so transfers between
    two workers still go through."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    ahead = f"{int(time.time() * 1000) + 7_200_000}-0"
    async with (
        workers_split_around(users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        await ks.submit(source, deposit(100))
        stream = ShardKeys(namespace, PARTICIPANT).stream
        users.admin.xadd(stream, {"v": "1", "ops": "[]"}, id=ahead)
        moved = await ks.transfer(source, target, 25, timeout=15)
        assert moved == {source: 75, target: 25}
        assert users.admin.xlen(ShardKeys(namespace, PARTICIPANT).dead) <= 1  # (the "[]")
    assert users.refusals() == []


@dataclass(frozen=True)
class _LateSigner:
    """A worker user as documented, save that it may not write the namespace's signers hash
    until :meth:`allow`: its workers cannot list their signers before."""

    url: str
    name: str
    namespace: str
    admin: Any

    def refused(self) -> int:
        """How many of its writes to the signers hash the server refused so far."""
        return sum(
            int(entry["count"])
            for entry in self.admin.acl_log()
            if entry["username"] == self.name and entry["object"] == signers_key(self.namespace)
        )

    def allow(self) -> None:
        self.admin.execute_command("ACL", "SETUSER", self.name, f"~{signers_key(self.namespace)}")


@contextmanager
def _late_signer(users: Users, redis_url: str, namespace: str) -> Iterator[_LateSigner]:
    name, password = f"ks-late-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = [
        rule.replace(">WORKER_PASSWORD", f">{password}") for rule in documented_rules("worker")[0]
    ]
    users.admin.execute_command("ACL", "SETUSER", name, *rules)
    # It reads every key, and writes all but ks:<ns>:signers (the only one there with an "s").
    users.admin.execute_command(
        "ACL", "SETUSER", name, "resetkeys", "%R~ks:*", "~ks:{*", f"~ks:{namespace}:[^s]*"
    )
    url = redis_url.replace("redis://", f"redis://{name}:{password}@", 1)
    try:
        yield _LateSigner(url, name, namespace, users.admin)
    finally:
        users.admin.execute_command("ACL", "DELUSER", name)


@asynccontextmanager
async def _started(worker: keyserial.Worker) -> AsyncIterator[None]:
    """``worker`` running for the block, without waiting for it to own anything (as
    ``running_worker`` does), and stopped at its end."""
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        try:
            yield
        finally:
            worker.stop()


@pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)
async def test_a_worker_serves_no_shard_before_its_signer_is_listed(
    users: Users, redis_url: str, namespace: str
) -> None:
    """A participant takes a grant request only from a listed signer, so a worker that took a
    home shard before its signer's entry was written would have its requests dropped. A worker
    whose writes to the signers hash are refused (an ACL not yet widened, an outage of that
    key) takes no shard while they are: a transfer it would coordinate waits for it, and once
    its signer is listed, runs once."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    async with (
        running_worker(users.worker_url, namespace, shard_count=SHARDS),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        assert await ks.submit(source, deposit(100)) == 100
    rest = [shard for shard in range(SHARDS) if shard != PARTICIPANT]
    with _late_signer(users, redis_url, namespace) as late:
        worker = keyserial.Worker(
            late.url, shards=rest, settings=Settings(namespace=namespace, shard_count=SHARDS)
        )
        moved: dict[str, Any] = {}
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS, shards=[PARTICIPANT]),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            _started(worker),
            anyio.create_task_group() as group,
        ):

            async def transfer() -> None:
                moved.update(await ks.transfer(source, target, 25, timeout=30))

            group.start_soon(transfer)
            await eventually(lambda: late.refused() >= 3)  # (0.7 s of retries at least)
            assert worker.owned_shards == []
            late.allow()
        assert moved == {source: 75, target: 25}
    assert users.refusals() == []


# -- a lent grant's states are committed ones ---------------------------------------------------


@pytest.mark.parametrize("earlier", ["write", "outcome"])
def test_a_lent_grant_goes_out_only_once_its_keys_earlier_writes_have_committed(
    earlier: str,
) -> None:
    """A participant that lends its keys grants them at once if nothing of theirs waits to
    commit; else after the step that commits it (the earlier op's write, or the outcome of one
    that wrote nothing), in flight or next. Granted before, a crash of the participant would
    leave the coordinator's write on the key, fenced by an epoch still current, and the earlier
    op to run again after it. A recorded grant always waits for its step."""
    states = KeyStates(lambda: None)
    states.load("acct", "1")
    participant = Participant(SimpleNamespace(home=SimpleNamespace(states=states)))  # type: ignore[arg-type]
    grant = KeyGrant("op", 1, PARTICIPANT, [("acct", "1")], 7, "channel", HOME, epoch=3)
    assert not participant.needs_step(grant)
    if earlier == "write":
        states.write("acct", "2")
    else:
        states.answered(["acct"])
    assert participant.needs_step(grant)
    step, _ = states.start_step()
    assert participant.needs_step(grant)  # (in flight)
    states.step_done(step)
    assert not participant.needs_step(grant)
    assert participant.needs_step(dataclasses.replace(grant, epoch=None))
