"""G2.4: if an op raises, nothing it did to state is kept: not in Redis, not in the owner's
cache (the next op on the key sees the state as it was before the failed op)."""

from __future__ import annotations

import pytest

import keyserial
from keyserial import OperationFailed
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import keys_on_shard


@pytest.mark.parametrize("failing", [apps.write_then_fail, apps.slow_write_then_fail],
                         ids=["sync", "async"])
async def test_an_op_that_raises_after_writing_state_keeps_nothing(
    redis_url: str, namespace: str, failing: keyserial.Op[..., None]
) -> None:
    async with running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]), \
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
        assert await ks.submit("k", apps.append("first")) == ["first"]
        with pytest.raises(OperationFailed) as failed:
            await ks.submit("k", failing(["overwritten"]))
        assert (failed.value.error_type, failed.value.message) == (
            "ValueError", "failed after writing")
        assert await ks.read("k") == ["first"]
        assert await ks.submit("k", apps.append("second")) == ["first", "second"]
        assert await ks.read("k") == ["first", "second"]


@pytest.mark.parametrize("shards", [1, 4], ids=["one shard", "across shards"])
async def test_a_multi_key_op_that_raises_after_writing_keeps_nothing_on_any_key(
    redis_url: str, namespace: str, shards: int
) -> None:
    keys = keys_on_shard(0, shards, 1, "first") + keys_on_shard(shards - 1, shards, 1, "second")
    async with running_worker(redis_url, namespace, shard_count=shards, apps=["tests.apps"]), \
            keyserial.connect(redis_url, shards=shards, namespace=namespace) as ks:
        for key in keys:
            assert await ks.submit(key, apps.append("before")) == ["before"]
        with pytest.raises(OperationFailed):
            await ks.submit_many(keys, apps.write_all_then_fail(["overwritten"]))
        for key in keys:
            assert await ks.read(key) == ["before"]
            assert await ks.submit(key, apps.append("after")) == ["before", "after"]
