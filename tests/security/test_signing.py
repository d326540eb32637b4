"""Signed replies: a client takes the outcome of a reply that a worker signed for it without
reading it back, and only then; a worker lists its signing key where only workers write. Signed
coordination messages: a worker takes a grant or decision another worker signed for it as it is,
and any other only as a wake-up."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence

import anyio
import pytest
import redis
import redis.asyncio

import keyserial
from keyserial import BackendUnavailable
from keyserial._backend.signers import SIGNERS_DUE, SignersMet
from keyserial._wire.json_text import dumps
from keyserial._wire.layout import Layout, in_shard, signers_key
from keyserial._wire.messages import Decision, DecisionNotice, KeyGrant
from keyserial._wire.signing import SIGNER_TTL, ReplySigner, ReplyVerifier, signer_record
from keyserial._worker.crossshard.mailbox import Mailbox
from keyserial._worker.pipeline import coordination_messages
from keyserial.ledger import balance, deposit
from keyserial.testing import running_worker
from tests.entries import push_item
from tests.helpers import eventually
from tests.users import Users, documented_users

MESSAGE = '{"v":1,"r":[["op-1",{"ok":7,"s":0,"g":0,"e":["1-0"]}]]}'


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    with documented_users(redis_url) as created:
        yield created


def _met(verifier: ReplyVerifier, signer: ReplySigner) -> ReplyVerifier:
    assert verifier.learn(signer.signer_id, signer.record())
    return verifier


def test_a_signed_reply_verifies_on_its_own_channel_only() -> None:
    signer = ReplySigner()
    mine = _met(ReplyVerifier("ks:ns:reply:mine"), signer)
    other = _met(ReplyVerifier("ks:ns:reply:other"), signer)
    signed = signer.sign(mine.channel, MESSAGE).encode()
    unknown: list[str] = []
    assert mine.verified(signed, unknown.append) == MESSAGE
    assert other.verified(signed, unknown.append) is None  # (the tag covers the channel)
    assert mine.verified(signed.replace(b'"ok":7', b'"ok":8'), unknown.append) is None
    assert unknown == []


def test_a_signed_reply_is_taken_only_if_its_whole_tag_matches() -> None:
    """A tag that matches in its first half only (or its second) is a forgery: a check of
    half the tag would let a forger who tries 2^64 tags in, not 2^128."""
    signer = ReplySigner()
    verifier = _met(ReplyVerifier("ks:ns:reply:mine"), signer)
    signed = signer.sign(verifier.channel, MESSAGE)
    tag = json.loads(signed)["t"]
    for forged in (tag[:16] + _other_hex(tag[16:]), _other_hex(tag[:16]) + tag[16:]):
        assert verifier.verified(signed.replace(tag, forged).encode(), print) is None
    assert verifier.verified(signed.encode(), print) == MESSAGE


def _other_hex(digits: str) -> str:
    """``digits`` with every hex digit changed."""
    return "".join(f"{(int(digit, 16) + 1) % 16:x}" for digit in digits)


def test_a_reply_signed_by_a_signer_not_met_is_not_taken_and_its_key_is_asked_for() -> None:
    signer, impostor = ReplySigner(), ReplySigner()
    verifier = _met(ReplyVerifier("ks:ns:reply:mine"), impostor)
    unknown: list[str] = []
    assert (
        verifier.verified(signer.sign(verifier.channel, MESSAGE).encode(), unknown.append) is None
    )
    assert unknown == [signer.signer_id]
    # A key listed under another signer's id signs nothing of that signer's.
    impostor.signer_id = signer.signer_id
    assert verifier.verified(impostor.sign(verifier.channel, MESSAGE).encode(), print) is None


async def test_signers_met_meanwhile_are_read_together_and_a_failed_read_again() -> None:
    verifier, listed, unlisted = ReplyVerifier("ks:ns:reply:mine"), ReplySigner(), ReplySigner()
    signers = SignersMet(verifier, logging.getLogger(__name__), what="signers", meanwhile="-")
    reads: list[list[str]] = []

    async def read(signer_ids: Sequence[str]) -> list[bytes | None]:
        reads.append(list(signer_ids))
        if len(reads) == 1:
            raise BackendUnavailable("redis://test", "no answer")
        return [listed.record().encode() if id == listed.signer_id else None for id in signer_ids]

    for signer in (listed, unlisted, listed):
        signers.met(signer.signer_id)
    async with anyio.create_task_group() as group:
        group.start_soon(signers.learn, read)
        await eventually(lambda: verifier.knows(listed.signer_id))
        group.cancel_scope.cancel()
    assert reads == [[listed.signer_id, unlisted.signer_id]] * 2
    assert not verifier.knows(unlisted.signer_id)  # (read again only once met again)


async def test_a_flood_of_signer_ids_costs_one_bounded_read() -> None:
    signers = SignersMet(
        ReplyVerifier("ks:ns:reply:mine"),
        logging.getLogger(__name__),
        what="signers",
        meanwhile="-",
    )
    reads: list[int] = []

    async def read(signer_ids: Sequence[str]) -> list[bytes | None]:
        reads.append(len(signer_ids))
        return [None] * len(signer_ids)

    for n in range(10 * SIGNERS_DUE):
        signers.met(f"{n:016x}")
    async with anyio.create_task_group() as group:
        group.start_soon(signers.learn, read)
        await eventually(lambda: reads)
        group.cancel_scope.cancel()
    assert reads == [SIGNERS_DUE]


def test_a_channel_that_names_no_client_key_gets_replies_unsigned() -> None:
    assert ReplySigner().sign("ks:ns:reply:7f3c9a", MESSAGE) == MESSAGE
    # A key of low order (here the zero point) has no secret to share: unsigned, not an error.
    assert ReplySigner().sign("ks:ns:reply:7f3c9a." + "A" * 43, MESSAGE) == MESSAGE
    assert not ReplyVerifier("ks:ns:reply:mine").learn(
        "0123456789abcdef", signer_record("A" * 43, time.time())
    )


async def test_an_op_whose_reply_channel_names_a_key_of_low_order_is_answered_unsigned(
    users: Users, namespace: str
) -> None:
    """A client user's op whose channel names the zero point (no shared secret) is answered
    unsigned, and its worker goes on serving every shard."""
    evil = f"ks:{namespace}:reply:evil." + "A" * 43
    attacker = redis.asyncio.Redis.from_url(users.client_url)
    try:
        async with (
            running_worker(users.worker_url, namespace, shard_count=2),
            keyserial.connect(users.client_url, namespace=namespace) as ks,
            attacker.pubsub() as listener,
        ):
            await listener.subscribe(evil)
            shard = ks.shard_of("acct:9")
            envelope = {
                "id": "evil-1",
                "key": "acct:9",
                "op": "deposit",
                "args": [5],
                "reply": evil,
            }
            await push_item(attacker, namespace, shard, [envelope], fresh=False, wake=True)
            with anyio.fail_after(10):
                while (
                    message := await listener.get_message(ignore_subscribe_messages=True, timeout=1)
                ) is None:
                    pass
            (replied,) = json.loads(message["data"])["r"]
            assert replied[0] == "evil-1" and replied[1]["ok"] == 5
            assert "k" not in json.loads(message["data"])  # (unsigned)
            for key in ("acct:9", "acct:10", "acct:11"):
                assert await ks.submit(key, deposit(1), timeout=10) >= 1
    finally:
        await attacker.aclose()


async def test_signed_replies_settle_ops_without_reading_their_records(
    users: Users, namespace: str
) -> None:
    """Under the documented ACL users: the worker lists its signer, the client reads it once,
    and from then on takes each reply's outcome as it is: with its user no longer allowed to
    read the results at all, its submits are still answered, and nothing it sent was refused."""
    async with (
        running_worker(users.worker_url, namespace, shard_count=4),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        await ks.submit("acct:1", deposit(1))  # (its reply makes the client read the signer)
        signer = await eventually(lambda: users.admin.hkeys(signers_key(namespace)))
        await eventually(lambda: ks._verifier.knows(signer[0].decode()))
        users.admin.acl_setuser(users.names[1], enabled=True, commands=["-hmget", "-hget"])
        for n in range(20):
            assert await ks.submit("acct:1", deposit(1), timeout=5) == n + 2
        users.admin.acl_setuser(users.names[1], enabled=True, commands=["+hmget", "+hget"])
        assert await ks.submit("acct:1", balance()) == 21
    assert users.refusals() == []


async def test_a_worker_lists_its_signer_and_drops_those_not_renewed(
    users: Users, namespace: str
) -> None:
    signers = signers_key(namespace)
    other = ReplySigner()
    users.admin.hset(
        signers,
        mapping={
            "0123456789abcdef": signer_record(other.public_key, time.time() - SIGNER_TTL - 60),
            other.signer_id: other.record(),
        },
    )
    async with running_worker(users.worker_url, namespace, shard_count=2):
        listed = await eventually(
            lambda: len(users.admin.hkeys(signers)) == 2 and users.admin.hgetall(signers)
        )
    assert b"0123456789abcdef" not in listed and other.signer_id.encode() in listed
    own = next(
        json.loads(record)
        for signer, record in listed.items()
        if signer != other.signer_id.encode()
    )
    assert abs(own["at"] - time.time()) < 60
    with pytest.raises(redis.exceptions.NoPermissionError):
        users.client.hset(signers, "0123456789abcdef", other.record())


# -- coordination messages between workers: signed like replies --------------------------------

GRANT = KeyGrant("op-1", 4, 9, [("acct:1", '{"balance":5}')], 7, "ks:ns:worker:b.key", 2)


def _mailbox() -> Mailbox:
    return Mailbox("ks:ns:worker:a", lambda shard: None)


async def test_a_grant_signed_for_a_worker_by_a_listed_worker_is_taken_as_it_is() -> None:
    mailbox, participant = _mailbox(), ReplySigner()
    _met(mailbox.verifier, participant)
    with mailbox.expect_grant("op-1", 2, 4, 9) as waiter:
        mailbox.receive(
            mailbox.channel, participant.sign(mailbox.channel, dumps(GRANT.to_wire())).encode()
        )
        assert await waiter.within(0) == GRANT


@pytest.mark.parametrize("sent", ["unsigned", "signer not met", "for another worker", "altered"])
async def test_any_other_grant_only_wakes_its_waiter_to_read_the_record(sent: str) -> None:
    mailbox, participant, other = _mailbox(), ReplySigner(), _mailbox()
    if sent != "signer not met":
        _met(mailbox.verifier, participant)
    message = dumps(GRANT.to_wire())
    raw = {
        "unsigned": message,
        "signer not met": participant.sign(mailbox.channel, message),
        "for another worker": participant.sign(other.channel, message),
        "altered": participant.sign(mailbox.channel, message).replace('"f":7', '"f":8'),
    }[sent]
    with mailbox.expect_grant("op-1", 2, 4, 9) as waiter:
        mailbox.receive(mailbox.channel, raw.encode())
        assert await waiter.within(0) is None
        assert waiter.pending is False  # (a wake-up is spent by within())
    learned: list[list[str]] = []

    async def read(signer_ids: Sequence[str]) -> list[bytes | None]:
        learned.append(list(signer_ids))
        return [participant.record().encode() for _ in signer_ids]

    with anyio.move_on_after(0.2):
        await mailbox.signers.learn(read)
    # Only a signer not met yet is looked up, once, and its next message is taken.
    assert learned == ([[participant.signer_id]] if sent == "signer not met" else [])
    assert mailbox.verifier.knows(participant.signer_id)


async def test_a_signed_decision_notice_is_taken_as_it_is() -> None:
    mailbox, coordinator = _mailbox(), ReplySigner()
    _met(mailbox.verifier, coordinator)
    notice = DecisionNotice("op-1", 4, Decision({9: [("acct:1", '{"balance":6}')]}), 2)
    with mailbox.expect_decision("op-1", 2, 4) as waiter:
        signed = coordinator.sign(mailbox.channel, dumps(notice.to_wire()))
        mailbox.receive(mailbox.channel, signed.encode())
        assert await waiter.within(0) == notice


async def test_with_shard_channels_a_message_is_taken_only_on_the_channel_it_was_signed_for() -> (
    None
):
    """On a cluster a worker has a channel per shard (``ks:{ns:<shard>}:worker:...``): a grant
    signed for one of them is taken when it comes on that one, and only wakes on another (the
    tag covers the channel)."""
    mailbox, participant = _mailbox(), ReplySigner()
    mailbox.use_shard_channels(Layout("ns", 4))
    _met(mailbox.verifier, participant)
    assert mailbox.channel_for(2) == "ks:{ns:2}:worker:a." + mailbox.verifier.public_key
    assert all(map(mailbox.is_mine, mailbox.channels)) and len(mailbox.channels) == 5
    signed = participant.sign(mailbox.channel_for(2), dumps(GRANT.to_wire())).encode()
    with mailbox.expect_grant("op-1", 2, 4, 9) as waiter:
        mailbox.receive(mailbox.channel_for(3), signed)
        assert await waiter.within(0) is None
        mailbox.receive(mailbox.channel_for(2), signed)
        assert await waiter.within(0) == GRANT


NOTICE = DecisionNotice("op-2", 5, Decision({9: [("acct:2", '{"balance":1}')]}), 2)


def test_what_a_worker_owes_another_in_one_pipeline_goes_as_one_message_per_channel() -> None:
    """Items for one channel travel as one batch, signed once; a lone item as it is."""
    signer, other = ReplySigner(), _mailbox()
    mailbox = _mailbox()
    grant, notice = dumps(GRANT.to_wire()), dumps(NOTICE.to_wire())
    sent = coordination_messages(
        [(mailbox.channel, grant), (other.channel, notice), (mailbox.channel, notice)], signer
    )
    assert [channel for channel, _ in sent] == [mailbox.channel, other.channel]
    assert sent[0][1] == signer.sign(
        mailbox.channel, '{"t":"b","m":[' + grant + "," + notice + "]}"
    )
    assert sent[1][1] == signer.sign(other.channel, notice)
    assert coordination_messages([(other.channel, notice)], None) == [(other.channel, notice)]


async def test_a_signed_batch_hands_over_each_of_its_items() -> None:
    mailbox, peer = _mailbox(), ReplySigner()
    _met(mailbox.verifier, peer)
    items = [(mailbox.channel, dumps(GRANT.to_wire())), (mailbox.channel, dumps(NOTICE.to_wire()))]
    [(_, message)] = coordination_messages(items, peer)
    with (
        mailbox.expect_grant("op-1", 2, 4, 9) as granted,
        mailbox.expect_decision("op-2", 2, 5) as decided,
    ):
        mailbox.receive(mailbox.channel, message.encode())
        assert await granted.within(0) == GRANT
        assert await decided.within(0) == NOTICE


@pytest.mark.parametrize("sent", ["unsigned", "one item altered"])
async def test_any_other_batch_only_wakes_the_waiters_of_its_items(sent: str) -> None:
    """The signature covers the whole batch: change any item, and none is taken as it is."""
    mailbox, peer = _mailbox(), ReplySigner()
    _met(mailbox.verifier, peer)
    items = [(mailbox.channel, dumps(GRANT.to_wire())), (mailbox.channel, dumps(NOTICE.to_wire()))]
    [(_, message)] = coordination_messages(items, None if sent == "unsigned" else peer)
    if sent == "one item altered":
        message = message.replace('"f":7', '"f":8')
    with (
        mailbox.expect_grant("op-1", 2, 4, 9) as granted,
        mailbox.expect_decision("op-2", 2, 5) as decided,
    ):
        mailbox.receive(mailbox.channel, message.encode())
        for waiter in (granted, decided):
            assert waiter.pending, "each item wakes its waiter, to read the record"
            assert await waiter.within(0) is None


@pytest.mark.parametrize("items", ["5", "[]", '[{"t":"x"}]'])
def test_a_malformed_batch_is_logged_and_ignored(
    items: str, caplog: pytest.LogCaptureFixture
) -> None:
    mailbox = _mailbox()
    with mailbox.expect_grant("op-1", 2, 4, 9) as waiter:
        mailbox.receive(mailbox.channel, ('{"t":"b","m":' + items + "}").encode())
        assert not waiter.pending
    assert "ignoring a malformed coordination message" in caplog.text


def test_a_signer_derives_one_key_per_client_whatever_its_channels() -> None:
    """On a cluster a client has a reply channel per shard: the signer's key exchange runs once
    per client, not once per channel (its cache holds a few thousand entries)."""
    client, signer = ReplyVerifier("ks:ns:reply:c"), ReplySigner()
    _met(client, signer)
    for shard in range(64):
        channel = in_shard(client.channel, "ns", shard)
        signed = signer.sign(channel, MESSAGE).encode()
        assert client.verified(signed, print, channel) == MESSAGE
    assert len(signer._keys) == 1
