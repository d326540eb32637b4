"""``keyserial dev``: a private server and a supervised worker for every shard.

The worker runs as a child process (``keyserial worker``), so an op that kills its worker (a
crash, ``os._exit``, an out-of-memory kill) does not take ``dev`` down: ``dev`` says how the
worker ended and starts another, which takes the shards over as a standby would (a poison op is
dead-lettered after ``max_strikes`` such deaths). The server and the worker die with ``dev``,
even on kill -9 of ``dev`` (Linux: the parent-death signal). Both run in process groups of
their own, so a Ctrl-C in the terminal reaches ``dev`` alone, which drains the worker first and
stops the server last.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import anyio

from .._backend.backend import Backend
from .._local.process import die_with_parent
from .._local.server import LocalServer
from .._operator.namespace import layout_in_use
from .._operator.status import Owner
from .._settings import Settings
from ..errors import ConfigError, KeyserialError, redact

#: Seconds before a worker that died is started again; doubled, up to the cap, while it keeps
#: dying within :data:`_STABLE` seconds of its start.
_RESTART_DELAY = 0.5
_RESTART_CAP = 8.0
_STABLE = 30.0


def run_dev(args: argparse.Namespace, settings: Settings, worker_args: list[str]) -> int:
    """Serve until SIGINT or SIGTERM; ``worker_args``: the child worker's flags besides
    ``--redis``."""
    if (
        args.data_dir is not None
        and Path(args.data_dir).exists()
        and not Path(args.data_dir).is_dir()
    ):
        raise ConfigError(f"--data-dir {args.data_dir!r} is not a directory")
    server = LocalServer(
        port=args.port,
        data_dir=args.data_dir,
        appendfsync="always" if args.data_dir else None,
        die_with_parent=True,
    )
    _start(server)
    try:
        url = redact(server.url)
        print(f"keyserial dev: {server.binary} serving {url}", flush=True)
        command = [sys.executable, "-m", "keyserial", "worker", "--redis", server.url]
        code = anyio.run(_supervise, [*command, *worker_args], server.url, settings)
    finally:
        server.stop()
        print("keyserial dev: stopped", flush=True)
    return code


def _start(server: LocalServer) -> None:
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]  # (its log's tail)
        taken = [line for line in lines if "already in use" in line]
        hint = " (is the port taken? try another --port)" if taken else ""
        raise ConfigError(
            f"cannot start {server.binary} on port {server.port}:"
            f" {(taken or lines or [''])[-1].strip()}{hint}"
        ) from exc


async def _supervise(command: list[str], url: str, settings: Settings) -> int:
    """Run the worker, and again whenever it dies, until a signal stops it (forwarded: the
    first drains it, a second stops it at once); the exit code."""
    supervisor = _Supervisor(command)
    async with anyio.create_task_group() as group:
        group.start_soon(supervisor.forward_signals)
        group.start_soon(_announce_ready, supervisor, url, settings)
        code = await supervisor.run()
        group.cancel_scope.cancel()
    return code


class _Supervisor:
    def __init__(self, command: list[str]) -> None:
        self._command = command
        self.child: subprocess.Popen[bytes] | None = None
        #: Set when a worker is started, and when it has ended (each worker anew).
        self.started = anyio.Event()
        self.ended = anyio.Event()
        self._stop = anyio.Event()

    async def run(self) -> int:
        """Supervise until stopped; 2 if the worker refused to start (a setup error, which it
        printed: a restart would only repeat it)."""
        delay = _RESTART_DELAY
        while not self._stop.is_set():
            began = anyio.current_time()
            # Forked from the main thread: the parent-death signal follows the forking thread.
            self.child = subprocess.Popen(  # noqa: ASYNC220
                self._command, preexec_fn=die_with_parent(), process_group=0
            )
            self.ended = anyio.Event()
            self.started.set()
            code = await anyio.to_thread.run_sync(self.child.wait, abandon_on_cancel=True)
            self.ended.set()
            self.started = anyio.Event()
            if self._stop.is_set():
                break
            if code == 2:
                print("keyserial dev: the worker refused to start; stopping", file=sys.stderr)
                return 2
            stable = anyio.current_time() - began > _STABLE
            delay = _RESTART_DELAY if stable else min(delay * 2, _RESTART_CAP)
            print(
                f"keyserial dev: the worker (pid {self.child.pid}) {_ended(code)};"
                f" starting another in {delay:g}s (its log above says what it ran)",
                file=sys.stderr,
                flush=True,
            )
            with anyio.move_on_after(delay):
                await self._stop.wait()
        return 0

    async def forward_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for received in signals:
                self._stop.set()
                if self.child is not None and self.child.poll() is None:
                    self.child.send_signal(received)


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def _announce_ready(supervisor: _Supervisor, url: str, settings: Settings) -> None:
    """Say once that the worker serves (it holds every shard's lease), and again after each
    restart."""
    backend = await Backend.connect(url)
    try:
        first = True
        while True:
            await supervisor.started.wait()
            child, ended = supervisor.child, supervisor.ended
            assert child is not None
            shards = await _serving(backend, settings.namespace, child)
            if shards is None:  # (it died first: the supervisor starts another)
                await anyio.sleep(0.05)
                continue
            if first:
                print(_ready_line(redact(url), settings, shards), flush=True)
                first = False
            else:
                print(f"keyserial dev: worker {child.pid} serves again", flush=True)
            await ended.wait()
    finally:
        with anyio.CancelScope(shield=True):
            await backend.aclose()


async def _serving(backend: Backend, namespace: str, child: subprocess.Popen[bytes]) -> int | None:
    """The shard count, once ``child`` holds every shard's lease; None if it ends first."""
    while child.poll() is None:
        try:
            layout = await layout_in_use(backend, namespace)
            count = layout.shards
            holders = await backend.lease_holders(layout.all_keys())  # (one round trip)
        except (KeyserialError, ConfigError):  # (no shard count recorded yet)
            holders, count = [None], 0
        if holders and all(_pid(holder) == child.pid for holder in holders):
            return count
        await anyio.sleep(0.05)
    return None


def _pid(lease: bytes | None) -> int | None:
    """The pid of a lease's holder, from the lease's value (None for a shard no worker holds)."""
    return None if lease is None else Owner.parse(lease.decode(errors="replace")).pid


def _ready_line(url: str, settings: Settings, shard_count: int) -> str:
    """What ``keyserial dev`` says once it serves: where, how to point clients at it (a
    ``connect()`` with no URL reads the variable), and how to stop."""
    return (
        f"keyserial dev: ready on {url} ({shard_count} shards, namespace"
        f" {settings.namespace!r});"
        f" in another shell: export KEYSERIAL_REDIS_URL={url} ; Ctrl-C stops"
    )
