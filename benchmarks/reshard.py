"""A live reshard under load: ``python -m benchmarks.reshard``.

On a private server, two ``keyserial worker`` processes each serve half the shards of a
namespace holding ``--keys`` states; ``--callers`` callers in this process submit deposits on
random keys, each awaiting its last. Meanwhile ``keyserial.reshard`` moves the namespace from
``--from`` to ``--to`` shards. It reports how long the move took (and its parts: the old shards
draining, the copy of the states), the throughput before, during and after it (per 100 ms), the
longest wait of one op (the stall a key sees), and the same callers' p99 before the move, as a
baseline of the same run.

After a move, every new owner looks up each op it takes in, at the op's home in the layout
before, for twice ``result_ttl`` (a resubmit of an op committed before the move must not run
again). The run measures that cost against a namespace created at ``--to`` shards, with the same
keys and workers, in the same run: the callers' throughput, and one caller's median latency
(where an extra round trip per op shows most). Writes ``reshard.json`` and ``reshard.md`` to
``--out``."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

import keyserial
from keyserial._local.server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
BUCKET = 0.1


@dataclass
class Timeline:
    """When each op was acknowledged, and how long it waited."""

    done_at: list[float] = field(default_factory=list)
    waited: list[tuple[float, float]] = field(default_factory=list)

    def rate(self, begin: float, end: float) -> float:
        return sum(begin <= at < end for at in self.done_at) / max(end - begin, 1e-9)

    def p99(self, begin: float, end: float) -> float:
        waits = sorted(wait for at, wait in self.waited if begin <= at < end)
        return waits[int(0.99 * (len(waits) - 1))] if waits else 0.0


async def _callers(ks: keyserial.Client, keys: int, callers: int, stop: anyio.Event) -> Timeline:
    timeline = Timeline()

    async def caller(seed: int) -> None:
        pick = random.Random(seed)
        while not stop.is_set():
            began = time.monotonic()
            await ks.submit(f"acct:{pick.randrange(keys)}", keyserial.ledger.deposit(1), timeout=60)
            now = time.monotonic()
            timeline.done_at.append(now)
            timeline.waited.append((now, now - began))

    async with anyio.create_task_group() as group:
        for seed in range(callers):
            group.start_soon(caller, seed)
    return timeline


async def _populate(ks: keyserial.Client, keys: int) -> None:
    limit = anyio.Semaphore(256)

    async def one(n: int) -> None:
        async with limit:
            await ks.submit(f"acct:{n}", keyserial.ledger.deposit(100))

    async with anyio.create_task_group() as group:
        for n in range(keys):
            group.start_soon(one, n)


def _workers(url: str, namespace: str, shards: int) -> list[subprocess.Popen[bytes]]:
    half = shards // 2
    command = [sys.executable, "-m", "keyserial", "worker", "--redis", url]
    command += ["--namespace", namespace, "--shard-count", str(shards), "--log-level", "WARNING"]
    return [
        subprocess.Popen([*command, "--shards", spec], cwd=ROOT)
        for spec in (f"0-{half - 1}", f"{half}-{shards - 1}")
    ]


async def _one_caller(ks: keyserial.Client, keys: int, seconds: float) -> float:
    """One caller's median latency in ms: no batch hides an op's round trips."""
    pick, waits = random.Random(7), []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        began = time.monotonic()
        await ks.submit(f"acct:{pick.randrange(keys)}", keyserial.ledger.deposit(1), timeout=60)
        waits.append(time.monotonic() - began)
    return statistics.median(waits) * 1000


@contextlib.asynccontextmanager
async def _load(ks: keyserial.Client, args: argparse.Namespace) -> AsyncIterator[Timeline]:
    """The callers, running for the block."""
    stop, timeline = anyio.Event(), Timeline()

    async def run() -> None:
        ran = await _callers(ks, args.keys, args.callers, stop)
        timeline.done_at, timeline.waited = ran.done_at, ran.waited

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        yield timeline
        stop.set()


@contextlib.contextmanager
def _serving(url: str, namespace: str, shards: int) -> Iterator[None]:
    workers = _workers(url, namespace, shards)
    try:
        yield
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait()


async def _move_under_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    namespace = "reshard-bench"
    with _serving(url, namespace, args.source):
        async with keyserial.connect(url, namespace=namespace, shards=args.source) as ks:
            await _populate(ks, args.keys)
            async with _load(ks, args) as ops:
                await anyio.sleep(args.before)
                began = time.monotonic()
                done = await keyserial.reshard(
                    url, to=args.target, namespace=namespace, progress=print
                )
                ended = time.monotonic()
                assert done is not None, "the namespace had that many shards already"
                await anyio.sleep(args.after)
            one_caller_ms = await _one_caller(ks, args.keys, args.probe)
    start = ops.done_at[0]
    resumed = next((at for at in ops.done_at if at > ended), ended)
    return {
        "move_s": round(ended - began, 3),
        "drained_s": round(done.drained_s, 3),
        "copied_s": round(done.copied_s, 3),
        "first_op_after_flip_ms": round((resumed - ended) * 1000, 1),
        "longest_wait_ms": round(max(wait for _, wait in ops.waited) * 1000, 1),
        "p99_before_ms": round(ops.p99(start, began) * 1000, 2),
        "p99_after_ms": round(ops.p99(ended + 0.5, ended + args.after) * 1000, 2),
        "ops_per_s_before": round(ops.rate(start, began)),
        "ops_per_s_during": round(ops.rate(began, ended)),
        "ops_per_s_after": round(ops.rate(ended + 0.5, ended + args.after)),
        "one_caller_p50_ms_after": round(one_caller_ms, 3),
        "timeline_ops_per_s": [
            round(ops.rate(at, at + BUCKET)) for at in _buckets(start, ended + args.after)
        ],
    }


async def _never_moved(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same keys, callers and workers on a namespace created at ``--to`` shards."""
    namespace = "reshard-bench-baseline"
    with _serving(url, namespace, args.target):
        async with keyserial.connect(url, namespace=namespace, shards=args.target) as ks:
            await _populate(ks, args.keys)
            async with _load(ks, args) as ops:
                began = time.monotonic()
                await anyio.sleep(args.after)
            one_caller_ms = await _one_caller(ks, args.keys, args.probe)
    return {
        "baseline_ops_per_s": round(ops.rate(began + 0.5, began + args.after)),
        "baseline_p99_ms": round(ops.p99(began + 0.5, began + args.after) * 1000, 2),
        "baseline_one_caller_p50_ms": round(one_caller_ms, 3),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with LocalServer() as server:
        moved = await _move_under_load(server.url, args)
        baseline = await _never_moved(server.url, args)
    return {
        "from": args.source,
        "to": args.target,
        "keys": args.keys,
        "callers": args.callers,
        **moved,
        **baseline,
        "after_vs_baseline_ops_per_s": round(
            moved["ops_per_s_after"] / max(baseline["baseline_ops_per_s"], 1), 3
        ),
        "after_vs_baseline_one_caller_p50": round(
            moved["one_caller_p50_ms_after"] / baseline["baseline_one_caller_p50_ms"], 3
        ),
    }


def _buckets(begin: float, end: float) -> list[float]:
    count = int((end - begin) / BUCKET)
    return [begin + n * BUCKET for n in range(count)]


def _markdown(result: dict[str, Any]) -> str:
    rows = [
        ("move (record to flip)", f"{result['move_s']} s"),
        ("old shards drained in", f"{result['drained_s']} s"),
        (f"{result['keys']} states copied in", f"{result['copied_s']} s"),
        ("longest wait of one op (the stall)", f"{result['longest_wait_ms']} ms"),
        ("p99 before / after the move", f"{result['p99_before_ms']} / {result['p99_after_ms']} ms"),
        (
            "ops/s before / during / after",
            f"{result['ops_per_s_before']} / {result['ops_per_s_during']}"
            f" / {result['ops_per_s_after']}",
        ),
        (
            f"after the move ÷ a namespace created at {result['to']} shards: ops/s",
            f"{result['after_vs_baseline_ops_per_s']}× ({result['ops_per_s_after']}"
            f" / {result['baseline_ops_per_s']})",
        ),
        (
            "the same, one caller's median latency",
            f"{result['after_vs_baseline_one_caller_p50']}× ({result['one_caller_p50_ms_after']}"
            f" / {result['baseline_one_caller_p50_ms']} ms)",
        ),
    ]
    head = (
        f"Reshard {result['from']} -> {result['to']} shards, {result['keys']} keys,"
        f" {result['callers']} callers, two workers (`python -m benchmarks.reshard`)\n\n"
    )
    return head + "| | |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=int, default=4)
    parser.add_argument("--to", dest="target", type=int, default=16)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--before", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--probe", type=float, default=2.0, help="seconds of one caller")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "reshard")
    args = parser.parse_args()
    result = anyio.run(measure, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reshard.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "reshard.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
