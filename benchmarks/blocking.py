"""A CPU-bound sync op beside the other keys: what its thread spares them, and what it costs.

``python -m benchmarks.blocking [--spin 5] [--lease-ttl 2] [--callers 16] [--check]`` starts a
private server and, for each way of running the op, a fresh namespace (16 shards) with one
worker process (``--app benchmarks.ops``). One caller submits a ``--spin``-second CPU-bound op
on one key, a plain sync op (``plain``: it runs in a worker thread) or one declared
``inline=True`` (``inline``: it runs on the worker's event loop); meanwhile ``--callers``
callers deposit into 1,000 other keys, one op after another. It prints, for each way, how many
of the other callers' ops were under way at some moment while the spin ran and their latency
(p50, p99, max), and how many shards changed owner (a lease lost: their epoch moved on). Then
what the thread costs an op that is quick: a one-line op's throughput from 64 callers, declared
inline and plain (``--cost-seconds`` each; 0 skips it). Compare within one run.

``--check`` measures the plain op only (no cost) and checks the target: while it spins, the
other keys' ops keep p99 under 100 ms and no lease is lost. It prints a last row saying
whether the target was met, and exits 1 if it was not.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import anyio
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 16
OTHER_KEYS = 1000
OPS = {"plain": "bench_cpu_spin", "inline": "bench_cpu_spin_inline"}
#: The target of ``--check``: the other keys' p99 while the plain op spins, in milliseconds.
P99_TARGET_MS = 100.0


def _epochs(url: str, namespace: str) -> list[bytes | None]:
    client = redis.Redis.from_url(url)
    try:
        return [client.get(ShardKeys(namespace, shard).epoch) for shard in range(SHARDS)]  # type: ignore[misc]
    finally:
        client.close()


async def _beside_a_spin(
    url: str, namespace: str, op: str, spin: float, callers: int
) -> dict[str, float]:
    """Run the spin and the other callers; the other keys' latencies while it ran."""
    timings: list[tuple[float, float]] = []
    window: dict[str, float] = {}
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        for n in range(0, OTHER_KEYS, 50):  # (warm: every key's state cached, every shard owned)
            await ks.submit(f"acct:{n}", deposit(1), timeout=60)

        async def caller(rng: random.Random) -> None:
            while "ended" not in window:
                began = time.monotonic()
                await ks.submit(f"acct:{rng.randrange(OTHER_KEYS)}", deposit(1), timeout=60)
                timings.append((began, time.monotonic()))

        async def spinner() -> None:
            await anyio.sleep(0.5)  # (the callers are under way)
            window["began"] = time.monotonic()
            await ks.submit("spinning", keyserial.call(op, spin), timeout=120)
            window["ended"] = time.monotonic()

        async with anyio.create_task_group() as group:
            for seed in range(callers):
                group.start_soon(caller, random.Random(seed))
            group.start_soon(spinner)
    # The ops under way at some moment while the spin ran, however long they took.
    latencies = sorted(
        ended - began
        for began, ended in timings
        if began < window["ended"] and ended > window["began"]
    )
    return {
        "spin_s": round(window["ended"] - window["began"], 2),
        "other_ops_during_spin": len(latencies),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else -1,
        "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1) if latencies else -1,
        "max_ms": round(1000 * latencies[-1], 1) if latencies else -1,
    }


def measure(url: str, way: str, spin: float, lease_ttl: float, callers: int) -> dict[str, object]:
    namespace = f"blocking-{way}"
    flags = ["--redis", url, "--namespace", namespace, "--shard-count", str(SHARDS)]
    flags += ["--lease-ttl", str(lease_ttl), "--app", "benchmarks.ops", "--log-level", "ERROR"]
    worker = subprocess.Popen([sys.executable, "-m", "keyserial", "worker", *flags], cwd=ROOT)
    try:
        anyio.run(_warm, url, namespace)
        before = _epochs(url, namespace)
        row = anyio.run(_beside_a_spin, url, namespace, OPS[way], spin, callers)
        time.sleep(lease_ttl)  # (a lease lost meanwhile has been taken again by now)
        after = _epochs(url, namespace)
    finally:
        worker.terminate()
        worker.wait(60)
    lost = sum(1 for old, new in zip(before, after, strict=True) if old != new)
    return {"op": way, **row, "leases_lost": lost}


async def _quick_ops_per_second(url: str, namespace: str, op: str, seconds: float) -> float:
    """Throughput of a quick op on 1,000 keys from 64 callers."""
    done = 0
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        deadline = time.monotonic() + seconds

        async def caller(rng: random.Random) -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await ks.submit(f"q:{rng.randrange(OTHER_KEYS)}", keyserial.call(op, 1))
                done += 1

        async with anyio.create_task_group() as group:
            for seed in range(64):
                group.start_soon(caller, random.Random(seed))
    return done / seconds


def quick_op_cost(url: str, seconds: float) -> dict[str, object]:
    """A quick op's throughput, declared inline and plain (in a thread), on one worker."""
    namespace = "blocking-cost"
    flags = ["--redis", url, "--namespace", namespace, "--shard-count", str(SHARDS)]
    flags += ["--app", "benchmarks.ops", "--log-level", "ERROR"]
    worker = subprocess.Popen([sys.executable, "-m", "keyserial", "worker", *flags], cwd=ROOT)
    try:
        anyio.run(_warm, url, namespace)
        rates = {
            way: anyio.run(_quick_ops_per_second, url, namespace, op, seconds)
            for way, op in (("inline", "bench_add_inline"), ("thread", "bench_add"))
        }
    finally:
        worker.terminate()
        worker.wait(60)
    return {
        "quick_op_per_s_inline": round(rates["inline"]),
        "quick_op_per_s_thread": round(rates["thread"]),
        "thread_over_inline": round(rates["thread"] / rates["inline"], 2),
    }


def verdict(row: dict[str, object]) -> dict[str, object]:
    """Whether a plain op's row meets the target of ``--check``."""
    p99, lost, others = row["p99_ms"], row["leases_lost"], row["other_ops_during_spin"]
    assert isinstance(p99, float | int) and isinstance(others, int)
    met = others > 0 and 0 <= p99 < P99_TARGET_MS and lost == 0
    return {
        "target": f"other keys' p99 < {P99_TARGET_MS:g} ms and no lease lost while a plain"
        " sync op spins",
        "p99_ms": p99,
        "leases_lost": lost,
        "met": met,
    }


async def _warm(url: str, namespace: str) -> None:
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        await ks.submit("warm", deposit(1), timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.blocking")
    parser.add_argument("--spin", type=float, default=5.0, help="the op's seconds of CPU")
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--callers", type=int, default=16, help="callers on the other keys")
    parser.add_argument("--ways", default=None, help="plain, inline, or both (default: both)")
    parser.add_argument(
        "--cost-seconds", type=float, default=3.0, help="seconds per way of the quick op (0: skip)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="the plain op only: exit 1 unless the other keys' p99 < 100 ms and no lease is lost",
    )
    args = parser.parse_args(argv)
    ways = (args.ways or ("plain" if args.check else "plain,inline")).split(",")
    met = True
    with LocalServer() as server:
        for way in ways:
            row = measure(server.url, way, args.spin, args.lease_ttl, args.callers)
            print(json.dumps(row), flush=True)
            if args.check and way == "plain":
                checked = verdict(row)
                met = met and bool(checked["met"])
                print(json.dumps(checked), flush=True)
        if args.cost_seconds and not args.check:
            print(json.dumps(quick_op_cost(server.url, args.cost_seconds)), flush=True)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
