"""A private Redis Cluster of several nodes on 127.0.0.1: for failover tests, the nemesis and
the benchmark's cluster runs."""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import hiredis

from .server import LocalServer, find_server_binary, free_port, node_command

_CLUSTER_SLOTS = 16384


def _command(port: int, *args: str | int, timeout: float = 1.0) -> Any:
    """One command to the node at ``port`` on a connection of its own, never retried (a paused
    node must cost one timeout).

    :raises OSError: if the node does not answer within ``timeout`` seconds.
    :raises RuntimeError: on an error reply.
    """
    reply = node_command(port, *args, timeout=timeout)
    if isinstance(reply, hiredis.ReplyError):
        raise RuntimeError(f"{' '.join(map(str, args))} on port {port}: {reply}")
    return reply


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _info(port: int, section: str, timeout: float = 1.0) -> dict[str, str]:
    """``INFO <section>`` of the node at ``port``, field by field."""
    text = _text(_command(port, "INFO", section, timeout=timeout))
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _replicas_listed(replication: dict[str, str]) -> list[dict[str, str]]:
    """The ``slaveN`` fields of ``INFO replication`` (``ip=…,port=…,state=…``), parsed."""
    return [
        dict(item.split("=", 1) for item in value.split(","))
        for name, value in replication.items()
        if name.startswith("slave") and name[5:].isdigit()
    ]


def _cluster_ports(count: int) -> list[int]:
    """``count`` distinct free ports whose bus port (port + 10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(55535)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


class LocalCluster:
    """A private Redis Cluster on 127.0.0.1: ``masters`` masters with ``replicas`` replicas each.

    Built for failover tests. The node timeout is short, so a replica replaces a dead or paused
    master within seconds. ``cluster-require-full-coverage no`` keeps the healthy masters serving
    while one slot range has no master (what a deployment wanting partial availability sets),
    and ``cluster-replica-validity-factor 0`` lets a replica take over however long it was cut
    off from its master. A node keeps its directory across :meth:`LocalServer.restart`, so a
    killed master comes back with its node id and rejoins as a replica of its successor.
    """

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1500,
        appendfsync: str | None = None,
        data_dir: str | Path | None = None,
        binary: str | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.root = Path(data_dir or tempfile.mkdtemp(prefix="keyserial-cluster-"))
        self.master_count = masters
        self.replicas = replicas
        binary = binary or find_server_binary()
        options = [
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "no",
            "--cluster-replica-validity-factor",
            "0",
            # A replica (re)joining syncs at once instead of waiting for others to join it.
            "--repl-diskless-sync-delay",
            "0",
        ]
        self._appendfsync = appendfsync
        self._binary = binary
        self._node_args = options
        self.nodes = [self._new_node(port) for port in _cluster_ports(masters * (1 + replicas))]
        step = _CLUSTER_SLOTS // masters
        #: The slot range each master was given at creation: ``(first, last)``.
        self.ranges = [
            (n * step, _CLUSTER_SLOTS - 1 if n == masters - 1 else (n + 1) * step - 1)
            for n in range(masters)
        ]
        #: Ports of nodes :meth:`pause` stopped and :meth:`resume` has not resumed.
        self.paused: set[int] = set()

    @property
    def url(self) -> str:
        """URL of a node that is running and not paused (a cluster client finds the others)."""
        for node in self.nodes:
            if node.running and node.port not in self.paused:
                return node.url
        return self.nodes[0].url

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        """Start every node, join them, give each master its range and each its replicas, and
        wait until every node sees every slot served and every replica in sync.

        :raises RuntimeError: if that does not happen in ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        try:
            for index in range(len(self.nodes)):
                self._start_node(index)
            self._create(deadline)
            self.wait_healthy(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise

    def _new_node(self, port: int) -> LocalServer:
        return LocalServer(
            port=port,
            cluster=True,
            own_slots=False,
            data_dir=self.root / f"node-{port}",
            appendfsync=self._appendfsync,
            binary=self._binary,
            extra_args=self._node_args,
        )

    def _start_node(self, index: int) -> None:
        """Start a node that has never run; on another port if another process (a client's
        outgoing connection, say) took its port between the probe and the server's bind."""
        for _ in range(5):
            try:
                self.nodes[index].start()
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc):
                    raise
            taken = {node.port for node in self.nodes}
            port = next(
                port for port in iter(lambda: _cluster_ports(1)[0], None) if port not in taken
            )
            self.nodes[index] = self._new_node(port)
        raise RuntimeError("no free port pair found for a cluster node")

    def _create(self, deadline: float) -> None:
        ports = [node.port for node in self.nodes]
        ids = [_text(_command(port, "CLUSTER", "MYID", timeout=5)) for port in ports]
        # Distinct config epochs from the start, as `redis-cli --cluster create` gives. Left to
        # collide, two nodes may keep one epoch once one becomes the other's replica; a TAKEOVER
        # by such a replica then claims its slots at an epoch no greater than its master's, and
        # the others refuse it.
        for epoch, port in enumerate(ports, start=1):
            _command(port, "CLUSTER", "SET-CONFIG-EPOCH", epoch, timeout=5)
        for port in ports[1:]:
            _command(port, "CLUSTER", "MEET", "127.0.0.1", ports[0], timeout=5)
        for port, (first, last) in zip(ports, self.ranges, strict=False):
            _command(port, "CLUSTER", "ADDSLOTS", *range(first, last + 1), timeout=5)
        known = f"cluster_known_nodes:{len(self.nodes)}"
        while not all(known in _text(_command(port, "CLUSTER", "INFO")) for port in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster nodes did not all meet")
            time.sleep(0.05)
        for number, port in enumerate(ports[self.master_count :]):
            _command(port, "CLUSTER", "REPLICATE", ids[number % self.master_count], timeout=5)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every node runs and says the cluster is ok with every slot served, and every
        master has its replicas online.

        :raises RuntimeError: if that does not happen in ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster under {self.root} did not become healthy")
            time.sleep(0.1)

    def healthy(self) -> bool:
        masters = 0
        for node in self.nodes:
            if not node.running or node.port in self.paused:
                return False
            try:
                info = _text(_command(node.port, "CLUSTER", "INFO"))
                replication = _info(node.port, "replication")
            except (RuntimeError, OSError):
                return False
            wanted = (
                "cluster_state:ok",
                f"cluster_slots_ok:{_CLUSTER_SLOTS}",
                f"cluster_known_nodes:{len(self.nodes)}",
            )
            if not all(each in info for each in wanted):
                return False
            if replication["role"] == "master":
                masters += 1
                listed = _replicas_listed(replication)
                online = [replica for replica in listed if replica.get("state") == "online"]
                if len(online) < self.replicas:
                    return False
            elif replication.get("master_link_status") != "up":
                return False
        return masters == self.master_count

    def master_of(self, slot: int, *, asking: Sequence[LocalServer] = ()) -> LocalServer | None:
        """The node serving ``slot`` as some running, unpaused node (of ``asking``, default any)
        sees it; None if none answers or it has no master."""
        for node in asking or self.nodes:
            if not node.running or node.port in self.paused:
                continue
            try:
                ranges = _command(node.port, "CLUSTER", "SLOTS")
            except (RuntimeError, OSError):
                continue
            for first, last, master, *_ in ranges:
                if first <= slot <= last:
                    return self.node_at(int(master[1]))
            return None
        return None

    def cluster_command(self, node: LocalServer, *args: str | int) -> str:
        """``CLUSTER <args>`` on ``node``, its reply as text (CLUSTER INFO, CLUSTER NODES)."""
        return _text(_command(node.port, "CLUSTER", *args, timeout=5))

    def node_at(self, port: int) -> LocalServer | None:
        return next((node for node in self.nodes if node.port == port), None)

    def pause(self, node: LocalServer) -> None:
        """SIGSTOP ``node``: to the others it stops answering, as a stalled host does."""
        node.send_signal(signal.SIGSTOP)
        self.paused.add(node.port)

    def resume(self, node: LocalServer) -> None:
        node.send_signal(signal.SIGCONT)
        self.paused.discard(node.port)

    def replicas_of(self, master: LocalServer) -> list[LocalServer]:
        """The nodes ``master`` replicates to now (as its INFO lists them)."""
        listed = _replicas_listed(_info(master.port, "replication", timeout=5))
        ports = [int(replica["port"]) for replica in listed]
        return [node for port in ports if (node := self.node_at(port)) is not None]

    def cut_off_replicas(self, master: LocalServer) -> list[LocalServer]:
        """Pause every replica of ``master`` and have it drop their links: what it writes from
        now on reaches none of them (what it had sent before would still wait in a paused
        replica's socket, and reach it as it resumes). The replicas, paused."""
        replicas = self.replicas_of(master)
        for replica in replicas:
            self.pause(replica)
        _command(master.port, "CLIENT", "KILL", "TYPE", "replica", timeout=5)
        return replicas

    def take_over(self, replica: LocalServer, timeout: float = 20.0) -> None:
        """Make ``replica`` its master's successor at once (CLUSTER FAILOVER TAKEOVER, which
        asks no one: its master may be dead) and wait until it serves as a master.

        :raises RuntimeError: if it is not a master within ``timeout`` seconds.
        """
        _command(replica.port, "CLUSTER", "FAILOVER", "TAKEOVER", timeout=5)
        deadline = time.monotonic() + timeout
        while _info(replica.port, "replication", timeout=5)["role"] != "master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{replica.port} did not take over in {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node and remove the cluster's temporary directory."""
        for node in self.nodes:
            node.stop()
        self.paused.clear()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)
