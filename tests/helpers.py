"""Helpers for tests: workers in-process and as real processes, and Redis inspection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import redis

import keyserial
from keyserial import (
    BackendUnavailable,
    InsufficientFunds,
    Settings,
    SubmitTimeout,
    Worker,
    shard_for,
)
from keyserial._layout import ShardKeys
from tests import apps

ROOT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def running_worker(
    url: str, namespace: str, *, shards: str | Sequence[int] | None = None,
    apps: Sequence[str] = (), shard_count: int | None = None, **settings: Any,
) -> AsyncIterator[Worker]:
    """An in-process worker that owns its shards for the duration of the block."""
    worker = Worker(url, shards=shards, apps=apps,
                    settings=Settings(namespace=namespace, shard_count=shard_count, **settings))
    task_group = anyio.create_task_group()
    await task_group.__aenter__()
    try:
        task_group.start_soon(worker.run)
        with anyio.fail_after(10):
            while not worker.shards or len(worker.owned_shards) < len(worker.shards):
                await anyio.sleep(0.01)
        yield worker
    finally:
        # The body's own error is not handed to the task group, so it is not wrapped in a group.
        worker.stop()
        await task_group.__aexit__(None, None, None)


class WorkerProcess:
    """``keyserial worker`` as a real OS process, for kill -9, SIGSTOP and SIGTERM tests."""

    def __init__(self, url: str, namespace: str, *, shards: str = "0-3", shard_count: int = 4,
                 lease_ttl: float = 1.0, apps: Sequence[str] = ("tests.apps",),
                 log_path: Path | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "keyserial", "worker", "--redis", url,
                "--namespace", namespace, "--shards", shards, "--shard-count", str(shard_count),
                "--lease-ttl", str(lease_ttl), "--log-level", "INFO", *extra_args]
        for app in apps:
            args += ["--app", app]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # ``env``: variables added to this process's (LD_PRELOAD of libfaketime: a skewed clock).
        self.process = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=self._log,
                                        env={**os.environ, **env} if env else None)
        self.pid = self.process.pid

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def terminate(self, timeout: float = 15) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def close(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        self.kill()
        if hasattr(self._log, "close"):
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""


def lease_holder(url: str, namespace: str, shard: int) -> str | None:
    """Token of the worker that holds the shard's lease (``host:pid:nonce``), or None."""
    client = redis.Redis.from_url(url)
    try:
        value = client.get(ShardKeys(namespace, shard).lease)
        return value.decode() if value else None
    finally:
        client.close()


def holder_pid(url: str, namespace: str, shard: int) -> int | None:
    holder = lease_holder(url, namespace, shard)
    return int(holder.split(":")[1]) if holder else None


async def eventually(check: Callable[[], Any], *, timeout: float = 10, interval: float = 0.02,
                     message: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value (the value is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not reached within {timeout}s")
        await anyio.sleep(interval)


async def stored_outcome(ks: keyserial.Client, op_id: str, key: str | list[str], *,
                         timeout: float = 10) -> Any:
    """The op's stored outcome once there is one (its value; its error raised), polled with
    ``ks.result``: never by resubmitting, which would hide an op that was lost."""
    with anyio.fail_after(timeout):
        while True:
            try:
                return await ks.result(op_id, key=key)
            except keyserial.ResultNotFound:
                await anyio.sleep(0.02)


def free_closed_port() -> int:
    """A port nothing listens on."""
    from keyserial._server import free_port

    return free_port()


def keys_on_shard(shard: int, shard_count: int, count: int, prefix: str = "key") -> list[str]:
    """``count`` resource keys that route to ``shard``."""
    keys: list[str] = []
    n = 0
    while len(keys) < count:
        key = f"{prefix}:{n}"
        if shard_for(key, shard_count) == shard:
            keys.append(key)
        n += 1
    return keys


async def wait_for_log(worker: WorkerProcess, text: str, *, timeout: float = 10) -> None:
    """Wait until the worker's log file contains ``text``."""
    await eventually(lambda: text in worker.log(), timeout=timeout,
                     message=f"{text!r} in the log of worker {worker.pid}")


@contextmanager
def worker_processes(directory: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """A factory of :class:`WorkerProcess` logging to ``directory``; every process it started is
    killed on exit, and their logs are printed (pytest shows them when the test failed)."""
    started: list[WorkerProcess] = []

    def start(url: str, namespace: str, **options: Any) -> WorkerProcess:
        worker = WorkerProcess(url, namespace,
                               log_path=directory / f"worker-{len(started)}.log", **options)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.close()
            print(f"----- log of worker {worker.pid} (exit code {worker.process.returncode}) -----")
            print(worker.log()[-8000:])


async def pay_until_settled(ks: keyserial.Client, op_id: str, keys: list[str],
                            amount: int, pay: Any = apps.pay) -> str:
    """Submit until the op is acknowledged ("paid" or "refused"), always under the same op id,
    so it applies at most once however often it is resubmitted. ``pay``: ``apps.pay`` (async:
    every cross-shard op takes a task) or ``apps.pay_now`` (sync: idle keys take none)."""
    while True:
        try:
            await ks.submit_many(keys, pay(amount), op_id=op_id, timeout=20)
        except InsufficientFunds:
            return "refused"
        except SubmitTimeout:
            continue
        except BackendUnavailable:  # Redis restarting: same op id again, a moment later
            await anyio.sleep(0.1)
            continue
        return "paid"


def check_bank(states: dict[str, Any], plans: list[tuple[str, list[str], int]],
               outcomes: dict[str, str], opening: int) -> None:
    """Money conserved, no negative balance, every account's op log is exactly the paid ops
    that touched it (each once), and its balance is what those ops imply."""
    for account, state in states.items():
        logged = Counter(state["ops"])
        assert max(logged.values(), default=1) == 1, f"{account}: an op applied twice"
        paid_here = {op_id for op_id, keys, _ in plans
                     if account in keys and outcomes[op_id] == "paid"}
        assert set(logged) == paid_here, (account, set(logged) ^ paid_here)
    balances = {account: state["balance"] for account, state in states.items()}
    assert sum(balances.values()) == opening * len(states)
    assert min(balances.values()) >= 0
    expected = dict.fromkeys(states, opening)
    for op_id, keys, amount in plans:
        if outcomes[op_id] == "paid":
            expected[keys[0]] -= amount * (len(keys) - 1)
            for key in keys[1:]:
                expected[key] += amount
    assert balances == expected
