"""``keyserial.connect_sync``: blocking calls, shared by threads, and what a fork does to it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import anyio.from_thread
import pytest
import redis

import keyserial
from keyserial import (
    BackendUnavailable,
    InsufficientFunds,
    KeyserialError,
    MalformedOperation,
    ResultNotFound,
    SubmitTimeout,
)
from keyserial.ledger import balance, deposit, withdraw
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import free_closed_port


@contextmanager
def worker_in_thread(url: str, namespace: str, **options: Any) -> Iterator[None]:
    """An in-process worker on an event loop of its own thread (the test itself blocks)."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(running_worker(url, namespace, **options)),
    ):
        yield


def test_every_call_of_the_sync_client_blocks_and_returns_the_outcome(
    redis_url: str, namespace: str
) -> None:
    with (
        worker_in_thread(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
        keyserial.connect_sync(redis_url, shards=4, namespace=namespace) as ks,
    ):
        op_id = ks.new_op_id()
        assert ks.submit("account:1", deposit(100), op_id=op_id) == 100
        assert ks.submit("account:1", withdraw(30)) == 70
        assert ks.transfer("account:1", "account:2", 20) == {"account:1": 50, "account:2": 20}
        assert ks.submit_many(["k:1", "k:2", "k:3"], apps.slow_move(0)) == ["k:1", "k:2", "k:3"]
        assert ks.result(op_id, key="account:1") == 100
        assert ks.submit("account:4", deposit(7), op_id="order-4") == 7
        assert ks.result("order-4", key="account:4", op=deposit(7)) == 7
        with pytest.raises(MalformedOperation, match="belongs to another op"):
            ks.result("order-4", key="account:4", op=deposit(99))
        assert ks.read("account:2") == 20
        assert ks.shard_count == 4 and ks.shard_of("account:1") in range(4)


def test_the_sync_client_raises_the_async_clients_error_types(
    redis_url: str, namespace: str
) -> None:
    with keyserial.connect_sync(redis_url, shards=4, namespace=namespace, submit_timeout=0.3) as ks:
        with pytest.raises(SubmitTimeout, match="no worker holds shard"):
            ks.submit("account:1", deposit(5))
        with pytest.raises(ResultNotFound):
            ks.result("never-submitted", key="account:1")
        with worker_in_thread(redis_url, namespace, shard_count=4):
            with pytest.raises(InsufficientFunds) as caught:
                ks.submit("account:3", withdraw(1))
            assert caught.value.balance == 0
    with pytest.raises(BackendUnavailable):
        keyserial.connect_sync(f"redis://127.0.0.1:{free_closed_port()}/0")


def test_one_sync_client_serves_many_threads_over_one_connection(
    redis_url: str, namespace: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    errors: list[BaseException] = []
    with (
        worker_in_thread(redis_url, namespace, shard_count=4),
        keyserial.connect_sync(redis_url, shards=4, namespace=namespace) as ks,
    ):
        sharded = bool(admin.info("cluster").get("cluster_enabled", 0))
        keys = ShardKeys(namespace, 0)
        # (The worker serves before it has subscribed: its connections are counted once it has,
        # on a cluster to both its shard channels and its classic ones.)
        deadline = time.monotonic() + 10
        while not (
            _subscribers(admin, keys.wake(sharded), sharded)
            and _subscribers(admin, keys.wake_channel, False)
        ):
            assert time.monotonic() < deadline, "the worker never subscribed to its wake-ups"
            time.sleep(0.02)
        connections = len(admin.client_list())

        def deposits(thread: int) -> None:
            try:
                for n in range(25):
                    ks.submit("account:hot", deposit(1))
                    ks.submit(f"account:{thread}:{n % 3}", deposit(2))
            except BaseException as exc:  # reported below: a thread's error is not the test's
                errors.append(exc)

        threads = [threading.Thread(target=deposits, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert ks.submit("account:hot", balance()) == 16 * 25
        assert sum(ks.read(f"account:{t}:{n}") for t in range(16) for n in range(3)) == 800
        # (On a cluster, redis-py opens a node connection per pipeline in flight: appends,
        # outcome lookups and the read of a reply signer's key go out side by side, three at
        # most.)
        extra = 2 * sharded
        assert connections <= len(admin.client_list()) <= connections + extra
        if sharded:  # (a reply channel per shard, in its slot)
            found = admin.execute_command(
                "PUBSUB", "SHARDCHANNELS", f"ks:{{{namespace}:*}}:reply:*"
            )
            assert len(found) == 4
        else:
            assert len(admin.pubsub_channels(f"ks:{namespace}:reply:*")) == 1


def _subscribers(admin: redis.Redis, channel: str, sharded: bool) -> int:
    command = "SHARDNUMSUB" if sharded else "NUMSUB"
    _, count = admin.execute_command("PUBSUB", command, channel)
    return int(count)
    admin.close()


def test_a_closed_sync_client_refuses_calls(redis_url: str, namespace: str) -> None:
    ks = keyserial.connect_sync(redis_url, shards=4, namespace=namespace)
    ks.close()
    ks.close()  # idempotent
    with pytest.raises(KeyserialError, match="closed"):
        ks.submit("account:1", deposit(1))


def _child_exit_code(pid: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not exit within {timeout}s")


def test_a_sync_client_inherited_across_a_fork_raises_in_the_child(
    redis_url: str, namespace: str
) -> None:
    with (
        worker_in_thread(redis_url, namespace, shard_count=4),
        keyserial.connect_sync(redis_url, shards=4, namespace=namespace) as ks,
    ):
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if both calls fail with the fork message
            refused: list[bool] = []
            try:
                # (An op id made here would repeat one of the parent's.)
                for attempt in (
                    ks.new_op_id,
                    partial(ks.submit, "account:1", deposit(1), timeout=5),
                ):
                    try:
                        attempt()
                    except KeyserialError as exc:
                        refused.append("before a fork" in str(exc))
            finally:
                ks.close()  # nothing to close here: it must not hang on the parent's thread
                os._exit(0 if refused == [True, True] else 1)
        assert _child_exit_code(pid) == 0
        assert ks.submit("account:1", deposit(1)) == 1  # the parent's client is untouched


def test_a_sync_client_created_after_a_fork_works_in_the_child(
    redis_url: str, namespace: str
) -> None:
    with worker_in_thread(redis_url, namespace, shard_count=4):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with keyserial.connect_sync(redis_url, shards=4, namespace=namespace) as ks:
                    code = 0 if ks.submit("account:7", deposit(7), timeout=10) == 7 else 3
            finally:
                os._exit(code)
        assert _child_exit_code(pid) == 0
