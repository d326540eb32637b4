"""The worker's pipeliner: how the replies of committed ops go out."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anyio
import pytest
import redis.asyncio
from anyio import wait_all_tasks_blocked

from keyserial._backend.backend import Backend
from keyserial._scripts.calls import Script, ScriptCall
from keyserial._wire.signing import ReplySigner, ReplyVerifier
from keyserial._worker.pipeline import Pipeliner
from keyserial._worker.writes import WriteChain, WriteChainBroken

# Publishes ARGV[2] (JSON [[channel, message], ...]) and returns how many messages that was;
# fails, publishing nothing, on ARGV[1] 'fail'.
_TEXT = """
if ARGV[1] == 'fail' then return redis.error_reply('FENCED test') end
local replies = cjson.decode(ARGV[2])
for _, reply in ipairs(replies) do redis.call('PUBLISH', reply[1], reply[2]) end
return #replies
"""
PUBLISHING = Script(
    "publishing", _TEXT, hashlib.sha1(_TEXT.encode()).hexdigest(), argv=("mode", "replies")
)
CHANNEL = "ks:test-pipeline:reply"


async def one_batch(
    redis_url: str, calls: list[tuple[str, str | None]], *, passed: bool = False
) -> tuple[list[Any], list[Any]]:
    """Run ``(mode, op id)`` calls in one pipeline batch, each committing one op whose reply goes
    to CHANNEL (none without an op id), through a client of keyserial's or (``passed``) one the
    caller passed in. What each call returned, and the reply messages published, decoded."""
    given = redis.asyncio.Redis.from_url(redis_url) if passed else None
    backend = await Backend.connect(redis_url if given is None else given)
    messages: list[Any] = []
    ended = anyio.Event()

    def receive(_: str, data: bytes) -> None:
        if data == b"end":
            ended.set()
        else:
            messages.append(json.loads(data))

    results: list[Any] = [None] * len(calls)
    pipeliner = Pipeliner(backend)

    async def run(index: int, mode: str, op_id: str | None) -> None:
        call = ScriptCall(PUBLISHING, ["{t}x"], [mode, "[]"])
        replies = None if op_id is None else {CHANNEL: [(op_id, '{"ok":1}')]}
        try:
            results[index] = await pipeliner.run(call, replies)
        except Exception as exc:
            results[index] = str(exc)

    try:
        async with anyio.create_task_group() as group:
            await group.start(backend.listen, [CHANNEL], receive)
            async with anyio.create_task_group() as callers:
                for index, (mode, op_id) in enumerate(calls):
                    callers.start_soon(run, index, mode, op_id)
                await wait_all_tasks_blocked()  # every call queued: they go out as one batch
                group.start_soon(pipeliner.serve)
            # Published after the batch's replies, so heard after them.
            await backend.call("PUBLISH", CHANNEL, "end")
            with anyio.fail_after(5):
                await ended.wait()
            group.cancel_scope.cancel()
    finally:
        await backend.aclose()
        if given is not None:
            await given.aclose()
    return results, messages


async def test_replies_of_a_batch_go_out_once_committed_one_message_per_channel(
    redis_url: str, request: pytest.FixtureRequest
) -> None:
    """Several committed calls: on keyserial's own connection (standalone) one message carries
    all their replies; elsewhere each script publishes its own. A failed call's replies are
    never published."""
    results, messages = await one_batch(redis_url, [("ok", "a"), ("fail", "b"), ("ok", "c")])
    standalone = "standalone" in request.node.callspec.id
    by_script = 0 if standalone else 1
    assert results == [by_script, "FENCED test", by_script]
    replied = sorted(op_id for message in messages for op_id, _ in message["r"])
    assert replied == ["a", "c"]
    assert len(messages) == (1 if standalone else 2)


async def test_through_a_client_passed_in_each_script_publishes_its_own_replies(
    redis_url: str,
) -> None:
    """redis-py's connections (a pool) would have to wait for the answer of a PUBLISH sent after
    the batch, to keep it ahead of the next: each committed call's script publishes its own."""
    results, messages = await one_batch(
        redis_url, [("ok", "a"), ("fail", "b"), ("ok", "c")], passed=True
    )
    assert results == [1, "FENCED test", 1]
    assert sorted(op_id for message in messages for op_id, _ in message["r"]) == ["a", "c"]


async def test_a_batch_with_one_call_replying_lets_its_script_publish(redis_url: str) -> None:
    """Alone, a call's replies go out from its script (no extra hop after the batch)."""
    results, messages = await one_batch(redis_url, [("ok", "a"), ("ok", None)])
    assert results == [1, 0]  # the first call's script published its reply
    assert messages == [{"v": 1, "r": [["a", {"ok": 1}]]}]


async def test_messages_published_in_one_round_go_as_one_signed_message_per_channel(
    redis_url: str,
) -> None:
    """``publish`` (a grant request, a grant) waits for no commit: what a worker owes one peer
    in an event-loop round goes in one message, signed once for that peer's channel, and
    another peer's in a message of its own."""
    backend = await Backend.connect(redis_url)
    signer = ReplySigner()
    peers = [ReplyVerifier("ks:test-pipeline:worker:a"), ReplyVerifier("ks:test-pipeline:worker:b")]
    for peer in peers:
        peer.learn(signer.signer_id, signer.record())
    pipeliner = Pipeliner(backend, signer=signer)
    client = redis.asyncio.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(*(peer.channel for peer in peers))
        for _ in peers:
            await pubsub.get_message(timeout=5)  # (the subscription's confirmations)
        async with anyio.create_task_group() as group:
            group.start_soon(pipeliner.serve)
            pipeliner.publish(peers[0].channel, '{"t":"x","n":1}')
            pipeliner.publish(peers[1].channel, '{"t":"x","n":2}')
            pipeliner.publish(peers[0].channel, '{"t":"x","n":3}')
            got: dict[str, list[bytes]] = {}
            with anyio.fail_after(5):
                while sum(map(len, got.values())) < 2:
                    message = await pubsub.get_message(timeout=1)
                    if message is not None:
                        got.setdefault(message["channel"].decode(), []).append(message["data"])
            group.cancel_scope.cancel()
    finally:
        await pubsub.aclose()
        await client.aclose()
        await backend.aclose()
    first = peers[0].verified(got[peers[0].channel][0], lambda _: None)
    second = peers[1].verified(got[peers[1].channel][0], lambda _: None)
    assert first is not None and json.loads(first) == {
        "t": "b",
        "m": [{"t": "x", "n": 1}, {"t": "x", "n": 3}],
    }
    assert second is not None and json.loads(second) == {"t": "x", "n": 2}
    assert peers[1].verified(got[peers[0].channel][0], lambda _: None) is None


async def test_a_broken_lineage_sends_nothing_without_durability_either(redis_url: str) -> None:
    """A runner whose cache may not be Redis's (a push not in the stream, a commit across
    shards of unknown outcome) must write nothing more, whatever the durability setting: its
    call is refused with ``WriteChainBroken`` and never reaches Redis; a healthy one goes out."""
    backend = await Backend.connect(redis_url)
    pipeliner = Pipeliner(backend)  # no durability
    broken, healthy = WriteChain(broken=True), WriteChain()
    outcomes: dict[str, Any] = {}

    async def run(name: str, write_chain: WriteChain) -> None:
        replies = [[CHANNEL, f"sent by {name}"]]
        call = ScriptCall(PUBLISHING, ["{t}x"], ["ok", json.dumps(replies)])
        try:
            outcomes[name] = await pipeliner.run(call, None, [write_chain])
        except WriteChainBroken as exc:
            outcomes[name] = exc

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pipeliner.serve)
            await run("broken", broken)
            await run("healthy", healthy)
            group.cancel_scope.cancel()
    finally:
        await backend.aclose()
    assert isinstance(outcomes["broken"], WriteChainBroken)
    assert outcomes["healthy"] == 1
