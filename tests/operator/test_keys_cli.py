"""``keyserial call``, ``read`` and ``result`` through the real command line, against a worker:
an operator's view of one key."""

from __future__ import annotations

import json

import pytest

from keyserial.testing import running_worker
from tests.helpers import cli

# The command line as processes, one per command, against a worker.
pytestmark = pytest.mark.slow


async def test_call_read_and_result_show_one_key_s_ops_and_state(
    redis_url: str, namespace: str
) -> None:
    async with running_worker(redis_url, namespace, shard_count=2, apps=["tests.apps"]):
        assert await cli(redis_url, namespace, "call", "account:1", "deposit", "5") == (
            0,
            "5\n",
            "",
        )
        code, out, _ = await cli(
            redis_url, namespace, "call", "account:1", "deposit", "7", "--op-id", "op-7"
        )
        assert (code, out) == (0, "12\n")
        code, out, _ = await cli(
            redis_url, namespace, "call", "account:1", "deposit", "7", "--op-id", "op-7"
        )
        assert (code, out) == (0, "12\n")  # the same op id: answered, not run again
        assert (await cli(redis_url, namespace, "read", "account:1"))[:2] == (0, "12\n")
        assert (await cli(redis_url, namespace, "read", "account:2"))[:2] == (0, "null\n")
        result = await cli(redis_url, namespace, "result", "op-7", "--key", "account:1")
        assert result[:2] == (0, "12\n")

        # Arguments: JSON where they parse as JSON, text otherwise; keywords likewise.
        code, out, _ = await cli(redis_url, namespace, "call", "list:1", "append", "hello")
        assert (code, json.loads(out)) == (0, ["hello"])
        code, out, _ = await cli(
            redis_url, namespace, "call", "list:1", "append", "--kw", 'value={"n": 1}'
        )
        assert (code, json.loads(out)) == (0, ["hello", {"n": 1}])


async def test_failures_exit_1_saying_why(redis_url: str, namespace: str) -> None:
    async with running_worker(redis_url, namespace, shard_count=2):
        code, out, err = await cli(redis_url, namespace, "call", "account:3", "withdraw", "9")
        assert (code, out) == (1, "")
        assert "InsufficientFunds" in err and "less than 9" in err
        code, _, err = await cli(redis_url, namespace, "call", "account:3", "teleport")
        assert code == 1 and "UnknownOperation" in err
        code, _, err = await cli(redis_url, namespace, "result", "nope", "--key", "account:3")
        assert code == 1 and "nope" in err
        code, _, err = await cli(redis_url, namespace, "call", "account:3", "deposit", "--kw", "x")
        assert code == 2 and "NAME=ARG" in err
