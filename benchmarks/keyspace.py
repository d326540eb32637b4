"""A worker's memory against the number of distinct keys it has served.

``python -m benchmarks.keyspace [--keys 100000,1000000] [--max-cached-states N]`` starts a
private server and one worker process (16 shards), deposits once into each of the given number
of distinct keys (256 at a time, from one client), and reports the worker's resident memory
(``VmRSS``) and the deposits' throughput after each count. With the state cache bounded (the
default ``max_cached_states``, 10,000 per shard), the RSS levels off once every shard holds
that many; ``--max-cached-states 100000000`` shows it unbounded. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 16
CONCURRENCY = 256


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def deposit_into(url: str, first: int, last: int) -> float:
    """Deposit 1 into keys ``first`` .. ``last - 1``; the deposits per second."""
    began = time.monotonic()
    async with keyserial.connect(url, shards=SHARDS) as ks:
        next_key = first

        async def caller() -> None:
            nonlocal next_key
            while next_key < last:
                key, next_key = next_key, next_key + 1
                await ks.submit(f"account:{key}", deposit(1), timeout=60)

        async with anyio.create_task_group() as group:
            for _ in range(CONCURRENCY):
                group.start_soon(caller)
    return (last - first) / (time.monotonic() - began)


async def warm_up(url: str) -> None:
    """Once the worker owns every shard, a deposit on each is answered at once."""
    async with keyserial.connect(url, shards=SHARDS) as ks:
        for shard in range(SHARDS):
            key = next(f"warm:{n}" for n in range(10_000) if ks.shard_of(f"warm:{n}") == shard)
            await ks.submit(key, deposit(1), timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keyspace")
    parser.add_argument("--keys", default="100000,1000000", help="distinct-key counts, rising")
    parser.add_argument("--max-cached-states", type=int, default=None)
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.keys.split(",")]
    env = dict(os.environ)
    if args.max_cached_states is not None:
        env["KEYSERIAL_MAX_CACHED_STATES"] = str(args.max_cached_states)
    with LocalServer() as server:
        flags = ["--redis", server.url, "--shard-count", str(SHARDS), "--log-level", "WARNING"]
        worker = subprocess.Popen(
            [sys.executable, "-m", "keyserial", "worker", *flags],
            cwd=ROOT,
            env=env,
        )
        try:
            anyio.run(warm_up, server.url)
            rows: list[dict[str, float]] = []
            done = 0
            for count in counts:
                rate = anyio.run(deposit_into, server.url, done, count)
                done = count
                row = {"distinct_keys": count, "rss_mib": round(rss_mib(worker.pid), 1)}
                rows.append({**row, "deposits_per_s": round(rate)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            worker.terminate()
            worker.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
