"""A signer of the tests' own, listed in a namespace's signers hash as a worker lists itself:
what a worker (or whoever holds a worker's rights) can sign, and a client user cannot. Workers
ask each other for grants in coordination messages signed for the receiving worker's channel;
these helpers build such requests and messages, and find where they go."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import anyio
import redis

from keyserial import Worker
from keyserial._wire.layout import owner_channel, shard_name, signers_key
from keyserial._wire.messages import GrantRequest, batch
from keyserial._wire.signing import ReplySigner, without_signature
from keyserial.testing import ShardKeys
from tests.helpers import eventually, publish

GRANT_OP = "keyserial.grant"


def listed_signer(admin: redis.Redis, namespace: str) -> ReplySigner:
    """A signer whose entry is in ``namespace``'s signers hash (written as admin)."""
    signer = ReplySigner()
    admin.hset(signers_key(namespace), signer.signer_id, signer.record())
    return signer


def request(
    *,
    home: int,
    participant: int,
    op: str,
    attempt: int,
    channel: str,
    keys: Sequence[str],
    at: int | None = None,
    generation: int = 0,
) -> GrantRequest:
    """A grant request for ``keys`` on shard ``participant``, made now (or ``at``, in ms)."""
    return GrantRequest(
        home,
        op,
        attempt,
        shard_name(participant, generation),
        tuple(keys),
        channel,
        int(time.time() * 1000) if at is None else at,
    )


def message(signer: ReplySigner | None, channel: str, *items: GrantRequest | str) -> str:
    """One coordination message of ``items`` (requests, or items' JSON text) for ``channel``,
    signed for it by ``signer`` as a worker signs (None: unsigned)."""
    texts = [item if isinstance(item, str) else json.dumps(item.to_wire()) for item in items]
    text = batch(texts)
    return text if signer is None else signer.sign(channel, text)


def owner_of(admin: redis.Redis, namespace: str, shard: int) -> str:
    """The coordination channel of ``shard``'s owner, read off its lease as a coordinator reads
    it (a client user may read it too)."""
    holder = admin.get(ShardKeys(namespace, shard).lease)
    assert holder is not None, f"shard {shard} has no owner"
    return owner_channel(namespace, holder.decode())


def request_channels(admin: redis.Redis, namespace: str, shard: int) -> list[str]:
    """Every channel on which a coordinator's grant requests may reach ``shard``'s owner: its
    channel, and on a cluster also that channel in the shard's slot (sharded pub/sub)."""
    owner = owner_of(admin, namespace, shard)
    if not admin.info("cluster").get("cluster_enabled"):
        return [owner]
    return [owner, ShardKeys(namespace, shard).in_shard(owner)]


async def introduce(publisher: Any, worker: Worker, signer: ReplySigner) -> None:
    """Have ``worker`` meet ``signer`` (a message of its to the worker makes it read the
    signer's entry), so that what ``signer`` signs for it next is judged on its merits."""
    channel = worker._mailbox.channel
    hello = '{"t":"d","op":"hello","a":0,"d":{"w":{}}}'  # (a notice nobody waits for)
    await publish(publisher, channel, signer.sign(channel, hello))
    await eventually(
        lambda: worker._mailbox.verifier.knows(signer.signer_id),
        message=f"worker {worker.token} knows signer {signer.signer_id}",
    )


async def next_request(pubsub: Any, *, timeout: float = 10) -> tuple[str, bytes, dict[str, Any]]:
    """The next message on ``pubsub``'s channels that carries a grant request: its channel, its
    bytes as published, and its (first) request item."""
    with anyio.fail_after(timeout):
        while True:
            got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if got is None:
                continue
            data: bytes = got["data"]
            # (Parsed without the signature's fields, whose names its items use too.)
            decoded = json.loads(without_signature(data))
            items = decoded["m"] if decoded.get("t") == "b" else [decoded]
            found = [item for item in items if item.get("t") == "q"]
            if found:
                channel = got["channel"]
                return channel.decode() if isinstance(channel, bytes) else channel, data, found[0]
