"""The processes of a run: client processes (agents), keyserial workers, py-spy recorders.

Client processes live for the whole suite (a run only opens and closes its system in them), so
starting Python and importing redis is paid once, not per run. keyserial workers are started per
run, in the run's fresh namespace, as ``keyserial worker`` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import keyserial

from .config import RunSpec
from .workloads import account_key, shard_range_bounds

#: The directory that holds the ``benchmarks`` package: subprocesses import it from there.
ROOT = Path(__file__).resolve().parent.parent


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    return env


def _open_log(path: Path) -> IO[bytes]:
    """A subprocess's log file (its owner closes it)."""
    return open(path, "wb")


class AgentError(RuntimeError):
    """A client process failed; the message carries its traceback or log tail."""


class _Agent:
    def __init__(self, index: int, process: Process, log: Path) -> None:
        self.index = index
        self.process = process
        self.log = log
        assert process.stdout is not None and process.stdin is not None
        self._stdout = BufferedByteReceiveStream(process.stdout)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send((json.dumps(message) + "\n").encode())

    async def receive(self) -> dict[str, Any]:
        try:
            line = await self._stdout.receive_until(b"\n", 1 << 28)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise AgentError(f"client process {self.index} exited: {self.log_tail()}") from None
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise AgentError(f"client process {self.index}: {message['error']}")
        return message

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"


class AgentPool:
    """``size`` client processes, started once; a run drives the first ``spec.clients``."""

    def __init__(self, size: int, log_dir: Path) -> None:
        self.size = size
        self.log_dir = log_dir
        self.agents: list[_Agent] = []
        self._logs: list[IO[bytes]] = []

    async def __aenter__(self) -> AgentPool:
        for index in range(self.size):
            log_path = self.log_dir / f"client-{index}.log"
            log = _open_log(log_path)
            self._logs.append(log)
            process = await anyio.open_process(
                [sys.executable, "-m", "benchmarks.agent", str(index)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=subprocess_env(),
                cwd=ROOT,
            )
            self.agents.append(_Agent(index, process, log_path))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            for agent in self.agents:
                with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await agent.send({"cmd": "exit"})
            for agent in self.agents:
                await _stop(agent.process, timeout=5)
        for log in self._logs:
            log.close()

    def pids(self, count: int) -> list[int]:
        return [agent.process.pid for agent in self.agents[:count]]

    async def prepare(self, spec: RunSpec, timeout: float = 60) -> list[_Agent]:
        """Open the spec's system in ``spec.clients`` processes; return them once all are ready."""
        chosen = self.agents[: spec.clients]
        with anyio.fail_after(timeout):
            for agent in chosen:
                await agent.send({"cmd": "prepare", "spec": spec.to_json()})
            for agent in chosen:
                await agent.receive()
        return chosen


async def run_agents(
    agents: Sequence[_Agent], go: dict[str, Any], paths: Sequence[Path], timeout: float
) -> list[dict[str, Any]]:
    """Send ``go`` (each with its latency file), then gather every agent's tally."""
    for agent, path in zip(agents, paths, strict=True):
        await agent.send({"cmd": "go", **go, "latency_path": str(path)})
    with anyio.fail_after(timeout):
        return [await agent.receive() for agent in agents]


async def _stop(process: Process, timeout: float) -> None:
    if process.returncode is not None:
        return
    with anyio.move_on_after(timeout):
        await process.wait()
        return
    process.kill()
    await process.wait()


def shard_range(shards: int, workers: int, index: int) -> str:
    """Worker ``index``'s share of ``shards`` (:func:`shard_range_bounds`), as ``--shards``
    takes it ("0-7")."""
    first, last = shard_range_bounds(shards, workers, index)
    return f"{first}-{last}"


class KeyserialWorkers:
    """``count`` ``keyserial worker`` processes serving every shard of the run's namespace (or,
    ``split``, each its own range of them), with the spec's ``durable_replicas``, on
    ``event_loop``."""

    def __init__(
        self,
        spec: RunSpec,
        count: int,
        log_dir: Path,
        *,
        split: bool = False,
        event_loop: str = "asyncio",
    ) -> None:
        self.spec = spec
        self.count = count
        self.split = split
        self.event_loop = event_loop
        self.log_dir = log_dir
        self.processes: list[Process] = []
        self._logs: list[IO[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    async def __aenter__(self) -> KeyserialWorkers:
        spec = self.spec
        command = [
            sys.executable, "-m", "keyserial", "worker",
            "--redis", spec.url,
            "--namespace", spec.prefix,
            "--shard-count", str(spec.shards),
            "--app", "benchmarks.ops",
            "--log-level", "WARNING",
            "--event-loop", self.event_loop,
        ]  # fmt: skip
        # Set either way: a value in the suite's own environment must not leak into a run.
        env = {**subprocess_env(), "KEYSERIAL_DURABLE_REPLICAS": str(spec.durable_replicas)}
        try:
            for index in range(self.count):
                log = _open_log(self.log_dir / f"worker-{spec.run_id}-{index}.log")
                self._logs.append(log)
                own = []
                if self.split:
                    own = ["--shards", shard_range(spec.shards, self.count, index)]
                self.processes.append(
                    await anyio.open_process(
                        command + own, stderr=log, stdout=log, env=env, cwd=ROOT
                    )
                )
            await self._wait_serving()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _wait_serving(self, timeout: float = 30) -> None:
        """Every shard answers an op (one key per shard gets a ``balance()``)."""
        spec = self.spec
        probes: dict[int, str] = {}
        n = 0
        while len(probes) < spec.shards:
            key = account_key(-1 - n)
            probes.setdefault(keyserial.shard_for(key, spec.shards), key)
            n += 1
        connect = keyserial.connect(spec.url, shards=spec.shards, namespace=spec.prefix)
        with anyio.fail_after(timeout):
            async with connect as ks, anyio.create_task_group() as group:
                for key in probes.values():
                    group.start_soon(ks.submit, key, keyserial.call("balance"))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            for process in self.processes:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
            for process in self.processes:
                await _stop(process, timeout=15)
        for log in self._logs:
            log.close()


def py_spy_available() -> bool:
    return shutil.which("py-spy") is not None


async def start_py_spy(pid: int, seconds: float, output: Path) -> Process:
    """Sample ``pid`` for ``seconds`` with py-spy into collapsed stacks (``raw``: one line per
    stack with its sample count; speedscope, inferno and flamegraph.pl read it)."""
    command = [
        "py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", "200", "--format", "raw", "--output", str(output), "--nonblocking",
    ]  # fmt: skip
    return await anyio.open_process(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
