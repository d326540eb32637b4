"""Sharded pub/sub: on a cluster, wake-ups and replies travel on shard channels (SPUBLISH, in
their shard's slot); on a standalone server, on classic channels. A client user who names a
shard channel of another slot as an op's reply channel gets its reply by PUBLISH, and the
worker goes on serving. (Through a failover of 3 masters: tests/faults/test_cluster_failover.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anyio
import redis.asyncio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests.helpers import monitored

SHARDS = 4


@dataclass
class Published:
    """What a deposit and a transfer under a worker published, and the client's channels."""

    reply: str  # the client's reply channel
    reply_of_shard_2: str  # the one it sends with ops homed on shard 2
    sharded: list[str]  # SPUBLISH commands the server ran
    classic: list[str]  # PUBLISH commands


async def published_by_ops(url: str, namespace: str) -> Published:
    async with (
        running_worker(url, namespace, shard_count=SHARDS),
        keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks,
        monitored(url) as commands,
    ):
        await ks.submit("account:1", deposit(5), timeout=10)
        await ks.transfer("account:1", "account:2", 2, timeout=10)
    return Published(
        ks._reply,
        ks._reply_for(ks.layout.keys(2)),
        [command for command in commands if command.startswith("SPUBLISH ")],
        [command for command in commands if command.startswith("PUBLISH ")],
    )


async def test_on_a_cluster_wake_ups_and_replies_are_shard_messages(
    cluster_server: LocalServer, namespace: str
) -> None:
    published = await published_by_ops(cluster_server.url, namespace)
    assert published.reply_of_shard_2.startswith(f"ks:{{{namespace}:2}}:reply:")
    assert published.classic == [], published.classic
    wake = f":wake:{keyserial.shard_for('account:1', SHARDS)} "
    assert any(wake in command for command in published.sharded)
    assert any(":reply:" in command for command in published.sharded)


async def test_on_a_standalone_server_messages_stay_on_classic_channels(
    standalone_server: LocalServer, namespace: str
) -> None:
    published = await published_by_ops(standalone_server.url, namespace)
    assert published.reply_of_shard_2 == published.reply
    assert published.sharded == []
    assert any(":reply:" in command for command in published.classic)


async def test_a_reply_channel_in_another_slot_is_published_classic_and_serving_goes_on(
    cluster_server: LocalServer, namespace: str
) -> None:
    """An op appended with a shard channel of another shard as its reply channel: its script
    may not SPUBLISH outside its slot, so it PUBLISHes, and the shard keeps serving."""
    url = cluster_server.url
    attacker = redis.asyncio.Redis.from_url(url)
    try:
        async with (
            running_worker(url, namespace, shard_count=SHARDS),
            keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks,
            attacker.pubsub() as listener,
        ):
            shard = ks.shard_of("acct:7")
            elsewhere = f"ks:{{{namespace}:{(shard + 1) % SHARDS}}}:reply:evil"
            await listener.subscribe(elsewhere)
            envelope = {"id": "evil-1", "key": "acct:7", "op": "deposit", "args": [3]}
            ops = json.dumps([{**envelope, "reply": elsewhere}])
            await attacker.xadd(ShardKeys(namespace, shard).stream, {"v": "1", "ops": ops})
            with anyio.fail_after(10):
                while (
                    message := await listener.get_message(ignore_subscribe_messages=True, timeout=1)
                ) is None:
                    pass
            assert json.loads(message["data"])["r"][0][0] == "evil-1"
            assert await ks.submit("acct:7", deposit(1), timeout=10) == 4
    finally:
        await attacker.aclose()
