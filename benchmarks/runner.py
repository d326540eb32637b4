"""The run matrix: every selected workload variant × system, on one server (or one cluster), one
after another.

For each run: fresh keys (a new prefix or keyserial namespace), keyserial workers started for it,
the client processes' callers started together, a warm-up, then a measured window bracketed by
two snapshots (``INFO commandstats`` — reset first on a private server — server CPU, worker
CPU), a drain, the correctness check of the final state against the acknowledged ops, and the
clean-up of the run's keys.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from keyserial.testing import LocalCluster, LocalServer

from . import durability, metrics, state
from .config import DURABLE, BenchConfig, RunSpec, is_keyserial
from .machine import load_average, machine_info, server_info
from .procs import (
    AgentError,
    AgentPool,
    KeyserialWorkers,
    py_spy_available,
    run_agents,
    start_py_spy,
)
from .rounds import REPEATED, median_rounds
from .server import BenchServer
from .systems import unavailable_reason
from .workloads import Cell, cells

Progress = Callable[[str], None]


class Skipped(Exception):
    """The system cannot run this workload here; the message says why (no number is made up)."""


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    commands: Counter[str]
    server_cpu: float
    worker_cpu: list[float | None]
    machine_busy: float | None
    replica_cpu: float | None = None


@dataclass(slots=True)
class Context:
    config: BenchConfig
    bench: BenchServer
    private: bool
    agents: AgentPool
    log_dir: Path
    progress: Progress
    #: The replicas ``keyserial-durable`` runs against (``None``: it was not selected).
    replication: durability.Replication | None = None


def plan(config: BenchConfig, url: str, token: str, *, cluster: bool = False) -> list[RunSpec]:
    """Every run of the suite, in order: workloads, their variants, rounds (of the repeated
    workloads), systems (tuned: per sleep)."""
    specs: list[RunSpec] = []
    for workload in config.workloads:
        rounds = config.rounds if workload in REPEATED else 1
        for cell in cells(config, workload):
            for round_ in range(1, rounds + 1):
                for system in config.systems:
                    for lock in _lock_settings(config, system):
                        prefix = f"bench-{token}-r{len(specs) + 1:03d}"
                        specs.append(
                            _spec(config, cell, system, lock, url, cluster, prefix, round_)
                        )
    return specs


def _lock_settings(config: BenchConfig, system: str) -> list[dict[str, Any]]:
    if system == "lock-tuned":
        return [{"lock_timeout": config.tuned_ttl, "lock_sleep": s} for s in config.tuned_sleeps]
    return [{}]


def _spec(
    config: BenchConfig,
    cell: Cell,
    system: str,
    lock: dict[str, Any],
    url: str,
    cluster: bool,
    prefix: str,
    round_: int,
) -> RunSpec:
    variant = dict(cell.variant)
    if "lock_sleep" in lock:
        variant["sleep_ms"] = round(lock["lock_sleep"] * 1000, 3)
    return RunSpec(
        run_id=prefix.rsplit("-", 1)[1],
        system=system,
        workload=cell.workload,
        op=cell.op,
        distribution=cell.distribution,
        keys=cell.keys,
        clients=cell.clients,
        callers=cell.callers,
        shards=cell.shards,
        url=url,
        cluster=cluster,
        prefix=prefix,
        seed=config.seed,
        zipf_s=config.zipf_s,
        slow_io=config.slow_io,
        variant=variant,
        round=round_,
        durable_replicas=1 if system == DURABLE else 0,
        shard_ranges=config.workers if config.split_shards else 1,
        **lock,
    )


def describe(spec: RunSpec) -> str:
    variant = ", ".join(f"{k} {v}" for k, v in spec.variant.items())
    round_ = f", round {spec.round}" if spec.round > 1 else ""
    return f"{spec.workload}{f' ({variant})' if variant else ''} × {spec.system}{round_}"


def duration_of(config: BenchConfig, spec: RunSpec) -> float:
    return config.variant_duration if spec.workload in ("slow", "sweep") else config.duration


async def run_suite(
    config: BenchConfig, progress: Progress = stderr_progress, command: str = "keyserial bench"
) -> dict[str, Any]:
    """Run every selected system × workload; the document written to the JSON file."""
    started = time.time()
    machine = machine_info()
    with ExitStack() as servers:
        private = _start_private(config, servers)
        url = config.redis_url or (private.url if private else "")
        bench = await BenchServer.open(url)
        try:
            document: dict[str, Any] = {
                "machine": machine,
                "server": await server_info(bench, private),
            }
            replication = None
            if DURABLE in config.systems and bench.is_cluster:
                replication = durability.on_cluster()
            elif DURABLE in config.systems:
                replica = None
                if isinstance(private, LocalServer):
                    replica = await durability.start_replica(private, bench.first)
                    servers.callback(replica.stop)
                replication = await durability.replication(bench.first, url, replica)
                document["replication"] = replication.to_json()
            runs = await _run_all(config, bench, private is not None, progress, replication)
        finally:
            await bench.aclose()
    results = median_rounds(runs)
    mark_best_tuned(results)
    document.update(
        {
            "schema": 1,
            "command": command,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "elapsed_seconds": round(time.time() - started, 1),
            "load_average_at_end": load_average(),
            "config": config.to_json(),
            "results": results,
        }
    )
    if len(runs) > len(results):
        document["runs"] = runs  # every round; ``results`` holds each system's median one
    return document


def _start_private(config: BenchConfig, servers: ExitStack) -> LocalServer | LocalCluster | None:
    """The suite's own server (or ``--cluster`` masters), stopped as ``servers`` closes;
    ``None`` with ``--redis``."""
    if config.redis_url:
        return None
    if config.cluster_masters:
        return servers.enter_context(LocalCluster(masters=config.cluster_masters, replicas=0))
    return servers.enter_context(LocalServer())


async def _run_all(
    config: BenchConfig,
    bench: BenchServer,
    private: bool,
    progress: Progress,
    replication: durability.Replication | None,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with _log_dir() as log_dir:
        specs = plan(config, bench.url, secrets.token_hex(3), cluster=bench.is_cluster)
        pool_size = max([spec.clients for spec in specs], default=1)
        progress(_announce(config, specs, private, replication))
        stack = AsyncExitStack()
        agents = await stack.enter_async_context(AgentPool(pool_size, log_dir))
        try:
            context = Context(config, bench, private, agents, log_dir, progress, replication)
            for index, spec in enumerate(specs, 1):
                result = await _run_guarded(context, spec, f"[{index}/{len(specs)}]")
                results.append(result)
                if result["status"] == "failed":
                    await stack.aclose()
                    stack = AsyncExitStack()
                    context.agents = await stack.enter_async_context(AgentPool(pool_size, log_dir))
        finally:
            await stack.aclose()
    return results


def _announce(
    config: BenchConfig,
    specs: list[RunSpec],
    private: bool,
    replication: durability.Replication | None,
) -> str:
    seconds = sum(duration_of(config, s) + config.warmup + 0.6 for s in specs)
    where = "a private server" if private else str(config.redis_url)
    if private and config.cluster_masters:
        where = f"a private cluster of {config.cluster_masters} masters"
    if replication is not None and replication.unavailable is None:
        replicas = replication.replicas_online
        where += f" with {replicas} replica{'s' if replicas != 1 else ''} attached"
    return (
        f"keyserial bench: profile {config.profile}, {len(specs)} runs on {where},"
        f" about {seconds / 60:.1f} min"
    )


@contextmanager
def _log_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="keyserial-bench-") as directory:
        yield Path(directory)


async def _run_guarded(context: Context, spec: RunSpec, counter: str) -> dict[str, Any]:
    base = _base_record(context.config, spec)
    reason = unavailable_reason(spec.system, spec.op, cluster=spec.cluster)
    if reason is None and spec.system == DURABLE and context.replication is not None:
        reason = context.replication.unavailable
    if reason is not None:
        context.progress(f"{counter} {describe(spec)}: skipped ({reason})")
        return {**base, "status": "skipped", "reason": reason}
    context.progress(f"{counter} {describe(spec)}: {duration_of(context.config, spec):g}s ...")
    try:
        record = {**base, **await run_one(context, spec)}
    except Skipped as exc:
        context.progress(f"{counter} {describe(spec)}: skipped ({exc})")
        record = {**base, "status": "skipped", "reason": str(exc)}
    except Exception as exc:  # one failed run is recorded; the suite goes on
        reason = _reason(exc)
        context.progress(f"{counter} {describe(spec)}: FAILED: {reason}")
        record = {**base, "status": "failed", "reason": reason[-2000:]}
    finally:
        with anyio.CancelScope(shield=True):
            await state.clean_up(context.bench, spec)
    if record["status"] == "ok":
        context.progress(f"{counter} {describe(spec)}: {_one_line(record)}")
    return record


def _reason(exc: BaseException) -> str:
    """The first real error inside (task groups wrap them), as ``Type: message``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, AgentError | TimeoutError):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _base_record(config: BenchConfig, spec: RunSpec) -> dict[str, Any]:
    return {
        "run_id": spec.run_id,
        "workload": spec.workload,
        "system": spec.system,
        "variant": spec.variant,
        "round": spec.round,
        "op": spec.op,
        "distribution": spec.distribution,
        "keys": spec.keys,
        "clients": spec.clients,
        "callers_per_client": spec.callers,
        "callers": spec.total_callers,
        "shards": spec.shards if is_keyserial(spec.system) else None,
        "workers": config.workers if is_keyserial(spec.system) else None,
        "durable_replicas": spec.durable_replicas if is_keyserial(spec.system) else None,
        "lock": (
            {"timeout": spec.lock_timeout, "sleep": spec.lock_sleep}
            if spec.system in ("lock-default", "lock-tuned")
            else None
        ),
        "warmup": config.warmup,
        "duration": duration_of(config, spec),
    }


def _one_line(record: dict[str, Any]) -> str:
    latency = record["latency_ms"]
    correctness = record["correctness"]
    return (
        f"{record['throughput']:,.0f} ops/s, p50 {latency['p50']:.2f} ms, p99"
        f" {latency['p99']:.2f} ms, {record['commands_per_op']:.2f} cmds/op,"
        f" lost {correctness['lost_updates']}"
    )


async def run_one(context: Context, spec: RunSpec) -> dict[str, Any]:
    """One measured run; its figures."""
    config = context.config
    duration = duration_of(config, spec)
    async with AsyncExitStack() as stack:
        workers: KeyserialWorkers | None = None
        if is_keyserial(spec.system):
            workers = await stack.enter_async_context(
                KeyserialWorkers(
                    spec,
                    config.workers,
                    context.log_dir,
                    split=config.split_shards,
                    event_loop=config.event_loop,
                )
            )
        if spec.op == "transfer":
            if is_keyserial(spec.system):
                reason = await state.probe_keyserial_transfer(spec)
                if reason is not None:
                    raise Skipped(reason)
            await state.seed(context.bench, spec, config.transfer_balance)
        chosen = await context.agents.prepare(spec)
        start = time.time() + 0.05
        go = {
            "start": start,
            "measure_from": start + config.warmup,
            "measure_until": start + config.warmup + duration,
            "drain": config.drain_timeout,
        }
        paths = [context.log_dir / f"{spec.run_id}-{n}.lat" for n in range(len(chosen))]
        tallies: list[dict[str, Any]] = []
        worker_pids = workers.pids if workers else []

        async def collect() -> None:
            timeout = config.warmup + duration + config.drain_timeout + 60
            tallies.extend(await run_agents(chosen, go, paths, timeout))

        async with anyio.create_task_group() as group:
            group.start_soon(collect)
            client_pids = [agent.process.pid for agent in chosen]
            before, after = await _measure(context, spec, go, worker_pids, client_pids)
        final = await _final_state(context, spec, tallies)
    return _figures(spec, duration, tallies, paths, before, after, final)


async def _measure(
    context: Context,
    spec: RunSpec,
    go: dict[str, Any],
    worker_pids: list[int],
    client_pids: list[int],
) -> tuple[Snapshot, Snapshot]:
    await anyio.sleep(max(0.0, go["measure_from"] - time.time()))
    if context.private:
        await context.bench.reset_stats()
    replica = context.replication.replica_pid if context.replication else None
    before = await _snapshot(context.bench, worker_pids, replica)
    samplers: list[Process] = []
    if context.config.py_spy and is_keyserial(spec.system):
        samplers = await _profile(context, spec, go, worker_pids + client_pids)
    await anyio.sleep(max(0.0, go["measure_until"] - time.time()))
    after = await _snapshot(context.bench, worker_pids, replica)
    for sampler in samplers:
        with anyio.move_on_after(15):
            await sampler.wait()
    return before, after


async def _profile(
    context: Context, spec: RunSpec, go: dict[str, Any], pids: list[int]
) -> list[Process]:
    if not py_spy_available():
        context.progress("  (--py-spy: py-spy is not installed; no profile)")
        return []
    samplers = []
    out = context.config.out_dir / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    seconds = go["measure_until"] - time.time()
    for n, pid in enumerate(pids):
        role = "worker" if n < len(pids) - spec.clients else "client"
        path = out / f"{spec.workload}-{spec.run_id}-{role}-{pid}.txt"
        samplers.append(await start_py_spy(pid, seconds, path))
        context.progress(f"  py-spy: {path}")
    return samplers


async def _snapshot(
    bench: BenchServer, worker_pids: list[int], replica_pid: int | None
) -> Snapshot:
    return Snapshot(
        at=time.time(),
        commands=await bench.commandstats(),
        server_cpu=await bench.cpu_seconds(),
        worker_cpu=[metrics.process_cpu_seconds(pid) for pid in worker_pids],
        machine_busy=metrics.machine_busy_seconds(),
        replica_cpu=None if replica_pid is None else metrics.process_cpu_seconds(replica_pid),
    )


@dataclass(frozen=True, slots=True)
class Final:
    acked: Counter[int]
    slack: Counter[int]
    balances: dict[int, int]
    initial: int


async def _final_state(context: Context, spec: RunSpec, tallies: list[dict[str, Any]]) -> Final:
    acked: Counter[int] = Counter()
    slack: Counter[int] = Counter()
    for tally in tallies:
        acked.update({int(k): v for k, v in tally["acked"].items()})
        slack.update({int(k): v for k, v in tally["slack"].items()})
    initial = context.config.transfer_balance if spec.op == "transfer" else 0
    accounts = sorted(set(range(spec.keys)) if spec.op == "transfer" else set(acked) | set(slack))
    if is_keyserial(spec.system) and slack:
        # Ops the clients gave up on may still run: wait until they have, then read.
        await state.settle_keyserial(spec, sorted(slack), timeout=30)
    balances = await state.read_balances(context.bench, spec, accounts)
    return Final(acked, slack, balances, initial)


def correctness(final: Final, tallies: list[dict[str, Any]]) -> dict[str, Any]:
    """The final state checked against the acknowledged ops, account by account.

    An account's expected change is the sum of its acknowledged ops' changes; ops that were
    cancelled or failed may or may not have applied, so each allows a difference of its size
    (``slack``). A difference beyond that is a lost update (or a phantom one).
    """
    lost = 0
    mismatched = 0
    unacknowledged_applied = 0
    for account, balance in final.balances.items():
        difference = (balance - final.initial) - final.acked.get(account, 0)
        allowed = final.slack.get(account, 0)
        if difference > 0:
            unacknowledged_applied += min(difference, allowed)
        if abs(difference) > allowed:
            mismatched += 1
            lost += abs(difference) - allowed
    return {
        "acknowledged_ops": sum(t["acked_ops"] for t in tallies),
        "unfinished_ops": sum(t["unfinished"] for t in tallies),
        "failed_ops": sum(sum(t["errors"].values()) for t in tallies),
        "accounts_checked": len(final.balances),
        "accounts_wrong": mismatched,
        "lost_updates": lost,
        "unacknowledged_applied": unacknowledged_applied,
        "expected_total": sum(final.acked.values()) + final.initial * len(final.balances),
        "final_total": sum(final.balances.values()),
    }


def _figures(
    spec: RunSpec,
    duration: float,
    tallies: list[dict[str, Any]],
    paths: list[Path],
    before: Snapshot,
    after: Snapshot,
    final: Final,
) -> dict[str, Any]:
    samples: list[float] = []
    for path in paths:
        samples.extend(_read_latencies(path))
    ops = sum(t["window_ops"] for t in tallies)
    window = after.at - before.at
    calls = metrics.diff_commands(after.commands, before.commands)
    client_cpu = sum(t["cpu_seconds"] for t in tallies)
    server_cpu = after.server_cpu - before.server_cpu
    worker_cpu = _worker_cpu(before, after)
    replica_cpu = _delta(before.replica_cpu, after.replica_cpu)
    busy = _delta(before.machine_busy, after.machine_busy)
    own = server_cpu + client_cpu + (worker_cpu or 0) + (replica_cpu or 0)
    others = None if busy is None else max(0.0, busy - own)
    errors: Counter[str] = Counter()
    for tally in tallies:
        errors.update(tally["errors"])
    return {
        "status": "ok",
        "throughput": ops / duration,
        "ops_in_window": ops,
        "latency_ms": metrics.latency_summary(samples),
        **metrics.command_figures(calls, ops),
        "commands": calls,
        "cpu": {
            "server": metrics.cpu_figures(server_cpu, window, ops),
            "clients": metrics.cpu_figures(client_cpu, duration, ops),
            "workers": metrics.cpu_figures(worker_cpu, window, ops),
            # The suite's own replica (only while ``keyserial-durable`` is selected).
            "replica": metrics.cpu_figures(replica_cpu, window, ops),
            # Every process on the machine, and those not part of the run (noise).
            "machine": metrics.cpu_figures(busy, window, ops),
            "others": metrics.cpu_figures(others, window, ops),
        },
        "correctness": correctness(final, tallies),
        "errors": dict(errors.most_common(5)),
    }


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def _worker_cpu(before: Snapshot, after: Snapshot) -> float | None:
    if not before.worker_cpu:
        return None
    pairs = list(zip(before.worker_cpu, after.worker_cpu, strict=True))
    if any(a is None or b is None for a, b in pairs):
        return None
    return sum(b - a for a, b in pairs if a is not None and b is not None)


def _read_latencies(path: Path) -> list[float]:
    values = array("d")
    with open(path, "rb") as data:
        values.frombytes(data.read())
    return values.tolist()


def mark_best_tuned(results: list[dict[str, Any]]) -> None:
    """Flag, per workload variant, the tuned-lock sleep with the best throughput."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in results:
        if record["system"] == "lock-tuned" and record["status"] == "ok":
            variant = {k: v for k, v in record["variant"].items() if k != "sleep_ms"}
            groups.setdefault(f"{record['workload']}{sorted(variant.items())}", []).append(record)
    for group in groups.values():
        best = max(group, key=lambda r: r["throughput"])
        for record in group:
            record["best_tuned"] = record is best
