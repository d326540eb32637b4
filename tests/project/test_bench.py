"""The benchmark suite (benchmarks/): a smoke run of ``keyserial bench``, the correctness check
that it rests on, and the notification-lock port checked against the library it ports."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis.asyncio import Redis

from benchmarks import calls, cost, notifylock, state
from benchmarks.agent import Tally, Window, run_callers
from benchmarks.cli import build_parser, config_from
from benchmarks.cli import main as bench_main
from benchmarks.config import DEFAULT_SYSTEMS, RESULTS_DIR, RunSpec
from benchmarks.metrics import parse_commandstats, percentile
from benchmarks.procs import shard_range
from benchmarks.rounds import median_rounds
from benchmarks.runner import Final, correctness, plan
from benchmarks.server import BenchServer
from benchmarks.systems import NoLockSystem
from benchmarks.workloads import make_chooser, shard_range_of, shard_table
from keyserial.testing import LocalServer
from tests.helpers import ROOT

QUICK_WORKLOADS = ("hot", "zipf", "uniform", "transfer")


@pytest.mark.slow
def test_quick_profile_smoke(tmp_path: Path) -> None:
    """``keyserial bench --profile quick``, briefly: every system × workload has figures,
    keyserial loses nothing, and the table, JSON and PNG are written."""
    started = time.monotonic()
    command = [
        sys.executable, "-m", "keyserial", "bench", "--profile", "quick",
        "--duration", "0.3", "--warmup", "0.1", "--callers", "4", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert time.monotonic() - started < 60
    assert "[1/32] hot × keyserial" in completed.stderr  # progress while it runs
    # the table at the end († marks a run during which other processes took CPU)
    assert re.search(r"^\| keyserial( †)? \|", completed.stdout, re.MULTILINE)
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    png = (tmp_path / "bench-quick.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert document["machine"]["cores"] and document["server"]["redis_version"]
    for workload in QUICK_WORKLOADS:
        for system in DEFAULT_SYSTEMS:
            runs = [
                r
                for r in document["results"]
                if r["workload"] == workload and r["system"] == system
            ]
            assert runs, (workload, system)
            for run in runs:
                assert run["status"] == "ok", run
                assert run["throughput"] > 0 and run["ops_in_window"] > 0
                assert run["latency_ms"]["p50"] <= run["latency_ms"]["p99"]
                assert run["latency_ms"]["p99"] <= run["latency_ms"]["p99_9"]
                assert run["commands_per_op"] > 0
                assert run["cpu"]["server"]["percent"] is not None
                assert run["cpu"]["clients"]["percent"] is not None
                if system == "keyserial":
                    assert run["cpu"]["workers"]["percent"] is not None
                    assert run["correctness"]["lost_updates"] == 0, run["correctness"]
                    assert run["correctness"]["accounts_wrong"] == 0
    tuned = [r for r in document["results"] if r["system"] == "lock-tuned"]
    assert len(tuned) == 3 * len(QUICK_WORKLOADS)
    assert sum(bool(r.get("best_tuned")) for r in tuned) == len(QUICK_WORKLOADS)
    targets = {t["id"]: t for t in document["targets"]}
    assert targets["keyserial-no-lost-updates"]["met"] is True
    assert isinstance(targets["transfer-vs-best-lock"]["met"], bool)  # measured: a verdict
    assert all(t["met"] is None for name, t in targets.items() if name.startswith("slow"))


@pytest.mark.slow
def test_durable_system_runs_next_to_keyserial_on_a_replicated_server(tmp_path: Path) -> None:
    """``keyserial-durable``: the suite attaches a replica to its server; the durable workers
    WAIT for it, the plain ones do not, and the table and JSON give durable ÷ plain."""
    command = [
        sys.executable, "-m", "keyserial", "bench", "--workloads", "hot",
        "--systems", "keyserial,keyserial-durable", "--duration", "0.3", "--warmup", "0.1",
        "--callers", "4", "--no-chart", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "with 1 replica attached" in completed.stderr
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    assert document["replication"] == {
        "replicas_online": 1, "started_by_suite": True, "unavailable": None,
    }  # fmt: skip
    plain, durable = document["results"]
    assert (plain["system"], durable["system"]) == ("keyserial", "keyserial-durable")
    for run in (plain, durable):
        assert run["status"] == "ok" and run["correctness"]["lost_updates"] == 0, run
        assert run["cpu"]["replica"]["percent"] is not None
    assert durable["durable_replicas"] == 1 and durable["commands"].get("wait", 0) > 0
    assert plain["durable_replicas"] == 0 and "wait" not in plain["commands"]
    [cost] = document["durability"]
    assert cost["workload"] == "hot"
    assert cost["throughput_ratio"] == durable["throughput"] / plain["throughput"]
    assert cost["p99_ratio"] == durable["latency_ms"]["p99"] / plain["latency_ms"]["p99"]
    assert "### Durability's cost" in completed.stdout
    assert f"| hot | {plain['throughput']:,.0f} |" in completed.stdout


@pytest.mark.slow
def test_thread_system_runs_plain_sync_ops_in_threads_next_to_keyserial(tmp_path: Path) -> None:
    """``keyserial-thread``: the same deposits and transfers as plain sync ops of
    ``benchmarks.ops`` (run in worker threads), with figures, and nothing lost."""
    command = [
        sys.executable, "-m", "keyserial", "bench", "--workloads", "hot,uniform,transfer",
        "--systems", "keyserial-thread", "--duration", "0.3", "--warmup", "0.1",
        "--callers", "4", "--no-chart", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stderr[-4000:]
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    runs = document["results"]
    assert [run["workload"] for run in runs] == ["hot", "uniform", "transfer"]
    for run in runs:
        assert run["system"] == "keyserial-thread" and run["status"] == "ok", run
        assert run["throughput"] > 0 and run["correctness"]["lost_updates"] == 0, run
    assert "| keyserial, plain sync ops (in a thread)" in completed.stdout


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as running:
        yield running


def _spec(server: LocalServer, system: str, prefix: str, **changes: object) -> RunSpec:
    fields: dict[str, object] = {
        "run_id": "t",
        "system": system,
        "workload": "hot",
        "op": "deposit",
        "distribution": "hot",
        "keys": 1,
        "clients": 1,
        "callers": 32,
        "shards": 16,
        "url": server.url,
        "prefix": prefix,
        "seed": 1,
    }
    fields.update(changes)
    return RunSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.slow
def test_durable_system_is_skipped_on_a_server_without_a_replica(
    server: LocalServer, tmp_path: Path
) -> None:
    command = [
        sys.executable, "-m", "keyserial", "bench", "--redis", server.url, "--workloads", "hot",
        "--systems", "keyserial-durable", "--no-chart", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr[-4000:]
    [run] = json.loads((tmp_path / "bench-quick.json").read_text())["results"]
    assert run["status"] == "skipped"
    assert run["reason"].startswith(f"needs a replica: {server.url} has none online")
    assert "hot × keyserial-durable: skipped (needs a replica" in completed.stderr


async def test_no_lock_loses_updates_on_a_hot_key(server: LocalServer) -> None:
    """Without the lost updates of the no-lock system, the correctness check would prove nothing."""
    spec = _spec(server, "no-lock", f"nolock-{random.randrange(1 << 30)}")
    system = NoLockSystem(spec)
    await system.open()
    tallies: list[Tally] = []  # (half-second windows until 100 ops: a loaded machine runs few)
    try:
        while sum(tally.acked_ops for tally in tallies) <= 100 and len(tallies) < 20:
            now = time.time()
            window = Window(now, now, now + 0.5, 2.0)
            tallies.append(await run_callers(spec, system, len(tallies), window))
    finally:
        await system.close()
    bench = await BenchServer.open(server.url)
    try:
        balances = await state.read_balances(bench, spec, [0])
        assert await state.clean_up(bench, spec) == 1
    finally:
        await bench.aclose()
    acked = sum((tally.acked for tally in tallies), Counter[int]())
    slack = sum((tally.slack for tally in tallies), Counter[int]())
    acked_ops = sum(tally.acked_ops for tally in tallies)
    verdict = correctness(Final(acked, slack, balances, 0), [t.to_json() for t in tallies])
    assert acked_ops > 100
    assert verdict["lost_updates"] > 0
    assert verdict["lost_updates"] == acked_ops - balances[0] - sum(slack.values())


def test_the_correctness_check_counts_lost_updates_beyond_doubtful_ops() -> None:
    final = Final(Counter({1: 10, 2: 5}), Counter({2: 1}), {1: 7, 2: 6, 3: 0}, 0)
    verdict = correctness(final, [{"acked_ops": 15, "unfinished": 1, "errors": {}}])
    # account 1 lost 3; account 2 got one more than acknowledged, covered by its doubtful op
    assert verdict["lost_updates"] == 3
    assert verdict["accounts_wrong"] == 1
    assert verdict["unacknowledged_applied"] == 1


def test_the_unlock_script_is_the_library_s() -> None:
    redis_lock = pytest.importorskip("redis_lock")
    assert notifylock.UNLOCK_SCRIPT == redis_lock.UNLOCK_SCRIPT


@pytest.mark.slow
async def test_notification_lock_never_overlaps_and_interoperates_with_the_library(
    server: LocalServer,
) -> None:
    """python-redis-lock's no-overlap test, for the port: holders of one lock, here asyncio tasks
    using the port *and* threads using the library itself, never hold it at the same time;
    each release wakes a waiter of either kind (same keys, same scripts, same signal list)."""
    redis_lock = pytest.importorskip("redis_lock")
    name = f"overlap-{random.randrange(1 << 30)}"
    intervals: list[tuple[float, float, str]] = []
    guard = f"{name}:holders"
    sync = redis.Redis.from_url(server.url)
    stop = time.monotonic() + 2.0

    def hold_with_the_library() -> None:
        while time.monotonic() < stop:
            with redis_lock.Lock(sync, name):
                start = time.monotonic()
                assert sync.incr(guard) == 1
                time.sleep(random.uniform(0, 0.002))
                assert sync.decr(guard) == 0
                intervals.append((start, time.monotonic(), "library"))

    client = Redis.from_url(server.url, max_connections=24)

    async def hold_with_the_port() -> None:
        while time.monotonic() < stop:
            async with notifylock.NotifyLock(client, name):
                start = time.monotonic()
                assert await client.incr(guard) == 1
                await anyio.sleep(random.uniform(0, 0.002))
                assert await client.decr(guard) == 0
                intervals.append((start, time.monotonic(), "port"))

    threads = [threading.Thread(target=hold_with_the_library) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for _ in range(20):
                    group.start_soon(hold_with_the_port)
    finally:
        for thread in threads:
            thread.join(timeout=20)
        await client.aclose()
        sync.close()
    kinds = Counter(kind for _, _, kind in intervals)
    assert kinds["port"] > 20 and kinds["library"] > 5, kinds
    ordered = sorted(intervals)
    for (_, end, _), (start, _, _) in itertools.pairwise(ordered):
        assert start >= end, "two holders at once"


def test_choosers_are_deterministic_and_pairs_cross_shards() -> None:
    first = make_chooser("zipf", 10_000, random.Random(3))
    second = make_chooser("zipf", 10_000, random.Random(3))
    picks = [first()[0] for _ in range(2000)]
    assert picks == [second()[0] for _ in range(2000)]
    assert Counter(picks).most_common(1)[0][0] == 0  # rank 1 is the hottest account
    pairs = make_chooser("pairs", 1000, random.Random(4), shards=16)
    shards = shard_table(1000, 16)
    for _ in range(200):
        a, b = pairs()
        assert a != b and shards[a] != shards[b]


@pytest.mark.parametrize(("shards", "ranges"), [(16, 2), (16, 3), (7, 4), (5, 5), (16, 1)])
def test_a_shards_range_is_the_one_its_worker_is_given(shards: int, ranges: int) -> None:
    """``local-pairs`` and the cost table's crossing share split the shards as
    ``--split-shards`` gives them to the workers."""
    given = []
    for index in range(ranges):
        first, last = map(int, shard_range(shards, ranges, index).split("-"))
        given += [index] * (last - first + 1)
    assert [shard_range_of(shard, shards, ranges) for shard in range(shards)] == given


def test_local_transfers_refuse_a_split_that_leaves_a_worker_one_shard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workloads", "local-transfer", "--shards", "4", "--workers", "3", "--split-shards"]
    with pytest.raises(SystemExit):
        bench_main(argv)
    assert "local-transfer: 4 shards give a worker fewer than two" in capsys.readouterr().err


def test_local_pairs_stay_on_two_shards_of_one_workers_range() -> None:
    pairs = make_chooser("local-pairs", 1000, random.Random(5), shards=16, ranges=2)
    shards = shard_table(1000, 16)
    halves = Counter()
    for _ in range(400):
        a, b = pairs()
        assert a != b and shards[a] != shards[b]
        assert shards[a] // 8 == shards[b] // 8
        halves[shards[a] // 8] += 1
    assert set(halves) == {0, 1}  # both workers' ranges are used


def test_percentiles_and_commandstats() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([float(n) for n in range(1, 1001)], 99.9) == 999.0
    info = {"cmdstat_get": {"calls": 3, "usec": 1}, "cmdstat_set": {"calls": 1}}
    calls = parse_commandstats(info)
    assert calls == Counter({"get": 3, "set": 1})


def test_shard_ranges_split_every_shard_once_in_order() -> None:
    for shards, workers in [(16, 2), (16, 3), (4, 4), (5, 2), (16, 1)]:
        owned = []
        for index in range(workers):
            first, last = (int(n) for n in shard_range(shards, workers, index).split("-"))
            owned += list(range(first, last + 1))
        assert owned == list(range(shards)), (shards, workers)
    assert [shard_range(16, 3, i) for i in range(3)] == ["0-5", "6-10", "11-15"]


@pytest.mark.slow
def test_split_shards_gives_each_worker_its_own_range(tmp_path: Path) -> None:
    """Two workers splitting 16 shards (on uvloop): cross-shard transfers then mix the
    one-script path and grant requests between the workers; nothing is lost either way."""
    command = [
        sys.executable, "-m", "keyserial", "bench", "--workloads", "transfer",
        "--systems", "keyserial", "--workers", "2", "--split-shards", "--duration", "0.3",
        "--warmup", "0.1", "--callers", "4", "--no-chart", "--out", str(tmp_path),
        "--event-loop", "uvloop",
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "2 worker process, 16 shards split between them on uvloop" in completed.stdout
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    assert document["config"]["event_loop"] == "uvloop"
    [run] = document["results"]
    assert run["status"] == "ok" and run["throughput"] > 0
    assert run["correctness"]["lost_updates"] == 0 and run["correctness"]["accounts_wrong"] == 0


@pytest.mark.slow
def test_a_cluster_run_sums_its_masters_and_says_which_systems_cannot_run_there(
    tmp_path: Path,
) -> None:
    """``--cluster 3``: keyserial and the redis-py lock run against three masters (commands
    and server CPU summed over them, every key deleted afterwards); a transfer in one Lua
    script and python-redis-lock cannot run on a cluster, and their rows say why."""
    command = [
        sys.executable, "-m", "keyserial", "bench", "--cluster", "3", "--workloads", "transfer",
        "--systems", "keyserial,lock-tuned,lock-notify,lua,keyserial-durable", "--workers", "2",
        "--split-shards", "--duration", "0.3", "--warmup", "0.1", "--callers", "4",
        "--no-chart", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "(a cluster of 3 masters; server CPU sums them)" in completed.stdout
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    assert document["server"]["cluster_masters"] == 3
    measured = [r for r in document["results"] if r["status"] == "ok"]
    assert {r["system"] for r in measured} == {"keyserial", "lock-tuned"}
    for run in measured:
        assert run["throughput"] > 0 and run["cpu"]["server"]["percent"] is not None, run
        assert run["correctness"]["lost_updates"] == 0, run["correctness"]
        assert run["correctness"]["accounts_wrong"] == 0
        if run["system"] == "lock-tuned":
            # two locks, a GET and a SET per account, two releases: on three masters, which
            # one node's statistics would show a third of
            assert run["commands_per_op"] >= 8, run["commands"]
    reasons = {r["system"]: r["reason"] for r in document["results"] if r["status"] == "skipped"}
    assert reasons["lua"].startswith("n/a on a cluster: one script cannot touch two accounts")
    assert "python-redis-lock's release script" in reasons["lock-notify"]
    assert reasons["keyserial-durable"].startswith("not run on a cluster")


@pytest.mark.slow
def test_split_shards_refuses_more_workers_than_shards(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "keyserial", "bench", "--workloads", "hot", "--shards", "2",
        "--workers", "3", "--split-shards", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2
    assert "--split-shards: 3 workers cannot split 2 shards" in completed.stderr


def _measured(run_id: str, system: str, throughput: float, **changes: object) -> dict[str, object]:
    record: dict[str, object] = {
        "run_id": run_id, "workload": "uniform", "system": system, "variant": {}, "round": 1,
        "status": "ok", "throughput": throughput, "latency_ms": {"p99": 5.0},
        "correctness": {"lost_updates": 0},
    }  # fmt: skip
    record.update(changes)
    return record


def test_each_system_counts_by_its_median_round() -> None:
    runs = [
        _measured("r1", "keyserial", 900.0),
        _measured("r2", "lua", 5.0),
        _measured("r3", "keyserial", 700.0, round=2),
        _measured("r4", "lua", 3.0, round=2),
        _measured("r5", "keyserial", 800.0, round=3),
        {**_measured("r6", "lua", 0.0, round=3), "status": "failed"},
        _measured("r7", "lock-default", 100.0, workload="hot"),
    ]
    keyserial, lua, once = median_rounds(runs)
    assert keyserial["run_id"] == "r5" and keyserial["throughput"] == 800.0
    assert [r["throughput"] for r in keyserial["rounds"]] == [900.0, 700.0, 800.0]
    assert lua["run_id"] == "r4"  # of two measured rounds, the lower middle one
    assert lua["rounds"][2] == {"run_id": "r6", "status": "failed"}
    assert once is runs[6] and "rounds" not in once  # measured once: passed through


def test_rounds_run_back_to_back_per_workload() -> None:
    args = build_parser().parse_args(
        ["--profile", "full", "--workloads", "uniform,slow", "--systems", "keyserial,lua"]
    )
    config = config_from(args)
    assert config.rounds == 3  # the full profile's
    order = [(s.workload, s.round, s.system) for s in plan(config, "redis://x", "t")]
    uniform = [("uniform", r, s) for r in (1, 2, 3) for s in ("keyserial", "lua")]
    assert order[:6] == uniform
    assert {(w, r) for w, r, _ in order[6:]} == {("slow", 1)}  # slow I/O: one round


@pytest.mark.slow
def test_rounds_end_to_end(tmp_path: Path) -> None:
    """Two rounds of uniform keys: the JSON keeps every run, the table each system's median
    round and every round's throughput, and the no-lock losses of every round are reported."""
    command = [
        sys.executable, "-m", "keyserial", "bench", "--workloads", "uniform",
        "--systems", "keyserial,no-lock", "--rounds", "2", "--duration", "0.3",
        "--warmup", "0.1", "--callers", "4", "--no-chart", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "uniform × keyserial, round 2" in completed.stderr
    document = json.loads((tmp_path / "bench-quick.json").read_text())
    assert [(r["system"], r["round"]) for r in document["runs"]] == [
        ("keyserial", 1), ("no-lock", 1), ("keyserial", 2), ("no-lock", 2),
    ]  # fmt: skip
    assert [r["system"] for r in document["results"]] == ["keyserial", "no-lock"]
    for record in document["results"]:
        assert [t["run_id"] for t in record["rounds"]] == [
            r["run_id"] for r in document["runs"] if r["system"] == record["system"]
        ]
        assert record["run_id"] in {t["run_id"] for t in record["rounds"]}
    assert "Each round's ops/s, in run order" in completed.stdout
    targets = {t["id"]: t for t in document["targets"]}
    assert targets["keyserial-no-lost-updates"]["measured"].endswith("in 2 runs")
    assert "uniform round 2:" in targets["no-lock-lost-updates-reported"]["measured"]


def test_a_run_without_out_writes_a_folder_of_its_own_never_the_published_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keyserial bench`` run from a checkout must not overwrite the tracked results: without
    ``--out``, each run gets ``keyserial-bench/<date-time>/`` in the working directory."""
    monkeypatch.chdir(tmp_path)
    config = config_from(build_parser().parse_args([]))
    assert config.out_dir.parent == Path("keyserial-bench")
    assert config.out_dir.resolve() != RESULTS_DIR
    assert RESULTS_DIR not in config.out_dir.resolve().parents
    chosen = config_from(build_parser().parse_args(["--out", str(RESULTS_DIR)]))
    assert chosen.out_dir == RESULTS_DIR


_SPIN = {"op", "spin_s", "other_ops_during_spin", "p50_ms", "p99_ms", "max_ms", "leases_lost"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "arguments", "rows"),
    [
        ("keyspace", ["--keys", "300,600"], [{"distinct_keys", "rss_mib", "deposits_per_s"}] * 2),
        (
            "idle",
            ["--shards", "4,8", "--seconds", "0.5"],
            [{"shards", "worker_cpu_percent", "commands_per_s", "commands_per_shard_per_s"}] * 2,
        ),
        (
            "blocking",
            ["--spin", "0.3", "--lease-ttl", "1", "--callers", "2", "--cost-seconds", "0.3"],
            [
                _SPIN,
                _SPIN,
                {"quick_op_per_s_inline", "quick_op_per_s_thread", "thread_over_inline"},
            ],
        ),
    ],
)
def test_the_standalone_benchmark_scripts_run_and_print_a_row_per_point(
    script: str, arguments: list[str], rows: list[set[str]]
) -> None:
    """``python -m benchmarks.keyspace``, ``benchmarks.idle`` and ``benchmarks.blocking``, on
    tiny inputs: one JSON row per point, with the documented fields."""
    assert [set(row) for row in _rows_printed_by(script, arguments)] == rows


def _rows_printed_by(script: str, arguments: list[str]) -> list[dict[str, Any]]:
    """The JSON rows ``python -m benchmarks.<script>`` prints, one a line."""
    completed = _benchmark(script, arguments, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return [json.loads(line) for line in completed.stdout.splitlines()]


def _benchmark(
    script: str, arguments: list[str], *, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<script> <arguments>``, run to its end, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_lua_cost_benchmark_prints_each_shape_with_its_scripts_time() -> None:
    """``python -m benchmarks.lua_cost`` on a few calls: a row per shape and ops count, each with
    the server's time per call and its commands' (the step's confirm reads the inbox's head,
    and takes the pushed entry out: done with that step, it is appended nowhere)."""
    rows = _rows_printed_by("lua_cost", ["--calls", "20", "--ops", "1,4"])
    assert [row["shape"] for row in rows] == [
        shape
        for ops in (1, 4)
        for shape in (
            *(f"submit, {ops} ops", "step, idle", f"step, commit {ops} ops"),
            f"step, confirm 1 pushed entry of {ops} ops",
            f"step, confirm 1 pushed entry of {ops} ops, after a reshard",
        )
    ]
    assert all(row["calls"] == 19 and row["us_per_call"] > 0 for row in rows)
    assert "rpush" in rows[0]["commands_us_per_call"]  # (a client pushes to the inbox)
    assert {"lrange", "ltrim", "hset", "hmget"} <= set(rows[3]["commands_us_per_call"])
    assert "xadd" not in rows[3]["commands_us_per_call"]
    # After a reshard the step also looks its ops up in the layout before: two HMGET more.
    assert rows[3]["commands_per_call"]["hmget"] == 2
    assert rows[4]["commands_per_call"]["hmget"] == 4


@pytest.mark.slow
def test_the_blocking_benchmark_checks_its_target_and_says_so_in_its_exit_status() -> None:
    """``python -m benchmarks.blocking --check``: the plain op's row, then the verdict, which
    the exit status follows (the target itself is for a quiet machine: it is not asserted)."""
    check = ["--check", "--spin", "0.3", "--lease-ttl", "1", "--callers", "2"]
    completed = _benchmark("blocking", check, timeout=120)
    row, verdict = [json.loads(line) for line in completed.stdout.splitlines()]
    assert row["op"] == "plain" and row["other_ops_during_spin"] > 0
    assert set(verdict) == {"target", "p99_ms", "leases_lost", "met"}
    assert verdict["met"] == (row["p99_ms"] < 100 and row["leases_lost"] == 0)
    assert completed.returncode == (0 if verdict["met"] else 1), completed.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("where", [[], ["--cluster", "3"]], ids=["standalone", "cluster"])
def test_the_scaling_benchmark_writes_its_table_json_and_chart(
    tmp_path: Path, where: list[str]
) -> None:
    """``python -m benchmarks.scaling`` on one small point, on a standalone server and on a
    3-master cluster: a row per workload, in its three files."""
    point = ["--workers", "2", "--shards", "4", "--seconds", "0.3", "--out", str(tmp_path), *where]
    completed = _benchmark("scaling", point, timeout=180)
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert [(row["workers"], row["shards"], row["workload"]) for row in rows] == [
        (2, 4, "uniform"),
        (2, 4, "transfer"),
    ]
    assert all(row["ops_per_s"] > 0 and row["workers_us_per_op"] for row in rows)
    assert "| 2 | 4 |" in (tmp_path / "scaling.md").read_text()
    assert (tmp_path / "scaling.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_the_cost_table_derives_a_crossing_transfer_from_the_mix() -> None:
    """``benchmarks.cost``: about half of the bench's transfers cross two workers' halves of
    16 shards, and the crossing cost is what the measured mix leaves once the share that stays
    in one worker is taken out at its own cost."""
    share = cost.crossing_share()
    assert 0.45 < share < 0.6
    within = {"commands": 10.0, "workers_us": 100.0, "ops_per_s": 5000}
    crossing = {"commands": 30.0, "workers_us": 500.0, "ops_per_s": 1000}
    mix = {key: share * crossing[key] + (1 - share) * within[key] for key in within}
    derived = cost.derived_between(mix, within, share)
    assert derived["commands"] == pytest.approx(30.0, abs=0.1)
    assert derived["workers_us"] == pytest.approx(500.0, abs=0.1)
    assert derived["ops_per_s"] is None  # (a throughput of a mix cannot be split)


def _bench_result(workload: str, system: str, workers_us: float, commands: float) -> dict[str, Any]:
    return {
        "workload": workload,
        "system": system,
        "status": "ok",
        "ops_in_window": 1000,
        "throughput": 1000.0,
        "commands": {"publish": 500},
        "commands_per_op": commands,
        "script_calls_per_op": 1.0,
        "cpu": {
            "clients": {"us_per_op": 50.0},
            "workers": {"us_per_op": workers_us},
            "server": {"us_per_op": 20.0},
        },
    }


def test_the_cost_table_derives_a_crossing_transfer_from_the_local_transfers_of_its_run() -> None:
    """The transfers that stay within a worker are taken out at their cost in the same
    two-worker run (smaller steps than one worker's), not at one worker's."""
    share = cost.crossing_share()
    mix = share * 900 + (1 - share) * 300
    runs = {
        "one worker": [_bench_result("transfer", "keyserial", 200.0, 9.0)],
        "two workers": [
            _bench_result("transfer", "keyserial", mix, 15.0),
            _bench_result("local-transfer", "keyserial", 300.0, 11.0),
        ],
        "cluster": [],
    }
    rows = {(row["kind"], row["note"]): row for row in cost.rows_of(runs)}
    assert rows["transfer in one of two workers", ""]["workers_us"] == 300.0
    derived = rows["transfer between workers", f"derived: the {share:.0%} that cross"]
    assert derived["workers_us"] == pytest.approx(900.0, abs=0.1)


def test_the_cost_table_names_each_op_kind_and_system_in_one_row() -> None:
    row = {"kind": "single key", "system": "lua", "round_trips": 1, "note": ""}
    row |= dict.fromkeys(cost.figures_keys(), 1.5) | {"workers_us": None, "ops_per_s": 4321}
    text = cost.markdown([row], "python -m benchmarks.cost")
    assert (
        text.splitlines()[-1]
        == "| single key | Lua script | 1 | 1.5 | 1.5 | 1.5 | 1.5 | — | 1.5 | 4,321 |"
    )


def test_the_cost_table_runs_only_the_workloads_of_the_kinds_asked_for() -> None:
    every = {shape.name for shape in cost.SHAPES}
    (single,) = cost.shapes_for(every, {"single key"})
    assert (single.name, single.workloads) == ("one worker", ("uniform",))
    assert [shape.name for shape in cost.shapes_for({"cluster"}, set(cost.KIND_WORKLOADS))] == [
        "cluster"
    ]
    assert cost.shapes_for(every, set(cost.KIND_WORKLOADS)) == list(cost.SHAPES)


def test_the_cost_table_refuses_an_unknown_op_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cost.main(["--kinds", "single key,hot key"])
    assert "unknown op kinds: hot key" in capsys.readouterr().err


def test_the_calls_table_derives_a_crossing_transfer_as_the_cost_table_does() -> None:
    """From the transfers in one of the two workers where measured, else one worker's."""
    share = cost.crossing_share()

    def figures(workers: float) -> dict[str, dict[str, float]]:
        return {"workers": {"python": workers, "c": 0.0}, "client": {"python": 1.0, "c": 0.0}}

    measured = {
        "transfer in one worker": figures(100.0),
        "transfer in one of two workers": figures(200.0),
        "transfer between workers": figures(share * 600.0 + (1 - share) * 200.0),
    }
    derived = calls.rows_of(measured)[-1]
    assert derived["kind"].startswith("transfer between workers (derived")
    assert derived["workers"]["python"] == pytest.approx(600.0, abs=0.1)
    del measured["transfer in one of two workers"]
    measured["transfer between workers"] = figures(share * 600.0 + (1 - share) * 100.0)
    assert calls.rows_of(measured)[-1]["workers"]["python"] == pytest.approx(600.0, abs=0.1)


@pytest.mark.slow
def test_the_calls_table_counts_each_kind_s_python_and_c_calls_per_op(tmp_path: Path) -> None:
    """``benchmarks.calls``: each process is profiled for the measured ops only (a worker
    between its two signals), and a transfer costs the worker more calls than a deposit."""
    command = [
        sys.executable, "-m", "benchmarks.calls", "--ops", "400", "--accounts", "300",
        "--kinds", "single key,transfer in one worker", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    rows = {row["kind"]: row for row in json.loads((tmp_path / "calls.json").read_text())}
    single, transfer = rows["single key"], rows["transfer in one worker"]
    # (The funding deposits, 300 of them, and the workers' start are outside the window: a
    # worker profiled from its start makes thousands of calls per op of 400.)
    assert 20 < single["workers"]["python"] < transfer["workers"]["python"] < 1_000
    assert 20 < single["client"]["python"] < 1_000
    assert single["workers"]["c"] > 0 and single["client"]["c"] > 0
    table = (tmp_path / "calls.md").read_text()
    assert "| single key | " in table and "| transfer in one worker | " in table


@pytest.mark.slow
def test_the_calls_by_module_tables_split_a_kind_s_worker_python_calls(tmp_path: Path) -> None:
    """``benchmarks.calls --by-module N``: the N modules with the most worker Python calls per
    op, largest first, out of all the modules, which sum to the kind's Python calls per op;
    ``--by-function N`` the same by function."""
    command = [
        sys.executable, "-m", "benchmarks.calls", "--ops", "400", "--accounts", "300",
        "--kinds", "single key", "--by-module", "6", "--by-function", "8", "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-4000:]
    [single] = json.loads((tmp_path / "calls.json").read_text())
    [table] = json.loads((tmp_path / "calls-by-module.json").read_text())
    figures = [row["python"] for row in table["rows"]]
    assert table["kind"] == "single key" and len(figures) == 6 < table["modules"]
    assert "keyserial/_worker/runner.py" in [row["module"] for row in table["rows"]]
    assert figures == sorted(figures, reverse=True) and figures[-1] > 0
    assert abs(table["python"] - single["workers"]["python"]) <= 0.1
    assert sum(figures) <= single["workers"]["python"] + 0.05 * len(figures)
    text = (tmp_path / "calls.md").read_text()
    assert "### single key: the workers' Python calls per op by module" in text
    assert "| `keyserial/_worker/runner.py` | " in text
    [by_function] = json.loads((tmp_path / "calls-by-function.json").read_text())
    figures = [row["python"] for row in by_function["rows"]]
    assert len(figures) == 8 < by_function["functions"]
    assert figures == sorted(figures, reverse=True) and figures[-1] > 0
    assert abs(by_function["python"] - single["workers"]["python"]) <= 0.1
    names = [row["function"] for row in by_function["rows"]]
    assert any(name.startswith("keyserial/_worker/runner.py :") for name in names), names
    assert "### single key: the workers' Python calls per op by function" in text


def test_the_calls_by_module_names_a_function_s_module() -> None:
    """The repository's modules by path, the rest by package, generated inits apart."""

    @dataclasses.dataclass
    class Point:
        x: int

    assert calls.module_of(calls.module_of.__code__) == "benchmarks/calls.py"
    assert calls.module_of(Point.__init__.__code__) == calls.GENERATED_INIT
    assert calls.module_of(asyncio.sleep.__code__) == "asyncio"
    assert calls.module_of(anyio.sleep.__code__) == "anyio"
    assert calls.module_of(os.path.join.__code__) == "posixpath"  # (frozen)


@pytest.mark.slow
def test_the_timers_benchmark_prints_each_phase_and_checks_its_target() -> None:
    """``python -m benchmarks.timers --check`` on small counts: each phase's lateness, the
    memory of the pending timers, then the verdict, which the exit status follows (the target
    itself is for a quiet machine: it is not asserted)."""
    small = ["--timers", "40", "--burst", "200", "--million", "3000", "--check"]
    completed = _benchmark("timers", small, timeout=300)
    *phases, memory, verdict = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [phase["phase"] for phase in phases] == ["idle", "under load", "burst"]
    assert [phase["ops"] for phase in phases] == [40, 40, 200]
    assert all(0 <= phase["p50_ms"] <= phase["p99_ms"] <= phase["max_ms"] for phase in phases)
    assert memory["phase"] == "memory" and memory["timers"] == 3000
    assert memory["redis_bytes_per_timer"] > 0
    met = all(phase["p99_ms"] < 100 for phase in phases)
    assert verdict["met"] == met
    assert completed.returncode == (0 if met else 1), completed.stderr[-2000:]
