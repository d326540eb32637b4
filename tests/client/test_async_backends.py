"""The async client's API on anyio's backends: asyncio, trio, and asyncio on uvloop (which
uvicorn runs when it is installed; its transports do not derive from asyncio's classes).

Each scenario runs under ``anyio.run(..., backend=...)`` while a worker serves the namespace from
an event loop of its own thread (workers run on asyncio: uvloop's when the client does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.from_thread
import pytest

import keyserial
from keyserial import InsufficientFunds, ResultNotFound, SubmitTimeout
from keyserial.ledger import balance, deposit, withdraw
from keyserial.testing import running_worker
from tests import apps

BACKENDS = ["asyncio", "trio", "uvloop"]
Scenario = Callable[[keyserial.Client], Awaitable[None]]


def _run_options(backend: str) -> dict[str, Any]:
    """``anyio.run``'s backend and its options for one of :data:`BACKENDS`."""
    if backend == "uvloop":
        return {"backend": "asyncio", "backend_options": {"use_uvloop": True}}
    return {"backend": backend}


@contextmanager
def worker_in_thread(url: str, namespace: str, backend: str = "asyncio") -> Iterator[None]:
    options = _run_options("uvloop" if backend == "uvloop" else "asyncio")
    with (
        anyio.from_thread.start_blocking_portal(**options) as portal,
        portal.wrap_async_context_manager(
            running_worker(url, namespace, shard_count=4, apps=["tests.apps"])
        ),
    ):
        yield


def run_client(backend: str, url: str, namespace: str, scenario: Scenario, **options: Any) -> None:
    async def main() -> None:
        async with keyserial.connect(url, shards=4, namespace=namespace, **options) as ks:
            await scenario(ks)

    anyio.run(main, **_run_options(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_client_call_works_on_the_backend(
    backend: str, redis_url: str, namespace: str
) -> None:
    async def scenario(ks: keyserial.Client) -> None:
        op_id = ks.new_op_id()
        assert await ks.submit("account:1", deposit(100), op_id=op_id) == 100
        assert await ks.transfer("account:1", "account:2", 40) == {"account:1": 60, "account:2": 40}
        assert await ks.submit_many(["k:1", "k:2"], apps.slow_move(0)) == ["k:1", "k:2"]
        assert await ks.result(op_id, key="account:1") == 100
        with pytest.raises(InsufficientFunds):  # (queued behind the transfer's apply)
            await ks.submit("account:2", withdraw(41))
        assert await ks.read("account:2") == 40
        with pytest.raises(ResultNotFound):
            await ks.result("never-submitted", key="account:1")
        async with anyio.create_task_group() as task_group:  # concurrent submits
            for _ in range(50):
                task_group.start_soon(ks.submit, "account:3", deposit(1))
        assert await ks.submit("account:3", balance()) == 50

    with worker_in_thread(redis_url, namespace, backend):
        run_client(backend, redis_url, namespace, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_submit_times_out_naming_the_vacant_shard_on_the_backend(
    backend: str, redis_url: str, namespace: str
) -> None:
    async def scenario(ks: keyserial.Client) -> None:
        with pytest.raises(SubmitTimeout, match="no worker holds shard"):
            await ks.submit("account:1", deposit(1))

    run_client(backend, redis_url, namespace, scenario, submit_timeout=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_submits_on_the_backend_are_withdrawn_or_found_by_op_id(
    backend: str, redis_url: str, namespace: str
) -> None:
    async def scenario(ks: keyserial.Client) -> None:
        with anyio.move_on_after(0):  # cancelled before sending: withdrawn
            await ks.submit("counter:1", apps.slow_increment(0), op_id="never-sent")
        op_id = ks.new_op_id()
        with anyio.move_on_after(0.2):  # cancelled while the op runs: it still applies
            await ks.submit("counter:1", apps.slow_increment(0.6), op_id=op_id)
        with anyio.fail_after(10):
            while True:
                try:
                    assert await ks.result(op_id, key="counter:1") == 1
                    break
                except ResultNotFound:
                    await anyio.sleep(0.02)
        with pytest.raises(ResultNotFound):
            await ks.result("never-sent", key="counter:1")

    with worker_in_thread(redis_url, namespace, backend):
        run_client(backend, redis_url, namespace, scenario)
