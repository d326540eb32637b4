"""What ``keyserial.connect_sync`` costs per call, against the async client.

Both clients submit ``deposit(1)`` on uniform keys (1,000 accounts; ``--accounts 1``: one hot
key) to one ``keyserial worker`` process serving 16 shards of a private server, in a closed loop:
C callers, each waiting for its op before the next. The async client's callers are tasks on one
event loop; the sync client's are threads sharing one ``SyncClient`` (its calls cross to the
client's loop thread and back). For each client and caller count it prints ops/s, latency
p50/p99, the client process's CPU per op (every thread of it, the sync client's loop thread
included) and the worker process's.

Run from the root of a checkout:
python -m benchmarks.sync_client [--duration 3] [--callers 1,32] [--accounts 1000]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys

from .metrics import process_cpu_seconds

SHARDS = 16


@dataclass
class Figures:
    ops: int
    seconds: float
    cpu: float
    latencies: list[float]
    worker_cpu: float | None = None

    def row(self, client: str, callers: int) -> str:
        ordered = sorted(self.latencies)

        def at(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

        return (
            f"| {client} | {callers} | {self.ops / self.seconds:,.0f} | {at(0.5):.2f} |"
            f" {at(0.99):.2f} | {self.cpu / self.ops * 1e6:.0f} |"
            f" {'—' if self.worker_cpu is None else f'{self.worker_cpu / self.ops * 1e6:.0f}'} |"
        )


Run = Callable[[str, str, int, float, int], Figures]


def _key(rng: random.Random, accounts: int) -> str:
    return f"acct:{rng.randrange(accounts)}"


def run_async(url: str, namespace: str, callers: int, duration: float, accounts: int) -> Figures:
    latencies: list[float] = []

    async def caller(ks: keyserial.Client, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            started = time.perf_counter()
            await ks.submit(_key(rng, accounts), deposit(1))
            latencies.append(time.perf_counter() - started)

    async def main() -> Figures:
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            await ks.submit("acct:warm", deposit(1))
            cpu, began = time.process_time(), time.monotonic()
            async with anyio.create_task_group() as task_group:
                for seed in range(callers):
                    task_group.start_soon(caller, ks, seed, began + duration)
            return Figures(
                len(latencies), time.monotonic() - began, time.process_time() - cpu, latencies
            )

    return anyio.run(main)


def run_sync(url: str, namespace: str, callers: int, duration: float, accounts: int) -> Figures:
    latencies: list[float] = []
    with keyserial.connect_sync(url, shards=SHARDS, namespace=namespace) as ks:
        ks.submit("acct:warm", deposit(1))
        cpu, began = time.process_time(), time.monotonic()

        def caller(seed: int) -> None:
            rng = random.Random(seed)
            mine: list[float] = []
            while time.monotonic() < began + duration:
                started = time.perf_counter()
                ks.submit(_key(rng, accounts), deposit(1))
                mine.append(time.perf_counter() - started)
            latencies.extend(mine)

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return Figures(
            len(latencies), time.monotonic() - began, time.process_time() - cpu, latencies
        )


def _wait_for_owner(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 30
    while not all(client.exists(ShardKeys(namespace, s).lease) for s in range(SHARDS)):
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not take its shards within 30 s")
        time.sleep(0.05)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--callers", default="1,32", help="caller counts, comma-separated")
    parser.add_argument(
        "--accounts",
        type=int,
        default=1_000,
        help="accounts the callers pick from at random (1: one hot key)",
    )
    options = parser.parse_args()
    if options.accounts < 1:
        parser.error("--accounts must be at least 1")
    runs: list[tuple[str, Run]] = [
        ("async `connect`", run_async),
        ("sync `connect_sync`", run_sync),
    ]
    print("| client | callers | ops/s | p50 ms | p99 ms | client CPU µs/op | worker CPU µs/op |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with LocalServer() as server:
        for number, callers in enumerate(int(c) for c in options.callers.split(",")):
            for name, run in runs:
                namespace = f"syncbench{number}{name[:4].strip()}{os.getpid()}"
                worker = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "keyserial",
                        "worker",
                        "--redis",
                        server.url,
                        "--namespace",
                        namespace,
                        "--shard-count",
                        str(SHARDS),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                try:
                    _wait_for_owner(server.url, namespace)
                    before = process_cpu_seconds(worker.pid)
                    figures = run(
                        server.url, namespace, callers, options.duration, options.accounts
                    )
                    after = process_cpu_seconds(worker.pid)
                    if before is not None and after is not None:
                        figures.worker_cpu = after - before
                    print(figures.row(name, callers), flush=True)
                finally:
                    worker.terminate()
                    worker.wait(timeout=30)


if __name__ == "__main__":
    main()
