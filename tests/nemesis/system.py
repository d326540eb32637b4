"""The system under test for one run: Redis, worker slots, and how to reach and heal them.

A worker *slot* is a place in the plan's topology (its shard list); the process in it changes
when a fault kills it and a replacement starts. :class:`BaseSystem` runs the slots;
:class:`System` adds a durable private Redis and the fault proxies in front of it, and
``cluster_system.ClusterSystem`` a 3-master / 3-replica cluster (no proxies).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import redis.asyncio as aredis

from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import move_namespace
from keyserial._wire.layout import Layout
from keyserial._wire.routing import scale_shards
from keyserial.errors import BackendUnavailable
from keyserial.testing import LocalServer, ShardKeys, free_port
from tests.helpers import WorkerProcess
from tests.nemesis.schedule import Plan
from tests.nemesis.tap import StreamTap, direct_client
from tests.proxy import FaultProxy

#: Seconds a move under way when the load ends may go on, once every fault is healed, with no
#: old shard committing anything: slow ops queued on one key can keep a shard draining longer.
MOVE_AFTER_HEALING = 30.0
#: What a worker logs when started with a shard count a reshard has changed since.
_COUNT_CHANGED = "shards recorded in Redis, but this process was configured with"


class BaseSystem:
    """Worker slots; subclasses provide Redis. Start with ``async with``; all is stopped on
    exit."""

    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.profile = plan.profile
        self.workdir = workdir
        self.namespace = f"nem{plan.seed}"
        self.slots: list[WorkerProcess | None] = [None] * self.profile.workers
        #: Slots whose process was sent SIGTERM: healing starts their replacement.
        self.terminating: set[int] = set()
        self.every_process: list[WorkerProcess] = []
        #: Pids the nemesis killed or sent SIGTERM: any other exit is a crash.
        self.ended_by_nemesis: set[int] = set()
        self.inspector: Any = None  # a redis.asyncio client of the deployment
        #: What healing could not do (named in the run's log).
        self.heal_notes: list[str] = []
        self._started = 0
        #: Set when a move under way at the heal did not finish within
        #: :data:`MOVE_AFTER_HEALING`: the mover's last progress line.
        self.unfinished_move: str | None = None
        #: The namespace's shard count as the nemesis last moved it (``reshard`` faults): a
        #: replacement worker is started with it, serving the same fraction of the shards.
        self.shard_count = self.profile.shard_count
        #: The keys the byzantine client (``hostile.forge``) named in the grant requests and
        #: the ops it appended: each must answer an op after healing (a forged request that
        #: a worker took would hold it).
        self.forged_keys: set[str] = set()

    async def __aenter__(self) -> BaseSystem:
        await self.start_redis()
        for slot in range(self.profile.workers):
            self.start_worker(slot)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            for process in self.every_process:
                process.close()
            if self.inspector is not None:
                await self.inspector.aclose()
            await self.stop_redis()

    async def start_redis(self) -> None:
        raise NotImplementedError

    async def stop_redis(self) -> None:
        raise NotImplementedError

    def worker_url(self, slot: int) -> str:
        raise NotImplementedError

    def client_urls(self) -> list[str]:
        """One URL per client of the load."""
        raise NotImplementedError

    def tap(self) -> StreamTap:
        raise NotImplementedError

    async def heal_redis(self) -> None:
        """End every fault of Redis itself (and of the links to it)."""
        raise NotImplementedError

    def worker(self, slot: int) -> WorkerProcess:
        process = self.slots[slot]
        assert process is not None
        return process

    def start_worker(self, slot: int, env: Mapping[str, str] | None = None) -> WorkerProcess:
        shards = ",".join(map(str, self.shards_of(slot)))
        if self.profile.durable_replicas:
            env = {**(env or {}), "KEYSERIAL_DURABLE_REPLICAS": str(self.profile.durable_replicas)}
        process = WorkerProcess(
            self.worker_url(slot),
            self.namespace,
            shards=shards,
            shard_count=self.shard_count,
            lease_ttl=self.profile.lease_ttl,
            log_path=self.workdir / f"worker-{slot}-{self._started}.log",
            env={"KEYSERIAL_HEALTH_INTERVAL": str(self.profile.health_interval), **(env or {})},
        )
        self._started += 1
        self.slots[slot] = process
        self.terminating.discard(slot)
        self.every_process.append(process)
        return process

    @property
    def moves(self) -> bool:
        """Whether the plan reshards the namespace."""
        return bool(self.profile.reshard_faults[1] or self.profile.reshard_path)

    def shards_of(self, slot: int) -> list[int]:
        """The slot's shards of the plan, as the same fraction of the live shard count (as a
        running worker serves them after a reshard); at least one."""
        planned, count = self.plan.layouts[slot], self.shard_count
        return scale_shards(planned, self.profile.shard_count, count) or [
            planned[0] * count // self.profile.shard_count
        ]

    def outdated(self, process: WorkerProcess) -> bool:
        """Whether ``process`` stopped because a reshard changed the count it was started with
        (a replacement started just as a move flipped): started again, it is no crash."""
        return process.process.poll() is not None and _COUNT_CHANGED in process.log()

    def restart_outdated(self) -> None:
        for slot, process in enumerate(self.slots):
            if process is not None and self.outdated(process):
                self.start_worker(slot)

    async def move(self, shards: int, note: Callable[[str], None]) -> None:
        """Reshard the namespace to ``shards`` shards (or finish the move under way), as
        ``keyserial reshard`` does, through Redis outages, until done or cancelled."""
        while True:
            try:
                backend = await Backend.connect(self.direct_url())
                try:
                    await move_namespace(
                        backend, Settings(namespace=self.namespace), shards, progress=note
                    )
                finally:
                    with anyio.CancelScope(shield=True):
                        await backend.aclose()
                self.shard_count = shards
                return
            except BackendUnavailable as error:
                note(f"reshard: {error}; trying again")
                await anyio.sleep(0.2)

    async def move_under_way(self) -> int | None:
        """The shard count a recorded move goes to, if one is under way (asked again while
        Redis is down, BUSY or LOADING: a reshard fault must not be lost to one)."""
        while True:
            try:
                backend = await Backend.connect(self.direct_url())
                try:
                    record = await backend.layout_record(self.namespace)
                finally:
                    with anyio.CancelScope(shield=True):
                        await backend.aclose()
                return None if record is None or record.move is None else record.move.target.shards
            except BackendUnavailable:
                await anyio.sleep(0.2)

    def direct_url(self) -> str:
        """Redis, reached without a fault proxy (the mover's, the checkers')."""
        raise NotImplementedError

    def crashed(self) -> list[dict[str, object]]:
        """Worker processes that exited although the nemesis neither killed nor stopped them,
        with their exit code and the last error their log shows."""
        crashes: list[dict[str, object]] = []
        for process in self.every_process:
            code = process.process.poll()
            if code is None or process.pid in self.ended_by_nemesis or self.outdated(process):
                continue
            errors = [
                line
                for line in process.log().splitlines()
                if "Error" in line and not line.startswith(("redis.", "future:"))
            ]
            crashes.append(
                {
                    "pid": process.pid,
                    "exit_code": code,
                    "last_error": errors[-1].strip()[:300] if errors else "",
                    "log": str(process.log_path),
                }
            )
        return crashes

    async def heal(self) -> None:
        """End every fault: resume paused processes, heal Redis and the links to it, and put
        a live worker in every slot."""
        for each in self.every_process:
            if each.process.poll() is None:
                with suppress(ProcessLookupError):
                    each.signal(signal.SIGCONT)
        await self.heal_redis()
        for slot, process in enumerate(self.slots):
            if process is None or process.process.poll() is not None or slot in self.terminating:
                self.start_worker(slot)
        under_way = await self.move_under_way() if self.moves else None
        if under_way is not None:  # (a reshard fault cut short when the load ended)
            async with anyio.create_task_group() as group:

                async def finish() -> None:
                    try:
                        await self.move(under_way, self.heal_notes.append)
                    except Exception as error:  # (reported below: the move is still recorded)
                        self.heal_notes.append(f"reshard to {under_way} failed: {error!r}")
                    group.cancel_scope.cancel()

                group.start_soon(finish)
                await self._until_the_old_shards_stall()
                group.cancel_scope.cancel()
            if await self.move_under_way() is not None:
                self.unfinished_move = self.heal_notes[-1] if self.heal_notes else "no progress"
            for _ in range(3):  # (a worker started above with the count before the flip exits
                self.restart_outdated()  # only once it has read the new one: seed 9146)
                await anyio.sleep(1.0)

    async def _until_the_old_shards_stall(self) -> None:
        """Until the shards a move leaves have committed nothing for
        :data:`MOVE_AFTER_HEALING` seconds (their progress records unchanged)."""
        source = Layout(self.namespace, self.shard_count)  # (the count before the move)
        last: list[Any] = []
        stalled_since = time.monotonic()
        while time.monotonic() - stalled_since < MOVE_AFTER_HEALING:
            await anyio.sleep(1.0)
            try:
                backend = await Backend.connect(self.direct_url())
                try:
                    record = await backend.layout_record(self.namespace)
                    if record is not None:
                        source = record.live
                    now = await backend.pipeline(
                        [("GET", keys.progress) for keys in source.all_keys()]
                    )
                finally:
                    await backend.aclose()
            except BackendUnavailable:
                continue
            if now != last:
                last, stalled_since = now, time.monotonic()

    async def holders(self) -> dict[int, int | None]:
        """The pid holding each shard's lease (None: no holder)."""
        assert self.inspector is not None
        keys = [ShardKeys(self.namespace, shard).lease for shard in range(self.profile.shard_count)]
        values = [await self.inspector.get(key) for key in keys]
        return {
            shard: int(value.decode().split(":")[1]) if value else None
            for shard, value in enumerate(values)
        }

    def live_pids(self) -> set[int]:
        return {
            process.pid
            for process in self.slots
            if process is not None and process.process.poll() is None
        }

    async def wait_all_held(self, timeout: float) -> bool:
        """Until every shard's lease is held by a live process in a slot."""
        with anyio.move_on_after(timeout):
            while True:
                with suppress(OSError, aredis.RedisError):
                    holders = await self.holders()
                    if all(pid in self.live_pids() for pid in holders.values()):
                        return True
                await anyio.sleep(0.05)
        return False


class System(BaseSystem):
    """A durable private Redis; every worker and client reaches it through its own proxy."""

    def __init__(self, plan: Plan, workdir: Path) -> None:
        super().__init__(plan, workdir)
        # Ports below 55536: the range a cluster node (port + 10000) could also use.
        self.server = LocalServer(
            port=free_port(55535), appendfsync="always", data_dir=workdir / "redis"
        )
        self.worker_proxies = [
            FaultProxy(f"worker:{slot}", self.server.port) for slot in range(self.profile.workers)
        ]
        self.client_proxies = [
            FaultProxy(f"client:{n}", self.server.port) for n in range(self.profile.clients)
        ]

    async def start_redis(self) -> None:
        await anyio.to_thread.run_sync(self.server.start)
        self.inspector = aredis.Redis(port=self.server.port, socket_timeout=5)
        for proxy in self.proxies():
            await proxy.start()

    async def stop_redis(self) -> None:
        for proxy in self.proxies():
            await proxy.aclose()
        await anyio.to_thread.run_sync(self.server.stop)

    def proxies(self) -> list[FaultProxy]:
        return [*self.worker_proxies, *self.client_proxies]

    def proxy(self, target: str) -> FaultProxy:
        """The proxy of ``worker:<slot>`` or ``client:<n>``."""
        kind, number = target.split(":")
        return (self.worker_proxies if kind == "worker" else self.client_proxies)[int(number)]

    def worker_url(self, slot: int) -> str:
        return self.worker_proxies[slot].url

    def client_urls(self) -> list[str]:
        return [proxy.url for proxy in self.client_proxies]

    def tap(self) -> StreamTap:
        port = self.server.port
        return StreamTap(lambda: direct_client(port), self.namespace, self.profile.shard_count)

    def direct_url(self) -> str:
        return self.server.url

    def redis_up(self) -> bool:
        process = self.server.process
        return process is not None and process.poll() is None

    async def heal_redis(self) -> None:
        for proxy in self.proxies():
            proxy.heal()
        if not self.redis_up():
            await anyio.to_thread.run_sync(self.server.start)
        with suppress(OSError, aredis.RedisError):  # NOTBUSY: no script of redis_busy runs
            await self.inspector.script_kill()
