"""The client at its edges: cancelled submits, recovery hints of multi-key ops, default
timeouts that say why, and a client used from an event loop it was not opened on."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import (
    BackendUnavailable,
    InsufficientFunds,
    KeyserialError,
    ResultNotFound,
    Settings,
    SubmitTimeout,
)
from keyserial.ledger import balance, deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests import apps
from tests.entries import inbox_entries


async def _op_ids_sent(url: str, namespace: str, shard: int) -> list[str]:
    """The op ids of the shard's entries, in order: those its owner moved into the stream, then
    those still waiting in its inbox, as pushed."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        entries = [fields for _, fields in await client.xrange(ShardKeys(namespace, shard).stream)]
        entries += await inbox_entries(client, namespace, shard)
    finally:
        await client.aclose()
    return [envelope["id"] for fields in entries for envelope in json.loads(fields[b"ops"])]


@asynccontextmanager
async def _served(
    url: str, namespace: str, shard_count: int = 1
) -> AsyncIterator[keyserial.Client]:
    """A worker owning the namespace's shards, and a client of it."""
    async with (
        running_worker(url, namespace, shard_count=shard_count),
        keyserial.connect(url, namespace=namespace) as ks,
    ):
        yield ks


async def _stored_result(ks: keyserial.Client, op_id: str, key: Any) -> Any:
    """Poll until the op's outcome is stored, then return it."""
    with anyio.fail_after(10):
        while True:
            try:
                return await ks.result(op_id, key=key)
            except ResultNotFound:
                await anyio.sleep(0.02)


def _keys_on_descending_shards(ks: keyserial.Client) -> tuple[str, str]:
    """A source key whose shard is above the target's: the op's home is the target's shard."""
    source = next(f"src:{n}" for n in range(100) if ks.shard_of(f"src:{n}") > 0)
    target = next(f"dst:{n}" for n in range(100) if ks.shard_of(f"dst:{n}") < ks.shard_of(source))
    return source, target


async def test_a_submit_already_cancelled_when_called_is_never_appended(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:
        with anyio.move_on_after(0):
            await ks.submit("account:1", deposit(5), op_id="cancelled-early")
        with pytest.raises(SubmitTimeout):  # pushed after the cancelled one, if that was sent
            await ks.submit("account:1", deposit(7), timeout=0.3, op_id="sent-later")
        shard = ks.shard_of("account:1")
        assert await _op_ids_sent(redis_url, namespace, shard) == ["sent-later"]


@pytest.mark.slow
async def test_a_submit_cancelled_while_queued_behind_an_append_is_never_appended(
    redis_url: str, namespace: str
) -> None:
    """The server holds writes for a moment (CLIENT PAUSE), so one append stays in flight while
    the next submit waits in the client's queue, and is cancelled there."""
    admin = redis.asyncio.Redis.from_url(redis_url)
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:

        async def in_flight() -> None:
            with pytest.raises(SubmitTimeout):  # no worker: it stays unanswered
                await ks.submit("account:1", deposit(1), timeout=1.5, op_id="in-flight")

        async def blocked_clients() -> int:
            return int((await admin.info("clients"))["blocked_clients"])

        blocked_before = await blocked_clients()
        await admin.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(in_flight)
                with anyio.fail_after(0.8):  # until the server holds the first append
                    while await blocked_clients() == blocked_before:
                        await anyio.sleep(0.01)
                with anyio.move_on_after(0.1) as scope:
                    await ks.submit("account:1", deposit(5), op_id="withdrawn")
                assert scope.cancelled_caught
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            await admin.aclose()
        with pytest.raises(SubmitTimeout):
            await ks.submit("account:1", deposit(7), timeout=0.3, op_id="sent-later")
        shard = ks.shard_of("account:1")
        assert await _op_ids_sent(redis_url, namespace, shard) == ["in-flight", "sent-later"]


async def test_a_submit_cancelled_after_it_is_sent_applies_and_is_found_by_its_op_id(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
    ):
        op_id = ks.new_op_id()
        shard = ks.shard_of("counter:1")

        async def cancel_once_sent(scope: anyio.CancelScope) -> None:
            while op_id not in await _op_ids_sent(redis_url, namespace, shard):
                await anyio.sleep(0.01)
            scope.cancel()

        with anyio.move_on_after(10) as scope:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(cancel_once_sent, scope)
                await ks.submit("counter:1", apps.slow_increment(0.5), op_id=op_id)
        assert scope.cancelled_caught
        assert await _stored_result(ks, op_id, "counter:1") == 1
        assert await ks.read("counter:1") == 1


async def test_new_op_ids_are_distinct_across_clients(redis_url: str, namespace: str) -> None:
    async with (
        keyserial.connect(redis_url, shards=2, namespace=namespace) as one,
        keyserial.connect(redis_url, shards=2, namespace=namespace) as two,
    ):
        ids = [one.new_op_id() for _ in range(100)] + [two.new_op_id() for _ in range(100)]
        assert len(set(ids)) == 200


async def test_an_async_client_inherited_across_a_fork_makes_no_op_id_in_the_child(
    redis_url: str, namespace: str
) -> None:
    """The op ids themselves refuse a forked process (a submit takes its id from them too):
    the child's would repeat the parent's, and answer each other's submits."""
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:
        ks.new_op_id()
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if the id is refused with the fork message
            try:
                ks.new_op_id()
            except KeyserialError as exc:
                os._exit(0 if "before a fork" in str(exc) else 1)
            os._exit(1)
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ks.new_op_id()  # the parent's client is untouched


async def test_the_timeout_hint_of_a_transfer_names_its_home_and_finds_the_result(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(redis_url, shards=4, namespace=namespace) as ks:
        source, target = _keys_on_descending_shards(ks)
        async with running_worker(redis_url, namespace, shard_count=4):
            await ks.submit(source, deposit(50))
        with pytest.raises(SubmitTimeout) as caught:  # no worker now: the reply times out
            await ks.transfer(source, target, 20, timeout=0.3)
        error = caught.value
        assert error.keys == (source, target)
        assert f"ks.result({error.op_id!r}, key={[source, target]!r})" in str(error)
        async with running_worker(redis_url, namespace, shard_count=4):
            assert await _stored_result(ks, error.op_id, error.keys) == {source: 30, target: 20}
            with pytest.raises(ResultNotFound):  # where the first key alone would have looked
                await ks.result(error.op_id, key=source)


async def test_a_failed_transfer_carries_all_its_keys_for_fetching_its_outcome(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=4),
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
    ):
        source, target = _keys_on_descending_shards(ks)
        with pytest.raises(InsufficientFunds) as caught:
            await ks.transfer(source, target, 20)
        assert caught.value.keys == (source, target) and caught.value.key == source
        with pytest.raises(InsufficientFunds):
            await ks.result(str(caught.value.op_id), key=caught.value.keys)


async def test_a_submit_without_a_timeout_gives_up_naming_the_shard_no_worker_holds(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(
        redis_url, shards=8, namespace=namespace, submit_timeout=0.3
    ) as ks:
        shard = ks.shard_of("account:9")
        with pytest.raises(SubmitTimeout) as caught:
            await ks.submit("account:9", deposit(1))
        assert f"no worker holds shard {shard} of namespace {namespace!r}" in str(caught.value)
        assert caught.value.vacant == (shard,) and caught.value.timeout == 0.3


async def test_a_timeout_on_a_served_shard_does_not_blame_the_workers(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
    ):
        with pytest.raises(SubmitTimeout) as caught:
            await ks.submit("counter:2", apps.slow_increment(1.0), timeout=0.2)
        assert caught.value.vacant == () and "no worker" not in str(caught.value)


def test_submits_wait_30_s_at_most_unless_configured() -> None:
    assert Settings().submit_timeout == 30.0


async def test_a_client_used_from_another_event_loop_raises_at_once(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=2),
        keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
    ):

        async def submit_elsewhere() -> Any:
            return await ks.submit("account:2", deposit(3), timeout=5)

        with anyio.fail_after(3):
            with pytest.raises(KeyserialError, match="opened on another event loop") as caught:
                await anyio.to_thread.run_sync(asyncio.run, submit_elsewhere())
        assert not isinstance(caught.value, SubmitTimeout)
        assert await ks.submit("account:2", balance()) == 0  # nothing was appended


@pytest.mark.slow
async def test_a_transfer_that_cannot_reach_redis_carries_all_its_keys(
    durable_server: LocalServer, namespace: str
) -> None:
    async with keyserial.connect(durable_server.url, shards=4, namespace=namespace) as ks:
        source, target = _keys_on_descending_shards(ks)
        durable_server.stop()
        with pytest.raises(BackendUnavailable) as caught:
            await ks.transfer(source, target, 1, timeout=10)
        assert caught.value.keys == (source, target) and caught.value.op_id


async def test_an_infinite_timeout_outwaits_the_default_one(redis_url: str, namespace: str) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=2, namespace=namespace, submit_timeout=0.1) as ks,
    ):
        assert await ks.submit("counter:3", apps.slow_increment(0.4), timeout=math.inf) == 1


async def test_closing_the_client_settles_the_submits_other_tasks_wait_on(
    redis_url: str, namespace: str
) -> None:
    """No worker, so every op waits (without a timeout). The client is closed while one op is
    appended, one append is held by the server (CLIENT PAUSE) and one op waits unsent behind
    it: each submit, in a task of its own outside the client's block, fails at once saying
    whether the op may still apply, and the unsent one is never appended."""
    admin = redis.asyncio.Redis.from_url(redis_url)
    errors: dict[str, KeyserialError] = {}

    async def submit(ks: keyserial.Client, op_id: str, *, task_status: Any) -> None:
        task_status.started()  # (the submit is queued before the starter resumes)
        try:
            await ks.submit("account:1", deposit(1), timeout=math.inf, op_id=op_id)
        except KeyserialError as exc:
            errors[op_id] = exc

    async def blocked_clients() -> int:
        return int((await admin.info("clients"))["blocked_clients"])

    try:
        with anyio.fail_after(10):
            async with (
                anyio.create_task_group() as tasks,
                keyserial.connect(redis_url, shards=2, namespace=namespace) as ks,
            ):
                shard = ks.shard_of("account:1")
                await tasks.start(submit, ks, "appended")
                while "appended" not in await _op_ids_sent(redis_url, namespace, shard):
                    await anyio.sleep(0.01)
                blocked_before = await blocked_clients()
                await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
                await tasks.start(submit, ks, "in-flight")
                while await blocked_clients() == blocked_before:
                    await anyio.sleep(0.01)
                await tasks.start(submit, ks, "queued")
            # Closed here: the three submits end now, not at some timeout.
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
    assert set(errors) == {"appended", "in-flight", "queued"}
    for op_id in ("appended", "in-flight"):
        assert "may still apply" in str(errors[op_id]), errors[op_id]
        assert f"ks.result({op_id!r}, key='account:1')" in str(errors[op_id])
    assert "never appended" in str(errors["queued"]), errors["queued"]
    assert "queued" not in await _op_ids_sent(redis_url, namespace, shard)
    await admin.aclose()


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        ("1", TypeError),
        (True, TypeError),
        (math.nan, ValueError),
        (0, ValueError),
        (-1, ValueError),
    ],
)
async def test_a_timeout_that_is_not_positive_seconds_is_refused_and_nothing_is_sent(
    standalone_server: LocalServer, namespace: str, timeout: Any, error: type[Exception]
) -> None:
    """Checked before the op is queued: a caller told the submit failed must be able to trust
    that nothing applies (``NaN`` would never expire, ``"1"`` failed after queueing)."""
    url = standalone_server.url
    async with _served(url, namespace) as ks:
        with pytest.raises(error, match="timeout"):
            await ks.submit("acct", deposit(5), timeout=timeout, op_id="checked")
        assert await ks.submit("acct", balance()) == 0  # (committed after anything before it)
        assert "checked" not in await _op_ids_sent(url, namespace, 0)
        with pytest.raises(ResultNotFound):
            await ks.result("checked", key="acct")


async def test_a_client_is_entered_once_and_stays_usable(
    standalone_server: LocalServer, namespace: str
) -> None:
    async with _served(standalone_server.url, namespace) as ks:
        with pytest.raises(KeyserialError, match="entered once"):
            async with ks:
                pass
        assert await ks.submit("acct", deposit(2)) == 2
    with pytest.raises(KeyserialError, match="entered once"):
        async with ks:  # (closed: a client is not opened again)
            pass


async def test_keys_and_op_ids_of_reads_and_lookups_are_checked(
    standalone_server: LocalServer, namespace: str
) -> None:
    async with _served(standalone_server.url, namespace, shard_count=2) as ks:
        for key in (None, 5, ""):
            with pytest.raises(TypeError, match="key must be a non-empty string"):
                await ks.read(key)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unpaired surrogate"):
            await ks.submit("a\ud800", deposit(1))
        for call in (keyserial.Call(5), keyserial.Call("deposit", 5)):  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="expected a keyserial Call"):
                await ks.submit("acct", call)
        for op_id in (None, "", "a\ud800"):
            with pytest.raises(ValueError, match="op_id must be"):
                await ks.result(op_id, key="acct")  # type: ignore[arg-type]
        for keys in ({"a", "b"}, (key for key in "ab"), None, "ab"):
            with pytest.raises(TypeError, match="keys must be a list"):
                await ks.submit_many(keys, apps.fences())  # type: ignore[arg-type]


async def test_an_argument_nested_too_deeply_is_refused_naming_it(
    standalone_server: LocalServer, namespace: str
) -> None:
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    async with keyserial.connect(standalone_server.url, namespace=namespace, shards=1) as ks:
        with pytest.raises(ValueError, match=r"op 'deposit': argument 0 \(list"):
            await ks.submit("acct", deposit(nested))  # type: ignore[arg-type]


async def test_a_database_the_server_does_not_have_is_a_config_error(
    standalone_server: LocalServer,
) -> None:
    url = standalone_server.url.rsplit("/", 1)[0] + "/99"
    with pytest.raises(keyserial.ConfigError, match="refused the connection: DB index"):
        async with keyserial.connect(url, shards=1):
            pass
