"""The grant request's fast path: a coordinator tags each request for the participant shard's
owner that granted its last one there (an HMAC under their pairwise key), and that owner takes
a request on its tag without checking the Ed25519 signature. Only the signer and that owner
hold the tag's key, so the tag proves what the signature does; any other owner (after a
takeover), or a tag that does not check out, falls back to the signature, so no request is
refused or delayed because a guess was wrong, and no forged tag is taken."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

import keyserial
from keyserial._wire.codec import Envelope
from keyserial._wire.messages import GrantRequest
from keyserial._wire.requests import RequestCheck
from keyserial._wire.signing import ReplySigner, ReplyVerifier, RequestVerifier
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests.helpers import eventually, keys_on_shard
from tests.signers import SAMPLE_REQUEST, grant_request, listed_signer, sample_request
from tests.users import Users, documented_users

SHARDS = 8
HOME, PARTICIPANT = 1, 5
NAMESPACE = "orders"
NOW_MS: int = SAMPLE_REQUEST["at"]
REFUSED = "a grant request that no listed worker signed"


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    """The documented worker and client users; the attacker connects as the client."""
    with documented_users(redis_url) as created:
        yield created


# -- the rule (no Redis: the check is pure once the signers are read) --------------------------


@pytest.fixture
def signer() -> ReplySigner:
    return ReplySigner()


@pytest.fixture
def receiver() -> ReplyVerifier:
    """The participant shard's owner's coordination key (``<prefix>.<public key>``)."""
    return ReplyVerifier("ks:orders:worker:owner")


@pytest.fixture
def verifier(signer: ReplySigner, receiver: ReplyVerifier) -> RequestVerifier:
    verifier = RequestVerifier(receiver)
    assert verifier.learn(signer.signer_id, signer.record())
    return verifier


def _request(signer: ReplySigner, **changes: Any) -> dict[str, Any]:
    return sample_request(signer, NAMESPACE, "ks:orders:worker:coordinator", **changes)


def _signed_text(request: dict[str, Any], namespace: str = NAMESPACE) -> str:
    parsed = GrantRequest.from_wire(request["kwargs"], below=PARTICIPANT)
    return parsed.signed_text(namespace, request["keys"])


def _tagged(
    signer: ReplySigner, channel: str, *, bad_signature: bool = False, **changes: Any
) -> dict[str, Any]:
    """A request of ``signer``'s tagged for the owner of ``channel``; its signature with a
    byte changed if ``bad_signature``."""
    request = _request(signer, **changes)
    request["kwargs"]["tag"] = signer.tag_request(channel, _signed_text(request))
    if bad_signature:
        request["kwargs"]["sig"] = _changed(request["kwargs"]["sig"], 10)
    return request


def _changed(text: str, index: int) -> str:
    return text[:index] + ("a" if text[index] != "a" else "b") + text[index + 1 :]


def _refusal(verifier: RequestVerifier, request: dict[str, Any]) -> str | None:
    check = RequestCheck(
        verifier,
        namespace=NAMESPACE,
        shard=PARTICIPANT,
        shard_name=str(PARTICIPANT),
        max_age_ms=3_600_000,
        clock_ms=lambda: NOW_MS,
    )
    envelope = Envelope(
        request["id"], tuple(request["keys"]), request["op"], [], request["kwargs"], None, True
    )
    return check.refusal(envelope)


def test_a_request_tagged_for_this_owner_is_taken_on_its_tag_alone(
    signer: ReplySigner, receiver: ReplyVerifier, verifier: RequestVerifier
) -> None:
    """The fast path: the signature is not checked (here it would not check out, a byte of it
    changed), because the tag, which only the signer could make for this owner, does."""
    assert _refusal(verifier, _tagged(signer, receiver.channel, bad_signature=True)) is None
    assert (verifier.taken_on_tag, verifier.signatures_checked) == (1, 0)


def test_a_tag_with_any_byte_changed_is_not_taken(
    signer: ReplySigner, receiver: ReplyVerifier, verifier: RequestVerifier
) -> None:
    """Not on the tag: with a signature that checks out the request is still taken (on it),
    with one that does not it is refused."""
    for bad_signature in (True, False):
        request = _tagged(signer, receiver.channel, bad_signature=bad_signature)
        tag = request["kwargs"]["tag"]
        for index in range(len(tag)):
            request["kwargs"]["tag"] = _changed(tag, index)
            expected = REFUSED if bad_signature else None
            assert _refusal(verifier, request) == expected, (index, bad_signature)
        for changed in (tag[:-1], tag + "0", tag.upper(), "", tag[:-1] + "é"):
            request["kwargs"]["tag"] = changed
            assert _refusal(verifier, request) == (REFUSED if bad_signature else None), changed
    assert verifier.taken_on_tag == 0
    assert verifier.signatures_checked == 2 * (len(tag) + 5)


def test_a_tag_for_another_owner_falls_back_to_the_signature(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    """The coordinator's guess is stale (the shard changed owner since its last grant): this
    owner checks the signature, and takes the request as it did before requests had tags."""
    elsewhere = ReplyVerifier("ks:orders:worker:former-owner").channel
    assert _refusal(verifier, _tagged(signer, elsewhere)) is None
    assert (verifier.taken_on_tag, verifier.signatures_checked) == (0, 1)
    assert _refusal(verifier, _tagged(signer, elsewhere, bad_signature=True)) == REFUSED


def test_a_tag_is_taken_only_by_a_receiving_owner(
    signer: ReplySigner, receiver: ReplyVerifier
) -> None:
    """The mover, which owns no shard, checks every signature (it has no coordination key)."""
    verifier = RequestVerifier()
    assert verifier.learn(signer.signer_id, signer.record())
    assert _refusal(verifier, _tagged(signer, receiver.channel, bad_signature=True)) == REFUSED
    assert _refusal(verifier, _tagged(signer, receiver.channel)) is None
    assert (verifier.taken_on_tag, verifier.signatures_checked) == (0, 2)


def test_a_tag_of_a_signer_whose_entry_lists_no_signing_key_is_not_taken(
    signer: ReplySigner, receiver: ReplyVerifier
) -> None:
    """The receiver may know the signer's coordination key (from messages it signed), but a
    request is taken only from a signer listed to make requests, on its tag or its signature."""
    entry = json.dumps({"key": signer.public_key, "at": 1})
    assert receiver.learn(signer.signer_id, entry)
    verifier = RequestVerifier(receiver)
    assert not verifier.learn(signer.signer_id, entry)
    assert _refusal(verifier, _tagged(signer, receiver.channel)) == REFUSED


def test_a_tag_of_a_signer_not_listed_is_not_taken(
    signer: ReplySigner, receiver: ReplyVerifier, verifier: RequestVerifier
) -> None:
    """An attacker's own signer tags for this owner as well as any worker does, but no worker
    lists it."""
    stranger = ReplySigner()
    assert _refusal(verifier, _tagged(stranger, receiver.channel)) == REFUSED


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("home", 0),
        ("op", "order-8"),
        ("attempt", 4),
        ("channel", "ks:orders:worker:evil"),
        ("at", NOW_MS + 1),
    ],
)
def test_a_request_changed_after_tagging_is_refused(
    signer: ReplySigner, receiver: ReplyVerifier, verifier: RequestVerifier, field: str, value: Any
) -> None:
    """The tag covers what the signature covers: a field changed under a genuine tag (and a
    signature that no longer checks out either) is refused."""
    request = _tagged(signer, receiver.channel)
    request["kwargs"][field] = value
    assert _refusal(verifier, request) == REFUSED


def test_a_request_for_other_keys_or_namespace_than_tagged_is_refused(
    signer: ReplySigner, receiver: ReplyVerifier, verifier: RequestVerifier
) -> None:
    request = _tagged(signer, receiver.channel)
    request["keys"] = ["sku:1"]
    assert _refusal(verifier, request) == REFUSED
    request = _request(signer)
    request["kwargs"]["tag"] = signer.tag_request(
        receiver.channel, _signed_text(request, "payments")
    )
    request["kwargs"]["sig"] = _changed(request["kwargs"]["sig"], 10)
    assert _refusal(verifier, request) == REFUSED


def test_a_request_whose_tag_is_not_a_string_is_malformed(
    signer: ReplySigner, verifier: RequestVerifier
) -> None:
    request = _request(signer)
    request["kwargs"]["tag"] = 7
    assert "bad grant request" in (_refusal(verifier, request) or "")


def test_a_grant_request_tag_checks_out_as_documented(signer: ReplySigner) -> None:
    """docs/wire-format.md, Grant requests: rebuilt from the page alone, with no keyserial
    code (an owner's key pair of the test's own, the signer's listed key), the tag matches."""
    own = X25519PrivateKey.generate()
    own_public = base64.urlsafe_b64encode(own.public_key().public_bytes_raw()).decode()[:43]
    channel = f"ks:orders:worker:0f3a.{own_public}"
    request = _request(signer, keys=["sku:1", "café"])
    tag = signer.tag_request(channel, _signed_text(request))
    kwargs = request["kwargs"]
    fields = [NAMESPACE, kwargs["to"], kwargs["home"], kwargs["op"], kwargs["attempt"]]
    fields += [kwargs["channel"], kwargs["at"], request["keys"]]
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)
    listed = json.loads(signer.record())["key"]
    signer_key = X25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(listed + "="))
    shared = own.exchange(signer_key)
    parts = [b"keyserial reply signature v1", shared, own_public.encode(), listed.encode()]
    key = hashlib.sha256(b"\n".join([*parts, kwargs["k"].encode()])).digest()
    message = f"keyserial request tag v1\n{own_public}\n{text}".encode()
    assert tag == hmac.digest(key, message, "sha256")[:16].hex()


# -- through workers -------------------------------------------------------------------------


async def test_transfers_between_two_workers_take_their_requests_on_tags(
    users: Users, namespace: str
) -> None:
    """The coordinator's first request to a shard carries no tag (it knows no owner yet) and
    its signature is checked; once that owner granted it, every next request is taken on its
    tag. After a takeover, the new owner checks the signature of the first request (tagged for
    the former owner) and takes it at once, then the next on their tags."""
    sources = keys_on_shard(HOME, SHARDS, 4, "acct")
    target = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    others = [s for s in range(SHARDS) if s != PARTICIPANT]
    async with (
        running_worker(users.worker_url, namespace, shard_count=SHARDS, shards=others),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        for source in sources:
            await ks.submit(source, deposit(100))
        async with running_worker(
            users.worker_url, namespace, shard_count=SHARDS, shards=[PARTICIPANT]
        ) as owner:
            for number, source in enumerate(sources[:3], start=1):
                moved = await ks.transfer(source, target, 10, timeout=15)
                assert moved == {source: 90, target: 10 * number}
            checked = owner._mailbox.requests
            assert (checked.signatures_checked, checked.taken_on_tag) == (1, 2)
        async with running_worker(
            users.worker_url, namespace, shard_count=SHARDS, shards=[PARTICIPANT]
        ) as successor:
            moved = await ks.transfer(sources[3], target, 10, timeout=15)
            assert moved == {sources[3]: 90, target: 40}
            moved = await ks.transfer(sources[0], target, 10, timeout=15)
            assert moved == {sources[0]: 80, target: 50}
            checked = successor._mailbox.requests
            assert (checked.signatures_checked, checked.taken_on_tag) == (1, 1)
    assert users.admin.xlen(ShardKeys(namespace, PARTICIPANT).dead) == 0
    assert users.refusals() == []


async def _append(attacker: redis.asyncio.Redis, namespace: str, envelope: dict[str, Any]) -> None:
    stream = ShardKeys(namespace, PARTICIPANT).stream
    await attacker.xadd(stream, {"v": "1", "ops": json.dumps([envelope])})


def _request_to(
    signer: ReplySigner, namespace: str, op: str, key: str, tag_for: str, *, bad_signature: bool
) -> dict[str, Any]:
    """A request of ``signer``'s for ``key``, tagged for the owner of channel ``tag_for``
    (an attempt that is over: once taken, the participant aborts it and releases the key)."""
    request = grant_request(
        signer,
        namespace,
        home=HOME,
        participant=PARTICIPANT,
        op=op,
        attempt=0,
        channel=f"ks:attacker:{uuid.uuid4().hex}",
        keys=[key],
    )
    request["kwargs"]["tag"] = signer.tag_request(tag_for, _signed_text(request, namespace))
    if bad_signature:
        request["kwargs"]["sig"] = _changed(request["kwargs"]["sig"], 10)
    return request


@pytest.mark.slow
async def test_a_forged_tag_with_a_bad_signature_is_refused_and_stores_nothing(
    users: Users, namespace: str
) -> None:
    """As the client user: a request in a listed signer's name (the test's stand-in for a
    worker) with a tag for the owner that the client cannot have made (the signer's, for
    another key) and a signature with a byte changed is dead-lettered, holds no key, stores
    nothing under its id. The controls, appended the same way: the same request tagged for the
    owner is taken on its tag; tagged for another owner but signed well, on its signature."""
    victim = keys_on_shard(PARTICIPANT, SHARDS, 1, "acct")[0]
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    participant = ShardKeys(namespace, PARTICIPANT)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=SHARDS) as worker,
            keyserial.connect(users.client_url, namespace=namespace) as ks,
        ):
            assert await ks.submit(victim, deposit(100)) == 100
            signer = listed_signer(users.admin, namespace)
            owner, elsewhere = worker._mailbox.channel, ReplyVerifier("ks:x:worker:y").channel
            sent = [
                ("forged", elsewhere, True),
                ("on-tag", owner, True),
                ("on-signature", elsewhere, False),
            ]
            for op, tag_for, bad in sent:
                await _append(
                    attacker,
                    namespace,
                    _request_to(signer, namespace, op, victim, tag_for, bad_signature=bad),
                )
            # (Taken and released: a refused request stores nothing under a '#' id.)
            await eventually(lambda: users.admin.hget(participant.results, "on-signature#0"))
            assert users.admin.hget(participant.results, "on-tag#0") is not None
            assert await ks.submit(victim, deposit(1), timeout=10) == 101
            dead = users.admin.xrange(participant.dead)
            assert [fields[b"reason"] for _, fields in dead] == [REFUSED.encode()]
            stored = users.admin.hkeys(participant.results)
            assert not [field for field in stored if field.startswith(b"forged#")]
            checked = worker._mailbox.requests
            assert (checked.taken_on_tag, checked.signatures_checked) == (1, 2)
    finally:
        await attacker.aclose()
    assert users.refusals() == []
