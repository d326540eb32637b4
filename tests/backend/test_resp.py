"""The hot path's own pipelined connection (``keyserial._backend.resp``) against a real server: it
returns what redis-py returns, keeps replies in order across concurrent batches and cancelled
callers, reconnects after a server restart, authenticates, and its subscriptions deliver every
message."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from redis import exceptions as redis_errors

from keyserial._backend.backend import Backend
from keyserial._backend.resp import PipelinedConnection, Subscriber, reply_error
from keyserial._backend.transport import OwnConnection
from keyserial._scripts.calls import ScriptCall
from keyserial._scripts.commit import StepArgs
from keyserial._scripts.refusals import Fenced
from keyserial.errors import BackendUnavailable
from keyserial.testing import LocalServer

LUA = "return {KEYS[1], tonumber(ARGV[1]) + 1, {ARGV[2], false}, redis.status_reply('FINE')}"


def _connection(server: LocalServer, **options: Any) -> PipelinedConnection:
    return PipelinedConnection("127.0.0.1", server.port, timeout=5.0, **options)


async def test_replies_match_redis_py(standalone_server: LocalServer) -> None:
    commands: list[tuple[Any, ...]] = [
        ("SET", "resp:a", "ünïcødé"),
        ("GET", "resp:a"),
        ("GET", "resp:missing"),
        ("INCRBY", "resp:n", 5),
        ("HSET", "resp:h", "f", b"\x00raw"),
        ("HMGET", "resp:h", "f", "g"),
        ("EVAL", LUA, 1, "resp:k", 41, "x"),
        ("EVALSHA", "0" * 40, 0),
        ("EVAL", "return redis.error_reply('FENCED epoch 3 is no longer the owner')", 0),
        ("DEL", "resp:a", "resp:n", "resp:h"),
    ]
    ours = await _connection(standalone_server).execute(commands)
    client = redis.asyncio.Redis.from_url(standalone_server.url)
    client.response_callbacks.clear()  # raw replies, as keyserial reads them
    try:
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        theirs = await pipe.execute(raise_on_error=False)
    finally:
        await client.aclose()
    assert [type(reply) for reply in ours] == [type(reply) for reply in theirs]
    for mine, redis_py in zip(ours, theirs, strict=True):
        if isinstance(mine, Exception):
            assert str(mine) == str(redis_py)
        else:
            assert mine == redis_py
    assert isinstance(ours[7], redis_errors.NoScriptError)
    assert str(ours[8]).startswith("FENCED")


async def test_concurrent_batches_and_cancelled_callers_keep_replies_in_order(
    standalone_server: LocalServer,
) -> None:
    connection = _connection(standalone_server)
    results: dict[int, list[Any]] = {}

    async def batch(index: int) -> None:
        results[index] = await connection.execute(
            [("ECHO", f"{index}:{n}") for n in range(index % 7 + 1)]
        )

    async def cancelled(index: int) -> None:
        with anyio.move_on_after(0):  # gives up before its replies arrive
            await connection.execute([("ECHO", f"gone:{index}")] * 3)

    async with anyio.create_task_group() as tasks:
        for index in range(200):
            tasks.start_soon(batch, index)
            if index % 10 == 0:
                tasks.start_soon(cancelled, index)
    for index, replies in results.items():
        assert replies == [f"{index}:{n}".encode() for n in range(index % 7 + 1)]
    assert len(results) == 200
    assert await connection.execute([("ECHO", "after")]) == [b"after"]
    await connection.aclose()


async def test_a_restarted_server_is_reconnected_and_a_dead_one_reported(tmp_path: Path) -> None:
    server = LocalServer(data_dir=tmp_path / "redis")
    server.start()
    backend = await Backend.connect(server.url)
    try:
        assert isinstance(backend.transport, OwnConnection), "a redis:// URL takes the hot path's"
        assert await backend.call("SET", "resp:k", "v") == b"OK"
        server.restart()
        # The old connection is gone: a batch that races its close fails as BackendUnavailable
        # (it may or may not have run, as with redis-py), and the next one reconnects. A script
        # the restarted server no longer knows is sent again in full.
        keys = [f"resp:{n}" for n in range(8)]
        call = ScriptCall(StepArgs.SCRIPT, keys, ["1", "", 1, "0-0", 0, "", "0", 0])
        failures = 0
        while True:
            try:
                (reply,) = await backend.run_many([call])
                break
            except BackendUnavailable:
                failures += 1
                assert failures == 1, "only a batch sent on the dead connection fails"
        assert isinstance(reply, Fenced) and "FENCED" in str(reply)
        server.stop()
        with pytest.raises(BackendUnavailable):
            await backend.run_many([call])
        with pytest.raises(BackendUnavailable):
            await backend.call("GET", "resp:k")
    finally:
        server.stop()
        await backend.aclose()


async def test_a_reply_that_never_comes_fails_the_batch_in_time(
    standalone_server: LocalServer,
) -> None:
    connection = PipelinedConnection("127.0.0.1", standalone_server.port, timeout=0.3)
    assert await connection.execute([("PING",)]) == [b"PONG"]
    admin = redis.asyncio.Redis(port=standalone_server.port)
    await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # the server stops answering
    try:
        with anyio.fail_after(1.2), pytest.raises(redis_errors.TimeoutError):
            await connection.execute([("PING",)])
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
    # The connection that timed out was dropped: a new one serves the next batch.
    assert await connection.execute([("PING",)]) == [b"PONG"]
    await connection.aclose()


async def test_password_and_database_from_the_url(tmp_path: Path) -> None:
    server = LocalServer(data_dir=tmp_path / "redis")
    server.start()
    try:
        admin = redis.asyncio.Redis(port=server.port)
        await admin.config_set("requirepass", "s3cret")
        await admin.aclose()
        backend = await Backend.connect(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        try:
            await backend.call("SET", "resp:db", "three")
        finally:
            await backend.aclose()
        check = redis.asyncio.Redis(port=server.port, password="s3cret", db=3)
        assert await check.get("resp:db") == b"three"
        await check.aclose()
        wrong = PipelinedConnection("127.0.0.1", server.port, password="nope", timeout=5.0)
        with pytest.raises(redis_errors.AuthenticationError):
            await wrong.execute([("PING",)])
    finally:
        server.stop()


async def test_a_subscriber_gets_every_message_in_order(standalone_server: LocalServer) -> None:
    received: list[tuple[str, bytes]] = []
    subscriber = Subscriber(
        _connection(standalone_server),
        ["resp:one", "resp:two"],
        lambda channel, data: received.append((channel, data)),
    )
    await subscriber.subscribe(within=5)  # returns once both channels are confirmed
    publisher = _connection(standalone_server)
    sent = [("resp:one" if n % 2 else "resp:two", f"m{n}".encode()) for n in range(500)]
    await publisher.execute([("PUBLISH", channel, data) for channel, data in sent])
    with anyio.fail_after(5):
        while len(received) < len(sent):
            await asyncio.sleep(0.01)
    assert received == sent
    subscriber.close()
    assert isinstance(await subscriber.wait_closed(), redis_errors.ConnectionError)
    await publisher.aclose()


async def test_commands_sent_without_waiting_go_out_before_later_ones_or_on_their_own(
    standalone_server: LocalServer,
) -> None:
    """``send_nowait`` (a worker's reply messages) is written with the next batch sent in the
    same round of the event loop, ahead of it; with none, it is written on its own."""
    connection = _connection(standalone_server)
    await connection.execute([("DEL", "resp:nowait")])
    assert connection.send_nowait([("RPUSH", "resp:nowait", "first")])
    assert await connection.execute([("RPUSH", "resp:nowait", "second")]) == [2]
    assert connection.send_nowait([("RPUSH", "resp:nowait", "alone")])
    probe = _connection(standalone_server)
    with anyio.fail_after(5):
        while await probe.execute([("LLEN", "resp:nowait")]) != [3]:
            await asyncio.sleep(0.01)
    assert await probe.execute([("LRANGE", "resp:nowait", 0, -1)]) == [
        [b"first", b"second", b"alone"]
    ]
    await connection.aclose()
    await probe.aclose()


async def test_a_subscription_lost_to_a_server_restart_resubscribes(tmp_path: Path) -> None:
    server = LocalServer(data_dir=tmp_path / "redis")
    server.start()
    backend = await Backend.connect(server.url)
    received: list[bytes] = []
    try:
        async with anyio.create_task_group() as tasks:
            await tasks.start(backend.listen, ["resp:wake"], lambda _, data: received.append(data))
            server.restart()
            # Publish until the resubscribed connection hears one (messages published while
            # it was down are lost, as the docstring says; callers keep a fallback).
            with anyio.fail_after(10):
                while not received:
                    with contextlib.suppress(BackendUnavailable):  # the server coming back
                        await backend.call("PUBLISH", "resp:wake", "after")
                    await anyio.sleep(0.05)
            assert set(received) == {b"after"}
            tasks.cancel_scope.cancel()
    finally:
        server.stop()
        await backend.aclose()


async def test_a_batch_failed_by_a_lost_connection_leaves_no_unretrieved_errors(
    standalone_server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every future of a batch fails when its connection is lost; the caller sees the first
    error, and none of the others is reported by asyncio as 'never retrieved'."""
    import gc

    connection = _connection(standalone_server)
    try:
        (client_id,) = await connection.execute([("CLIENT", "ID")])
        killer = redis.asyncio.Redis.from_url(standalone_server.url)
        batch = asyncio.ensure_future(  # a blocking pop holds the connection, not the server
            connection.execute([("BLPOP", "nothing-here", "2"), ("PING",), ("PING",)])
        )
        await anyio.sleep(0.1)
        await killer.execute_command("CLIENT", "KILL", "ID", client_id)
        await killer.aclose()
        with pytest.raises(redis_errors.ConnectionError):
            await batch
        del batch
        gc.collect()
        await anyio.sleep(0.05)
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    finally:
        await connection.aclose()


async def test_a_cancelled_caller_s_batch_failed_later_leaves_no_unretrieved_errors(
    standalone_server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller cancelled while it awaits its batch's first reply leaves the rest of the batch
    pending; when the connection then closes, their errors are nobody's news either."""
    import gc

    connection = _connection(standalone_server)
    try:
        await connection.execute([("PING",)])
        with anyio.move_on_after(0.2) as waiting:
            await connection.execute([("BLPOP", "nothing-here", "2"), ("PING",), ("PING",)])
        assert waiting.cancelled_caught
    finally:
        await connection.aclose()
    gc.collect()
    await anyio.sleep(0.05)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.parametrize(
    "message",
    [
        "NOSCRIPT No matching script. Please use EVAL.",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "LOADING Redis is loading the dataset in memory",
        "READONLY You can't write against a read only replica.",
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "WRONGPASS invalid username-password pair or user is disabled.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "BUSY Redis is busy running a script.",
        "ERR unknown command 'NOPE'",
        "ERR max number of clients reached",
        "ERR invalid password",
        "FENCED 7",
    ],
)
def test_error_replies_are_classed_as_redis_py_classes_them(message: str) -> None:
    """The connection classes error replies itself (no private redis-py parser): the same class
    and message as redis-py's own connections, so one classification serves both."""
    from redis._parsers.base import BaseParser  # (the reference, in a test only)

    ours, theirs = reply_error(message), BaseParser.parse_error(message)
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))
