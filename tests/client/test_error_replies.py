"""What Redis answers besides a result or a lost connection: a BUSY script, refused
credentials. Each is classified once, at the boundary: transient refusals are waited out like an
outage, refused credentials are a clear error, and no background task dies of either."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio

import keyserial
from keyserial import BackendUnavailable, ConfigError, SubmitTimeout
from keyserial._backend.backend import Backend
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests.helpers import WorkerProcess, eventually, wait_for_log


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
            0,
            int(seconds * 1_000_000),
        )
    finally:
        client.close()


@pytest.mark.slow
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
        async with (
            running_worker(url, namespace, shard_count=4, lease_ttl=4.0, idle_poll=0.2) as worker,
            keyserial.connect(url, shards=4, namespace=namespace, idle_poll=0.2) as ks,
        ):
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
    caplog.set_level(logging.WARNING, logger="keyserial")
    with LocalServer() as server:
        async with running_worker(server.url, namespace, shard_count=2, lease_ttl=0.5):
            admin = redis.Redis.from_url(server.url)
            admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            admin.close()
            with anyio.fail_after(10):
                while not any(
                    "cannot renew or acquire leases" in record.getMessage()
                    for record in caplog.records
                ):
                    await anyio.sleep(0.05)
    warning = next(
        record.getMessage()
        for record in caplog.records
        if "cannot renew or acquire leases" in record.getMessage()
    )
    assert warning.endswith("no reply within the lease TTL (0.5s)"), warning


def _slow_to_load(server: LocalServer, keys: int, per_key_us: int) -> None:
    """Give the server ``keys`` filler keys in its AOF's base (an RDB, loaded key by key) and
    make every later start load each one ``per_key_us`` µs slowly, answering -LOADING to
    commands meanwhile (it serves clients every 1 KiB of loading)."""
    client = redis.Redis.from_url(server.url)
    try:
        client.mset({f"filler:{n}": "x" for n in range(keys)})
        client.bgrewriteaof()
        deadline = time.monotonic() + 10
        while any(
            client.info("persistence")[flag]
            for flag in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
        ):
            assert time.monotonic() < deadline, "the AOF rewrite did not finish"
            time.sleep(0.02)
    finally:
        client.close()
    server.extra_args += [
        "--key-load-delay",
        str(per_key_us),
        "--loading-process-events-interval-bytes",
        "1024",
    ]


async def _deposit_until_acknowledged(ks: keyserial.Client, key: str, op_id: str) -> None:
    """One deposit, resubmitted under its op id until acknowledged (so it applies once)."""
    while True:
        try:
            await ks.submit(key, deposit(1), op_id=op_id, timeout=20)
            return
        except BackendUnavailable:  # Redis down: same op id again, a moment later
            await anyio.sleep(0.05)
        except SubmitTimeout:
            continue


@pytest.mark.slow
async def test_a_restart_that_loads_slowly_loses_and_repeats_nothing(
    tmp_path: Path, namespace: str, start: Callable[..., WorkerProcess]
) -> None:
    """A Redis restart whose dataset takes seconds to load (every command answered -LOADING
    meanwhile), while a worker serves and clients submit: every submit completes (none hangs,
    none is lost), none applies twice, the running worker keeps running, and a worker started
    while Redis loads waits for it instead of exiting."""
    server = LocalServer(appendfsync="always", data_dir=tmp_path / "redis")
    server.start()
    try:
        _slow_to_load(server, keys=2000, per_key_us=1000)  # about 2 s of loading
        running = start(server.url, namespace)
        keys = [f"acct:{n}" for n in range(4)]
        acknowledged = dict.fromkeys(keys, 0)
        loading_seen = False
        stop = anyio.Event()

        async def deposit_until_stopped(key: str) -> None:
            while not stop.is_set():
                await _deposit_until_acknowledged(ks, key, f"{key}:{acknowledged[key]}")
                acknowledged[key] += 1

        with anyio.fail_after(60):
            async with keyserial.connect(server.url, shards=4, namespace=namespace) as ks:
                async with anyio.create_task_group() as group:
                    for key in keys:
                        group.start_soon(deposit_until_stopped, key)
                    await eventually(lambda: all(acknowledged.values()))
                    server.kill()
                    started_while_down = start(server.url, namespace)
                    await wait_for_log(started_while_down, "retrying")  # it runs, and waits
                    server.start()  # returns once INFO answers: while the dataset loads
                    admin = redis.asyncio.Redis.from_url(server.url)
                    while int((await admin.info("persistence"))["loading"]):
                        loading_seen = True
                        await anyio.sleep(0.02)
                    refused = (await admin.info("errorstats")).get("errorstat_LOADING", {})
                    await admin.aclose()
                    before = sum(acknowledged.values())
                    await eventually(lambda: sum(acknowledged.values()) > before + 8)
                    stop.set()
                balances = {key: await ks.read(key) for key in keys}
        assert loading_seen, "the restart loaded too fast to test anything"
        assert refused.get("count", 0) > 10, "nobody was refused with -LOADING"
        assert balances == acknowledged, "an op was lost or applied twice"
        assert running.process.poll() is None, running.log()[-3000:]
        late = started_while_down.log()
        assert started_while_down.process.poll() is None, late[-3000:]
        assert "is loading the dataset" in late, late[-3000:]  # (it waited it out)
    finally:
        server.stop()


@pytest.mark.parametrize("via", ["url", "callers_client"])
async def test_a_busy_script_costs_no_subscription(
    busy_server: LocalServer, via: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A health check's PING answered -BUSY is an answer: the subscription is kept (not
    dropped and made again, with a warning, every health interval of the spell), on keyserial's
    own connection and on redis-py's."""
    caplog.set_level(logging.WARNING, "keyserial")
    client = redis.asyncio.Redis.from_url(busy_server.url)
    backend = await Backend.connect(busy_server.url if via == "url" else client)
    received: list[bytes] = []
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                await tasks.start(
                    functools.partial(
                        backend.listen,
                        ["busy:wake"],
                        lambda _, data: received.append(data),
                        health_interval=0.3,
                    )
                )  # (the server says BUSY after 100 ms)
                await anyio.to_thread.run_sync(run_busy_script, busy_server.url, 1.0)
                while not received:
                    await client.publish("busy:wake", "after")
                    await anyio.sleep(0.05)
                tasks.cancel_scope.cancel()
    finally:
        await backend.aclose()
        await client.aclose()
    assert not [r.getMessage() for r in caplog.records if "subscription" in r.getMessage()]
