"""Only a worker speaks for a worker: a participant shard takes a grant request only if a
worker listed in the namespace's signers hash signed it, for this very shard of this layout
generation, and it was appended soon after it was signed. Anything else is dead-lettered when
it is taken in, before it holds a key, so a client user (who may append to any stream) can no
longer hold a key by asking for it on a coordinator's behalf."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import redis.asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

import keyserial
from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import move_namespace
from keyserial._wire.codec import Envelope
from keyserial._wire.layout import signers_key
from keyserial._wire.requests import RequestCheck
from keyserial._wire.signing import ReplySigner, RequestVerifier
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests.helpers import eventually, keys_on_shard, workers_split_around
from tests.signers import SAMPLE_REQUEST, grant_request, listed_signer, sample_request
from tests.users import Users, documented_rules, documented_users

SHARDS = 8
HOME, PARTICIPANT = 1, 5
NAMESPACE = "orders"
NOW_MS: int = SAMPLE_REQUEST["at"]
MAX_AGE_MS = 3_600_000


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    """The documented worker and client users; the attacker connects as the client."""
    with documented_users(redis_url) as created:
        yield created


# -- the rule, one check at a time (no Redis: the check is pure once the signers are read) ------


def _check(verifier: RequestVerifier, now_ms: int = NOW_MS) -> RequestCheck:
    return RequestCheck(
        verifier,
        namespace=NAMESPACE,
        shard=5,
        shard_name="5",
        max_age_ms=MAX_AGE_MS,
        clock_ms=lambda: now_ms,
    )


def _envelope(request: dict[str, Any]) -> Envelope:
    return Envelope(
        request["id"], tuple(request["keys"]), request["op"], [], request["kwargs"], None, True
    )


def _signed(signer: ReplySigner | None = None, **changes: Any) -> dict[str, Any]:
    return sample_request(signer, NAMESPACE, "ks:orders:worker:abc", **changes)


@pytest.fixture
def signer() -> ReplySigner:
    return ReplySigner()


@pytest.fixture
def verifier(signer: ReplySigner) -> RequestVerifier:
    verifier = RequestVerifier()
    assert verifier.learn(signer.signer_id, signer.record())
    return verifier


def _refusal(verifier: RequestVerifier, request: dict[str, Any], now_ms: int = NOW_MS) -> Any:
    return _check(verifier, now_ms).refusal(_envelope(request))


def test_a_request_a_listed_worker_signed_for_this_shard_is_taken(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    assert _refusal(verifier, _signed(signer)) is None


def test_an_unsigned_request_is_refused(verifier: RequestVerifier) -> None:
    assert "unsigned" in _refusal(verifier, _signed(None))


def test_a_request_whose_signer_is_not_listed_is_refused(verifier: RequestVerifier) -> None:
    assert "no listed worker" in _refusal(verifier, _signed(ReplySigner()))


def test_a_signer_whose_entry_has_no_signing_key_is_not_listed(signer: ReplySigner) -> None:
    """(The entry of a worker of a version that signs no request, or a forged one.)"""
    verifier = RequestVerifier()
    assert not verifier.learn(signer.signer_id, json.dumps({"key": signer.public_key, "at": 1}))
    assert verifier.knows(signer.signer_id)  # (read once: a forged id costs one read)
    assert "no listed worker" in _refusal(verifier, _signed(signer))


def test_a_request_for_another_shard_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    assert "not '5'" in _refusal(verifier, _signed(signer, participant=6))


def test_a_request_of_another_layout_generation_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    assert "not '5'" in _refusal(verifier, _signed(signer, generation=1))


def test_a_request_taken_in_too_long_after_or_before_its_signing_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    """By the participant's clock (a copy of a genuine request appended after its decision may
    have expired); never by the entry id, which a client user's far-future XADD would push
    ahead of every genuine request's signing time."""
    for now_ms in (NOW_MS + MAX_AGE_MS + 1, NOW_MS - MAX_AGE_MS - 1):
        assert "too long" in _refusal(verifier, _signed(signer), now_ms)
    for now_ms in (NOW_MS + MAX_AGE_MS, NOW_MS - MAX_AGE_MS):
        assert _refusal(verifier, _signed(signer), now_ms) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("home", 0),
        ("op", "order-8"),
        ("attempt", 4),
        ("channel", "ks:orders:worker:evil"),
        ("to", "5@0"),
        ("at", NOW_MS + 1),
    ],
)
def test_a_request_changed_after_signing_is_refused(
    signer: ReplySigner, verifier: RequestVerifier, field: str, value: Any
) -> None:
    request = _signed(signer)
    request["kwargs"][field] = value
    assert _refusal(verifier, request) is not None


def test_a_request_for_other_keys_than_signed_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    request = _signed(signer)
    request["keys"] = ["sku:1"]
    assert "no listed worker" in _refusal(verifier, request)


def test_a_request_signed_for_another_namespace_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    request = grant_request(
        signer,
        "payments",
        home=1,
        participant=5,
        op="order-9",
        attempt=3,
        channel="ks:orders:worker:abc",
        keys=["sku:1", "sku:2"],
        at=NOW_MS,
    )
    assert "no listed worker" in _refusal(verifier, request)


def test_a_signature_with_any_byte_changed_is_refused(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    request = _signed(signer)
    signature = request["kwargs"]["sig"]
    for index in range(len(signature)):
        changed = "A" if signature[index] != "A" else "B"
        request["kwargs"]["sig"] = signature[:index] + changed + signature[index + 1 :]
        # (The last character carries two padding bits: some changes of it decode alike.)
        if request["kwargs"]["sig"] != signature and index < len(signature) - 1:
            assert _refusal(verifier, request) is not None, index
    request["kwargs"]["sig"] = signature[:-1]
    assert _refusal(verifier, request) is not None


def test_a_request_of_a_malformed_shape_is_refused(verifier: RequestVerifier) -> None:
    request = _signed(None)
    request["kwargs"]["attempt"] = "3"
    assert "bad grant request" in _refusal(verifier, request)


# -- through a worker, as the documented client user -------------------------------------------


async def _append(attacker: redis.asyncio.Redis, namespace: str, envelope: dict[str, Any]) -> None:
    stream = ShardKeys(namespace, PARTICIPANT).stream
    await attacker.xadd(stream, {"v": "1", "ops": json.dumps([envelope])})


@asynccontextmanager
async def _victim_served(
    users: Users, namespace: str
) -> AsyncIterator[tuple[keyserial.Client, redis.asyncio.Redis, str]]:
    """A worker on every shard, a client, the attacker's connection (the client user's), and a
    victim key on the participant shard holding 100."""
    victim = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(victim, deposit(100)) == 100
            yield ks, attacker, victim
    finally:
        await attacker.aclose()


def _request_for(
    signer: ReplySigner | None, namespace: str, op: str, attempt: int, victim: str
) -> dict[str, Any]:
    """A grant request from the home shard for ``victim`` on the participant shard, its
    answers to the attacker's own channel, signed by ``signer`` (None: unsigned)."""
    return grant_request(
        signer,
        namespace,
        home=HOME,
        participant=PARTICIPANT,
        op=op,
        attempt=attempt,
        channel=f"ks:attacker:{uuid.uuid4().hex}",
        keys=[victim],
    )


async def test_a_forged_grant_request_for_the_current_attempt_holds_no_key(
    users: Users, namespace: str
) -> None:
    """The reviewer's attack: an unsigned request for an op the home shard's owner never
    began, under the home shard's current epoch. It is dead-lettered when taken in: the key's
    next op is answered at once (it used to wait until the home shard changed owner)."""
    participant = ShardKeys(namespace, PARTICIPANT)
    async with _victim_served(users, namespace) as (ks, attacker, victim):
        attempt = int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0)
        forged = _request_for(None, namespace, f"never-{uuid.uuid4().hex[:8]}", attempt, victim)
        await _append(attacker, namespace, forged)
        assert await ks.submit(victim, deposit(1), timeout=5) == 101
        await eventually(lambda: users.admin.xlen(participant.dead) == 1)
        assert int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0) == attempt
    assert users.refusals() == []


async def test_a_request_signed_by_a_signer_not_listed_holds_no_key(
    users: Users, namespace: str
) -> None:
    """A request signed well, but by a key no worker listed (an attacker's own): the worker
    reads the signer's entry, finds none, and dead-letters the request."""
    async with _victim_served(users, namespace) as (ks, attacker, victim):
        attempt = int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0)
        forged = _request_for(ReplySigner(), namespace, "unlisted", attempt, victim)
        await _append(attacker, namespace, forged)
        assert await ks.submit(victim, deposit(1), timeout=5) == 101
        dead = users.admin.xrange(ShardKeys(namespace, PARTICIPANT).dead)
        assert [fields[b"reason"] for _, fields in dead] == [
            b"a grant request that no listed worker signed"
        ]
    assert users.refusals() == []


async def test_a_request_answered_already_ends_any_hold_under_its_id(
    users: Users, namespace: str
) -> None:
    """A copy of a request whose part was applied or released, taken in where its answer is
    looked up, is answered with it and runs nothing; a hold recorded under its id (as a copy
    appended as fresh, which no lookup stops, records before its answer is refused) is over,
    and the step that answers the copy deletes it."""
    participant = ShardKeys(namespace, PARTICIPANT)
    async with _victim_served(users, namespace) as (ks, attacker, victim):
        signer = listed_signer(users.admin, namespace)
        request = _request_for(signer, namespace, "answered", 0, victim)
        users.admin.hset(participant.results, "answered#0", '{"ok":"released"}')
        users.admin.hset(participant.held, "answered#0", '{"st": []}')
        await _append(attacker, namespace, request)  # (not fresh: its answer is looked up)
        await eventually(lambda: not users.admin.hexists(participant.held, "answered#0"))
        assert await ks.submit(victim, deposit(1), timeout=10) == 101
        assert users.admin.hget(participant.results, "answered#0") == b'{"ok":"released"}'


@pytest.mark.slow
async def test_a_request_a_listed_worker_signed_is_granted(users: Users, namespace: str) -> None:
    """The control: the same request, signed by a listed signer, is taken: the participant
    records its grant (so the refusals above are the signature's doing)."""
    async with _victim_served(users, namespace) as (ks, attacker, victim):
        signer = listed_signer(users.admin, namespace)
        # (An attempt that is over: the participant aborts and releases.)
        request = _request_for(signer, namespace, "listed", 0, victim)
        await _append(attacker, namespace, request)
        results = ShardKeys(namespace, PARTICIPANT).results
        # (Taken and released: a refused request stores nothing under a '#' id.)
        await eventually(lambda: users.admin.hget(results, "listed#0") is not None)
        assert await ks.submit(victim, deposit(1), timeout=10) == 101
        assert users.admin.xlen(ShardKeys(namespace, PARTICIPANT).dead) == 0
    assert users.refusals() == []


def test_a_grant_request_checks_out_as_documented(signer: ReplySigner) -> None:
    """docs/wire-format.md, Grant requests: rebuilt from the page alone, with no keyserial
    code, the signed bytes verify under the signer's listed key."""
    request = _signed(signer, keys=["sku:1", "café"])
    kwargs = request["kwargs"]
    fields = [NAMESPACE, kwargs["to"], kwargs["home"], kwargs["op"], kwargs["attempt"]]
    fields += [kwargs["channel"], kwargs["at"], request["keys"]]
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)
    listed = json.loads(signer.record())["sign"]
    key = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(listed + "="))
    signature = base64.urlsafe_b64decode(kwargs["sig"] + "==")
    key.verify(signature, b"keyserial request signature v1\n" + text.encode())
    assert kwargs["k"] == signer.signer_id


async def test_a_forged_grant_request_never_holds_a_reshard_up(
    users: Users, namespace: str
) -> None:
    """The reviewer's second attack: the same forged request, then a reshard. Granted, it kept
    its shard's runner busy, so the shard never drained, the move never flipped, and every new
    op (already routed by the new layout) waited for the flip. Dead-lettered, it holds nothing:
    the move finishes, and ops on other keys and on the victim's are answered."""
    victim = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    backend = await Backend.connect(users.worker_url)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(victim, deposit(100)) == 100
            attempt = int(users.admin.get(ShardKeys(namespace, HOME).epoch) or 0)
            forged = _request_for(None, namespace, "never-begun", attempt, victim)
            await _append(attacker, namespace, forged)
            with anyio.fail_after(30):
                await move_namespace(backend, Settings(namespace=namespace), 2 * SHARDS)
            assert await ks.submit("unrelated", deposit(5), timeout=10) == 5
            assert await ks.submit(victim, deposit(1), timeout=10) == 101
    finally:
        await attacker.aclose()
        await backend.aclose()
    assert users.refusals() == []


async def test_an_entry_under_a_far_future_id_stops_no_transfer(
    users: Users, namespace: str
) -> None:
    """A client user XADDs to a participant shard under an id two hours ahead: every later
    entry id follows it. A request's age is judged by the participant's clock, not by its
    entry id, so transfers between two workers still go through."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    ahead = f"{int(time.time() * 1000) + 7_200_000}-0"
    try:
        async with (
            workers_split_around(users.worker_url, namespace, PARTICIPANT, shard_count=SHARDS),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            await ks.submit(source, deposit(100))
            stream = ShardKeys(namespace, PARTICIPANT).stream
            await attacker.xadd(stream, {"v": "1", "ops": "[]"}, id=ahead)
            moved = await ks.transfer(source, target, 25, timeout=15)
            assert moved == {source: 75, target: 25}
            assert users.admin.xlen(ShardKeys(namespace, PARTICIPANT).dead) <= 1  # (the "[]")
    finally:
        await attacker.aclose()
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
    home shard before its signer's entry was written would have its requests dead-lettered. A
    worker whose writes to the signers hash are refused (an ACL not yet widened, an outage of
    that key) takes no shard while they are: a transfer it would coordinate waits for it, and
    once its signer is listed, runs once, with nothing dead-lettered."""
    source = keys_on_shard(HOME, SHARDS, 1, "acct")[0]
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    participant = ShardKeys(namespace, PARTICIPANT)
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
            assert users.admin.xlen(participant.dead) == 0
            late.allow()
        assert moved == {source: 75, target: 25}
        assert users.admin.xlen(participant.dead) == 0
    assert users.refusals() == []
