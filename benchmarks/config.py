"""What a benchmark run is made of: systems, workloads, profiles, and the spec of one run."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The published results (the README's table): written only when ``--out`` names it.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_out_dir() -> Path:
    """Where a run writes when ``--out`` is not given: a folder of its own under
    ``keyserial-bench/`` in the working directory, never over a tracked file."""
    return Path("keyserial-bench") / time.strftime("%Y%m%d-%H%M%S")


#: System ids, in table order.
SYSTEMS: tuple[str, ...] = (
    "keyserial",
    "keyserial-durable",
    "keyserial-thread",
    "lock-default",
    "lock-tuned",
    "lock-notify",
    "no-lock",
    "lua",
)

SYSTEM_LABELS: dict[str, str] = {
    "keyserial": "keyserial",
    "keyserial-durable": "keyserial, durable_replicas=1",
    "keyserial-thread": "keyserial, plain sync ops (in a thread)",
    "lock-default": "redis-py Lock, defaults",
    "lock-tuned": "redis-py Lock, tuned",
    "lock-notify": "notification lock (python-redis-lock)",
    "no-lock": "no lock (read, modify, write)",
    "lua": "Lua script (ceiling)",
}

#: keyserial with ``durable_replicas=1``: it needs a replica (the suite starts one for its
#: private server), which every system of that suite run then shares, so it runs only when named.
DURABLE = "keyserial-durable"

#: keyserial running the same deposits and transfers as user-defined sync ops with no
#: declaration, which run in a worker thread (the ledger's are declared ``inline``: on the
#: event loop): what the thread costs. It runs only when named.
THREAD = "keyserial-thread"

#: ``--systems`` when none is given.
DEFAULT_SYSTEMS: tuple[str, ...] = tuple(s for s in SYSTEMS if s not in (DURABLE, THREAD))

#: The systems that run keyserial workers: the same code, with and without ``durable_replicas``,
#: and with the ops in a thread.
KEYSERIAL_SYSTEMS: tuple[str, ...] = ("keyserial", DURABLE, THREAD)


def is_keyserial(system: str) -> bool:
    return system in KEYSERIAL_SYSTEMS


#: Systems that serialize with a lock: the "best lock" of a workload is the best of these.
LOCKS: tuple[str, ...] = ("lock-default", "lock-tuned", "lock-notify")

#: Workload ids, in table order; ``slow`` and ``sweep`` have several variants each.
WORKLOADS: tuple[str, ...] = (
    "hot",
    "zipf",
    "uniform",
    "transfer",
    "local-transfer",
    "slow",
    "sweep",
)

WORKLOAD_LABELS: dict[str, str] = {
    "hot": "hot key (every caller on one account)",
    "zipf": "Zipf-skewed keys",
    "uniform": "uniform keys",
    "transfer": "cross-shard transfers",
    "local-transfer": "cross-shard transfers within one worker's shards",
    "slow": "slow I/O while holding the key",
    "sweep": "concurrency sweep (hot key)",
}


@dataclass(frozen=True, slots=True)
class Profile:
    """Defaults of ``--profile``; every field can be overridden on the command line."""

    name: str
    workloads: tuple[str, ...]
    duration: float
    warmup: float
    #: Measured seconds of each point of the ``slow`` and ``sweep`` workloads.
    variant_duration: float
    tuned_sleeps: tuple[float, ...]
    slow_keys: tuple[int, ...]
    sweep_callers: tuple[int, ...]
    drain_timeout: float
    #: Rounds of the hot, Zipf, uniform and transfer runs (see ``rounds.py``).
    rounds: int = 1


PROFILES: dict[str, Profile] = {
    "quick": Profile(
        name="quick",
        workloads=("hot", "zipf", "uniform", "transfer"),
        duration=2.0,
        warmup=0.5,
        variant_duration=2.0,
        tuned_sleeps=(0.001, 0.01, 0.05),
        slow_keys=(1, 16, 64),
        sweep_callers=(1, 16, 64, 256),
        drain_timeout=3.0,
    ),
    "full": Profile(
        name="full",
        workloads=("hot", "zipf", "uniform", "transfer", "slow", "sweep"),
        duration=4.0,
        warmup=1.0,
        variant_duration=3.0,
        tuned_sleeps=(0.001, 0.01, 0.05),
        slow_keys=(1, 4, 16, 64),
        sweep_callers=(1, 4, 16, 64, 256),
        drain_timeout=5.0,
        rounds=3,
    ),
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything a suite run needs; recorded in the JSON file."""

    profile: str
    systems: tuple[str, ...]
    workloads: tuple[str, ...]
    duration: float
    warmup: float
    variant_duration: float
    clients: int = 2
    callers: int = 32
    #: Shards of the keyserial namespace (hot, Zipf, uniform, transfers, sweep).
    shards: int = 16
    #: Shards for the slow-I/O workload: fewer than its largest key count, on purpose.
    slow_shards: int = 4
    #: keyserial worker processes; each serves every shard (one owns each, the rest stand by).
    workers: int = 1
    #: Give each worker process its own contiguous range of shards instead (no standby).
    split_shards: bool = False
    #: The workers' event loop (``keyserial worker --event-loop``).
    event_loop: str = "asyncio"
    keys: int = 10_000
    zipf_s: float = 1.1
    slow_io: float = 0.005
    tuned_ttl: float = 10.0
    tuned_sleeps: tuple[float, ...] = (0.001, 0.01, 0.05)
    slow_keys: tuple[int, ...] = (1, 16, 64)
    sweep_callers: tuple[int, ...] = (1, 16, 64, 256)
    drain_timeout: float = 3.0
    #: Rounds of the hot, Zipf, uniform and transfer runs; each system's median round counts.
    rounds: int = 1
    #: Starting balance of every account in the transfer workload.
    transfer_balance: int = 1_000_000
    redis_url: str | None = None
    #: Masters of the private Redis Cluster the suite starts (0: a standalone server).
    cluster_masters: int = 0
    out_dir: Path = field(default_factory=default_out_dir)
    seed: int = 4
    py_spy: bool = False

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["out_dir"] = str(self.out_dir)
        return data


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One system on one workload variant: what every client process of the run is told."""

    run_id: str
    system: str
    workload: str
    #: ``deposit`` (+1 on one account), ``slow`` (read, 5 ms of I/O, write) or ``transfer``.
    op: str
    #: ``hot``, ``zipf``, ``uniform`` (one account per op), ``pairs`` (two, cross-shard) or
    #: ``local-pairs`` (two, cross-shard, in one of :attr:`shard_ranges`).
    distribution: str
    keys: int
    clients: int
    callers: int
    shards: int
    url: str
    #: Key prefix of the lock systems, or the keyserial namespace: fresh for every run.
    prefix: str
    seed: int
    zipf_s: float = 1.1
    slow_io: float = 0.005
    #: redis-py Lock parameters (``None``: the library's default).
    lock_timeout: float | None = None
    lock_sleep: float = 0.1
    #: The variant, as shown in tables: ``{"sleep_ms": 10}``, ``{"keys": 64}``...
    variant: dict[str, Any] = field(default_factory=dict)
    #: Which round of its workload variant this run is (see ``rounds.py``).
    round: int = 1
    #: keyserial's ``durable_replicas`` for the run's workers and clients (``keyserial-durable``).
    durable_replicas: int = 0
    #: Whether ``url`` is a cluster node: the systems then route keys with a cluster client.
    cluster: bool = False
    #: The contiguous ranges the keyserial workers split the shards into (1: not split).
    shard_ranges: int = 1

    @property
    def total_callers(self) -> int:
        return self.clients * self.callers

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        return cls(**data)
