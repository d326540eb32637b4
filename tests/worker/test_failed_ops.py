"""G2.4: if an op raises, nothing it did to state is kept: not in Redis, not in the owner's
cache (the next op on the key sees the state as it was before the failed op)."""

from __future__ import annotations

import logging

import pytest

import keyserial
from keyserial import OperationFailed
from keyserial.ledger import withdraw
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import keys_on_shard


@pytest.mark.parametrize(
    "failing", [apps.write_then_fail, apps.slow_write_then_fail], ids=["sync", "async"]
)
async def test_an_op_that_raises_after_writing_state_keeps_nothing(
    redis_url: str, namespace: str, failing: keyserial.Op[..., None]
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", apps.append("first")) == ["first"]
        with pytest.raises(OperationFailed) as failed:
            await ks.submit("k", failing(["overwritten"]))
        assert (failed.value.error_type, failed.value.message) == (
            "ValueError",
            "failed after writing",
        )
        assert await ks.read("k") == ["first"]
        assert await ks.submit("k", apps.append("second")) == ["first", "second"]
        assert await ks.read("k") == ["first", "second"]


@pytest.mark.parametrize("shards", [1, 4], ids=["one shard", "across shards"])
async def test_a_multi_key_op_that_raises_after_writing_keeps_nothing_on_any_key(
    redis_url: str, namespace: str, shards: int
) -> None:
    keys = keys_on_shard(0, shards, 1, "first") + keys_on_shard(shards - 1, shards, 1, "second")
    async with (
        running_worker(redis_url, namespace, shard_count=shards, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=shards, namespace=namespace) as ks,
    ):
        for key in keys:
            assert await ks.submit(key, apps.append("before")) == ["before"]
        with pytest.raises(OperationFailed):
            await ks.submit_many(keys, apps.write_all_then_fail(["overwritten"]))
        for key in keys:
            assert await ks.read(key) == ["before"]
            assert await ks.submit(key, apps.append("after")) == ["before", "after"]


async def test_an_op_whose_exception_cannot_be_printed_fails_alone(
    redis_url: str, namespace: str
) -> None:
    """Its caller gets the failure, typed, and the shard's other ops go on: the worker does
    not stop on an exception whose ``str()`` raises."""
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(OperationFailed) as failed:
            await ks.submit("k", apps.raise_unprintable(), timeout=10)
        assert failed.value.error_type == "tests.apps.Unprintable"
        assert "str() of this Unprintable raised RuntimeError" in failed.value.message
        assert await ks.read("k") is None
        assert await ks.submit("k", apps.append("next"), timeout=10) == ["next"]


@pytest.mark.parametrize(
    "escaping",
    [apps.leak_cancelled, apps.raise_cancelled, apps.raise_cancelled_in_thread],
    ids=["async", "sync", "sync in a thread"],
)
async def test_an_op_that_lets_a_cancellation_out_fails_alone(
    redis_url: str, namespace: str, escaping: keyserial.Op[..., None]
) -> None:
    """A CancelledError from an op's own code (it awaited a task that was cancelled) is its
    failure: it once ended the runner and left the shard owned and silent."""
    other = keys_on_shard(0, 1, 2, "other")[1]
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(OperationFailed) as failed:
            await ks.submit("k", escaping(), timeout=10)
        assert failed.value.error_type == "RuntimeError"
        assert "CancelledError escape" in failed.value.message
        assert await ks.read("k") is None
        assert await ks.submit(other, apps.append("next"), timeout=10) == ["next"]
        assert await ks.submit("k", apps.append("after"), timeout=10) == ["after"]


async def test_a_multi_key_op_writing_a_key_it_was_not_given_fails_and_keeps_nothing(
    redis_url: str, namespace: str
) -> None:
    """The write would never commit (only the op's keys are held and written): it is refused
    where it happens, and the op's other writes go with it."""
    keys = keys_on_shard(0, 1, 2, "given")
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(OperationFailed) as failed:
            await ks.submit_many(keys, apps.write_elsewhere(), timeout=10)
        assert failed.value.error_type == "KeyError"
        assert "is not a key of this op" in failed.value.message
        assert [await ks.read(key) for key in keys] == [None, None]


async def test_a_failed_op_s_traceback_reaches_its_caller_and_the_worker_s_log(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's ``OperationFailed`` carries where the op raised on the worker (also shown
    with its own traceback, as a note), bounded in size, and stored with the outcome; the
    worker logs it with the key, op and op id. Errors an op raises on purpose carry none."""
    caplog.set_level(logging.INFO, logger="keyserial.worker")
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        for padding in (0, 20_000):
            op_id = ks.new_op_id()
            with pytest.raises(OperationFailed) as failed:
                await ks.submit("account:k", apps.fail_deep(3, padding), op_id=op_id)
            remote = failed.value.remote_traceback
            assert remote is not None and remote.startswith("Traceback (most recent call last)")
            assert "in fail_deep" in remote and len(remote) <= 8192
            assert any(remote.rstrip() in note for note in failed.value.__notes__)
            with pytest.raises(OperationFailed) as again:
                await ks.result(op_id, key="account:k")
            assert again.value.remote_traceback == remote
            if not padding:
                assert remote.endswith("RuntimeError: boom at the bottom of account:k\n")
        assert "characters cut" in remote  # (the long one)
        with pytest.raises(keyserial.InsufficientFunds) as refused:
            await ks.submit("account:k", withdraw(5))
        assert refused.value.remote_traceback is None
    logged = [record for record in caplog.records if "failed: RuntimeError" in record.getMessage()]
    assert logged and "'account:k'" in logged[0].getMessage()
    assert "RuntimeError: boom" in logged[0].getMessage() and op_id[:8] in caplog.text
