"""The seed-004 e-mail recorded in a real private PostgreSQL (``workers/mail_pg.py``), guarded by
the key's fencing token: a worker frozen past its lease that wakes up cannot record a second
send. Skips, saying why, where the PostgreSQL server binaries are missing."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from typing import Any

import anyio
import asyncpg
import pytest

import keyserial
from keyserial.testing import LocalServer, running_worker
from tests.helpers import WorkerProcess, eventually, holder_pid, wait_for_log
from workers.mail_pg import StaleFence, create_schema, record_send, send_shipped_email_pg

SHARDS = 4


async def rows(dsn: str, query: str) -> list[Any]:
    connection = await asyncpg.connect(dsn)
    try:
        return list(await connection.fetch(query))
    finally:
        await connection.close()


@pytest.mark.slow
async def test_a_zombie_worker_that_wakes_up_is_refused_by_the_fence_and_sends_nothing(
    standalone_server: LocalServer,
    namespace: str,
    postgres_dsn: str,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MAIL_PG_DSN", postgres_dsn)  # the workers' environment
    await create_schema(postgres_dsn)
    url, order = standalone_server.url, "order:1001"
    options: dict[str, Any] = {
        "apps": ("workers.mail_pg",),
        "lease_ttl": 1.0,
        "shard_count": SHARDS,
    }
    with anyio.fail_after(90):
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            shard = ks.shard_of(order)
            zombie = start(url, namespace, **options)
            await eventually(lambda: holder_pid(url, namespace, shard) == zombie.pid, timeout=15)
            standby = start(url, namespace, **options)
            await wait_for_log(standby, "serving shards", timeout=15)

            sent: list[Any] = []

            async def submit() -> None:
                call = send_shipped_email_pg("ada@example.com", compose_seconds=1.0)
                sent.append(
                    await ks.submit(order, call, op_id=f"shipped-email:{order}", timeout=60)
                )

            async with anyio.create_task_group() as group:
                group.start_soon(submit)
                await wait_for_log(zombie, f"order {order}: composing")
                zombie.signal(signal.SIGSTOP)  # mid-op, past its lease: the standby takes over
            assert holder_pid(url, namespace, shard) == standby.pid
            ((outcome,),) = [sent]
            assert outcome["sent"] is True

            zombie.signal(signal.SIGCONT)
            await wait_for_log(zombie, "refused the write of stale fence")

    refused = re.search(
        r"refused the write of stale fence (\d+) \(PostgreSQL holds (\d+)\)", zombie.log()
    )
    assert refused is not None
    assert int(refused.group(1)) < outcome["fence"] == int(refused.group(2))
    sends = await rows(postgres_dsn, "SELECT order_key, op_id, fence FROM shipped_emails")
    assert [tuple(row) for row in sends] == [(order, f"shipped-email:{order}", outcome["fence"])]
    fences = await rows(postgres_dsn, "SELECT key, fence FROM keyserial_fences")
    assert [tuple(row) for row in fences] == [(order, outcome["fence"])]


@pytest.mark.slow
async def test_ops_with_distinct_ids_record_one_send_per_order(
    redis_url: str,
    namespace: str,
    postgres_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MAIL_PG_DSN", postgres_dsn)  # this process's worker
    await create_schema(postgres_dsn)
    outcomes: list[Any] = []
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["workers.mail_pg"]),
        keyserial.connect(redis_url, namespace=namespace) as ks,
        anyio.create_task_group() as group,
    ):

        async def send(order: str) -> None:
            outcomes.append(
                await ks.submit(order, send_shipped_email_pg("a@example.com"), timeout=20)
            )

        for n in range(20):
            group.start_soon(send, f"order:{n % 2}")
    assert sorted(outcome["sent"] for outcome in outcomes) == [False] * 18 + [True] * 2
    sends = await rows(postgres_dsn, "SELECT order_key FROM shipped_emails ORDER BY order_key")
    assert [row["order_key"] for row in sends] == ["order:0", "order:1"]


async def test_a_write_under_an_older_fence_is_refused(postgres_dsn: str) -> None:
    await create_schema(postgres_dsn)
    connection = await asyncpg.connect(postgres_dsn)
    try:
        first = await record_send(connection, "order:7", "a@example.com", "op-new", 20)
        with pytest.raises(StaleFence) as refused:
            await record_send(connection, "order:7", "a@example.com", "op-old", 10)
        again = await record_send(connection, "order:7", "a@example.com", "op-newer", 30)
    finally:
        await connection.close()
    assert first == {"sent": True, "fence": 20}
    assert refused.value.data == {"fence": 10, "current": 20}
    assert again == {"sent": False, "fence": 30, "reason": "already sent"}
