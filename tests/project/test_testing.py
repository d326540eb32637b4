"""``keyserial.testing`` used the way a user's own test suite would use it (docs/testing.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import keyserial
from keyserial.testing import LocalServer, ShardKeys, free_port, running_worker
from tests import apps
from tests.helpers import ROOT


async def test_a_private_server_and_a_worker_run_a_users_op_and_go_away() -> None:
    with LocalServer() as server:
        async with (
            running_worker(
                server.url, namespace="shop", shard_count=4, apps=["tests.apps"]
            ) as worker,
            keyserial.connect(server.url, namespace="shop") as ks,
        ):
            assert worker.owned_shards == [0, 1, 2, 3]
            assert await ks.submit("cart:7", apps.append("apple"), timeout=10) == ["apple"]
            assert await ks.submit("cart:7", apps.append("pear"), timeout=10) == ["apple", "pear"]
            with redis.Redis.from_url(server.url) as inspect:
                state = inspect.hget(ShardKeys("shop", ks.shard_of("cart:7")).state, "cart:7")
            assert state is not None and b"pear" in state
        with redis.Redis.from_url(server.url) as inspect:
            leases = [ShardKeys("shop", shard).lease for shard in range(4)]
            assert inspect.exists(*leases) == 0, "the worker released its leases on exit"
    assert not server.running
    with pytest.raises(redis.ConnectionError), redis.Redis.from_url(server.url) as gone:
        gone.ping()


async def test_a_worker_whose_shards_another_worker_owns_times_out_saying_why(
    redis_url: str, namespace: str
) -> None:
    async with running_worker(redis_url, namespace, shard_count=2):
        with pytest.raises(TimeoutError, match="another worker holds their leases"):
            async with running_worker(redis_url, namespace, shard_count=2, start_timeout=0.5):
                pass


async def test_a_worker_that_cannot_start_raises_its_own_error(
    redis_url: str, namespace: str
) -> None:
    async with running_worker(redis_url, namespace, shard_count=2):
        pass  # records the namespace's shard count
    with pytest.raises(keyserial.ConfigError):
        async with running_worker(redis_url, namespace, shard_count=3):
            pass


@pytest.mark.parametrize("shards", [[1.5], [True], ["1"], [], [4]])
async def test_a_worker_given_shards_that_are_not_shard_numbers_refuses_them(
    redis_url: str, namespace: str, shards: list[object]
) -> None:
    """``[True]`` and ``[1.5]`` once served shards named "True" and "1.5" (leases and all),
    while shard 1 had no worker; ``[]`` served nothing until the start timed out."""
    with pytest.raises(keyserial.ConfigError, match="shards"):
        async with running_worker(redis_url, namespace, shard_count=4, shards=shards):  # type: ignore[arg-type]
            pass


async def test_the_blocks_own_error_reaches_the_caller_as_itself(
    redis_url: str, namespace: str
) -> None:
    with pytest.raises(LookupError, match="raised in the block"):
        async with running_worker(redis_url, namespace, shard_count=1):
            raise LookupError("raised in the block")


@pytest.mark.slow
def test_the_guide_s_example_suite_passes_as_written(tmp_path: Path) -> None:
    """docs/testing.md's files (each block starting ``# <path>``), run by pytest as a user's
    project would run them."""
    guide = (ROOT / "docs" / "testing.md").read_text()
    files = re.findall(r"```(?:python|toml)\n# ([\w/.]+)\n(.*?)```", guide, re.S)
    assert {name for name, _ in files} == {
        "myapp/ops.py",
        "conftest.py",
        "pyproject.toml",
        "test_stock.py",
    }
    for name, text in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout, result.stdout


def test_a_local_server_entered_twice_refuses_and_leaves_no_process() -> None:
    server = LocalServer()
    with server:
        first = server.process
        with pytest.raises(RuntimeError, match="runs already"), server:
            pass
        assert server.process is first and server.running
    assert not server.running and not server.data_dir.exists()


def test_a_local_server_that_cannot_start_leaves_no_directory(tmp_path: Path) -> None:
    server = LocalServer(binary=str(tmp_path))  # a directory: not a program
    with pytest.raises(RuntimeError, match="cannot run"), server:
        pass
    assert not server.data_dir.exists()


def test_a_free_port_below_the_system_s_ephemeral_range_is_found() -> None:
    assert free_port(20000) <= 20000
