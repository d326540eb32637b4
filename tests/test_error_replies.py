"""What Redis answers besides a result or a lost connection: a BUSY script, refused
credentials. Each is classified once, at the boundary: transient refusals are waited out like an
outage, refused credentials are a clear error, and no background task dies of either."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import redis

import keyserial
from keyserial import ConfigError
from keyserial._layout import ShardKeys
from keyserial._server import LocalServer
from keyserial.ledger import deposit
from tests.helpers import running_worker


@pytest.fixture
def busy_server() -> Iterator[LocalServer]:
    """A server of its own: the test makes a script run past the busy threshold on it."""
    with LocalServer() as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("busy-reply-threshold", 100)
        client.close()
        yield server


def run_busy_script(url: str, seconds: float) -> None:
    """Hold the server in one Lua script: every other command gets -BUSY meanwhile."""
    client = redis.Redis.from_url(url, socket_timeout=seconds + 10)
    try:
        client.eval(
            "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') until"
            " (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])",
            0, int(seconds * 1_000_000),
        )
    finally:
        client.close()


async def test_a_busy_script_costs_waiting_not_shards_leases_or_the_client(
    busy_server: LocalServer, namespace: str
) -> None:
    """While another client's script keeps Redis BUSY past the busy threshold, the worker's
    renewals, steps and subscriptions and the client's listener and sweep get error replies:
    afterwards the worker still owns every shard under the same epoch (it dropped none), and
    a submit made during the BUSY spell completes."""
    url = busy_server.url
    epochs = [ShardKeys(namespace, shard).epoch for shard in range(4)]
    with anyio.fail_after(60):
        async with running_worker(url, namespace, shard_count=4, lease_ttl=4.0,
                                  idle_poll=0.2) as worker, \
                keyserial.connect(url, shards=4, namespace=namespace, idle_poll=0.2) as ks:
            assert await ks.submit("acct", deposit(1), timeout=10) == 1
            inspect = redis.Redis.from_url(url)
            before = inspect.mget(epochs)
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, run_busy_script, url, 1.5)
                await anyio.sleep(0.3)  # (the script is running: commands now get BUSY)
                assert await ks.submit("acct", deposit(1), timeout=20) == 2
            assert worker.owned_shards == [0, 1, 2, 3]
            assert inspect.mget(epochs) == before, "no shard was dropped and taken again"
            assert await ks.submit("acct", deposit(1), timeout=10) == 3
            inspect.close()


async def test_refused_credentials_are_a_clear_error_not_a_retry(tmp_path: object) -> None:
    with LocalServer() as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        with pytest.raises(ConfigError, match="refused"):
            async with keyserial.connect(server.url, shards=4):
                pass


async def test_a_lease_round_with_no_reply_logs_why(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stalled server (here: CLIENT PAUSE) leaves the lease round without a reply; the
    warning says so instead of an empty reason."""
    import logging

    caplog.set_level(logging.WARNING, logger="keyserial")
    with LocalServer() as server:
        async with running_worker(server.url, namespace, shard_count=2, lease_ttl=0.5):
            admin = redis.Redis.from_url(server.url)
            admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            admin.close()
            with anyio.fail_after(10):
                while not any("cannot renew or acquire leases" in record.getMessage()
                              for record in caplog.records):
                    await anyio.sleep(0.05)
    warning = next(record.getMessage() for record in caplog.records
                   if "cannot renew or acquire leases" in record.getMessage())
    assert warning.endswith("no reply within the lease TTL (0.5s)"), warning
