"""Delayed ops: how late they run, and what a million pending ones cost.

``python -m benchmarks.timers [--timers 2000] [--burst 10000] [--million 1000000] [--check]``
starts a private server and one worker process (16 shards, ``--app benchmarks.ops``), then:

* **idle**: ``--timers`` delayed ops (``enqueue(..., at=...)``), due 0.5 to 2.5 s ahead, on
  1,000 keys, nothing else running;
* **under load**: the same while 32 callers deposit into 1,000 other keys, one op after another;
* **burst**: ``--burst`` delayed ops on as many keys, all due within one second (``at=``, spread
  over its 1,000 milliseconds: one timer each);

and prints each phase's lateness: from an op's due time (``at=``, rounded up to the millisecond
as the client sends it; ``delay=`` takes the same path, its due time read by the server at the
push) to when it ran (the op returns the worker's clock; Redis's, which decides, is the same
machine's). Then **memory**: ``--million`` delayed ops due in an hour pushed through the
submit script (the client's path), pipelined; once the worker has moved them all into its
shards' timers, Redis's ``used_memory`` per pending timer, and the worker's resident memory
before and after (it keeps one due time per shard, not the timers). ``--check`` exits 1 unless
every phase's p99 is under 100 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import anyio
import redis

import keyserial
from keyserial._scripts.submit import SubmitArgs
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 16
KEYS = 1000
#: The target of ``--check``: each phase's p99 lateness, in milliseconds.
P99_TARGET_MS = 100.0
STAMP = keyserial.call("bench_stamp")


def _percentiles(late: list[float]) -> dict[str, float]:
    ordered = sorted(late)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q))], 1)

    return {"ops": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}


async def _ran_at(
    ks: keyserial.Client, op_ids: dict[str, str], deadline: float
) -> dict[str, float]:
    """When each op ran (its ``stamp``), polled by op id until all have run."""
    ran: dict[str, float] = {}
    with anyio.fail_after(deadline):
        while len(ran) < len(op_ids):
            for op_id, key in op_ids.items():
                if op_id not in ran:
                    with contextlib.suppress(keyserial.ResultNotFound):
                        ran[op_id] = await ks.result(op_id, key=key)
            if len(ran) < len(op_ids):
                await anyio.sleep(0.2)
    return ran


async def _delayed(url: str, namespace: str, count: int, callers: int) -> dict[str, float]:
    """``count`` delayed ops, delays spread over 0.5 to 2.5 s, with ``callers`` depositing
    meanwhile; their lateness."""
    rng = random.Random(7)
    due: dict[str, float] = {}
    op_ids: dict[str, str] = {}
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        stop = anyio.Event()

        async def caller(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                await ks.submit(f"load:{pick.randrange(KEYS)}", deposit(1), timeout=60)

        async def enqueue(n: int) -> None:
            at, key = time.time() + rng.uniform(0.5, 2.5), f"late:{n % KEYS}"
            op_id = await ks.enqueue(key, STAMP, at=datetime.fromtimestamp(at), timeout=60)
            due[op_id], op_ids[op_id] = math.ceil(at * 1000) / 1000, key

        async with anyio.create_task_group() as group:
            for seed in range(callers):
                group.start_soon(caller, seed)
            async with anyio.create_task_group() as enqueues:
                for n in range(count):
                    enqueues.start_soon(enqueue, n)
            ran = await _ran_at(ks, op_ids, 120)
            stop.set()
    return _percentiles([ran[op_id] - due[op_id] for op_id in op_ids])


async def _burst(url: str, namespace: str, count: int) -> dict[str, float]:
    """``count`` ops on as many keys due within one second, each a timer of its own."""
    base = int(time.time()) + 3  # (enqueued well before)
    due: dict[str, float] = {}
    op_ids: dict[str, str] = {}
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:

        async def enqueue(n: int) -> None:
            at = base + (n % 1000) / 1000
            op_id = await ks.enqueue(f"burst:{n}", STAMP, at=datetime.fromtimestamp(at), timeout=60)
            due[op_id], op_ids[op_id] = math.ceil(at * 1000) / 1000, f"burst:{n}"

        async with anyio.create_task_group() as group:
            for n in range(count):
                group.start_soon(enqueue, n)
        assert time.time() < base, "enqueued before the burst was due"
        ran = await _ran_at(ks, op_ids, 120)
    row = _percentiles([ran[op_id] - due[op_id] for op_id in op_ids])
    row["all_ran_within_s"] = round(max(ran.values()) - base, 2)
    return row


def _used_memory(client: redis.Redis) -> int:
    memory: dict[str, int] = client.info("memory")  # type: ignore[assignment]
    return int(memory["used_memory"])


def _pending(client: redis.Redis, shard: ShardKeys) -> int:
    waiting: int = client.zcard(shard.timers)  # type: ignore[assignment]
    return waiting


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def _million(url: str, namespace: str, count: int, worker: int) -> dict[str, float]:
    """``count`` delayed ops due in an hour, pushed through the submit script; Redis's memory
    per pending timer and the worker's resident memory before and after."""
    client = redis.Redis.from_url(url)
    try:
        before_redis = _used_memory(client)
        before_rss = _rss_kb(worker)
        sha = SubmitArgs.SCRIPT.sha
        client.script_load(SubmitArgs.SCRIPT.text)
        pipe = client.pipeline(transaction=False)
        for n in range(count):
            shard = ShardKeys(namespace, n % SHARDS)
            envelope = json.dumps({"id": f"m-{n}", "key": f"m:{n}", "op": "bench_stamp"})
            # (Routed by shard, not key: the ops never run, and only their timers count.)
            pipe.evalsha(sha, 1, shard.inbox, 0, "1", f"[{envelope}]", "", "1", f"+{3_600_000 + n}")
            if n % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        waiting = 0
        deadline = time.monotonic() + 600
        while waiting < count and time.monotonic() < deadline:
            time.sleep(0.5)
            waiting = sum(_pending(client, ShardKeys(namespace, s)) for s in range(SHARDS))
        time.sleep(2.0)  # (a few idle polls: the worker has nothing in flight)
        after_redis = _used_memory(client)
        after_rss = _rss_kb(worker)
    finally:
        client.close()
    return {
        "timers": waiting,
        "redis_bytes_per_timer": round((after_redis - before_redis) / max(waiting, 1)),
        "redis_mib": round((after_redis - before_redis) / 2**20, 1),
        "worker_rss_mib_before": round(before_rss / 1024, 1),
        "worker_rss_mib_after": round(after_rss / 1024, 1),
    }


def _worker(url: str, namespace: str) -> subprocess.Popen[bytes]:
    flags = ["--redis", url, "--namespace", namespace, "--shard-count", str(SHARDS)]
    flags += ["--app", "benchmarks.ops", "--log-level", "ERROR"]
    return subprocess.Popen([sys.executable, "-m", "keyserial", "worker", *flags], cwd=ROOT)


async def _warm(url: str, namespace: str) -> None:
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        for n in range(SHARDS * 4):
            await ks.submit(f"warm:{n}", deposit(1), timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timers")
    parser.add_argument("--timers", type=int, default=2000, help="delayed ops per phase (0: skip)")
    parser.add_argument("--burst", type=int, default=10_000, help="ops due in one second (0: skip)")
    parser.add_argument("--million", type=int, default=1_000_000, help="pending timers (0: skip)")
    parser.add_argument("--callers", type=int, default=32, help="depositing callers under load")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 unless p99 < {P99_TARGET_MS:g} ms"
    )
    args = parser.parse_args(argv)
    met = True
    with LocalServer() as server:
        url, namespace = server.url, "timers"
        worker = _worker(url, namespace)
        try:
            anyio.run(_warm, url, namespace)
            rows: list[dict[str, object]] = []
            if args.timers:
                rows.append(
                    {"phase": "idle", **anyio.run(_delayed, url, namespace, args.timers, 0)}
                )
                loaded = anyio.run(_delayed, url, namespace, args.timers, args.callers)
                rows.append({"phase": "under load", **loaded})
            if args.burst:
                rows.append({"phase": "burst", **anyio.run(_burst, url, namespace, args.burst)})
            for row in rows:
                p99 = row["p99_ms"]
                met = met and isinstance(p99, float | int) and 0 <= p99 < P99_TARGET_MS
                print(json.dumps(row), flush=True)
            if args.million:
                memory = _million(url, namespace, args.million, worker.pid)
                print(json.dumps({"phase": "memory", **memory}), flush=True)
        finally:
            worker.terminate()
            worker.wait(60)
    if args.check:
        print(json.dumps({"target": f"p99 lateness < {P99_TARGET_MS:g} ms", "met": met}))
    return 0 if met or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
