"""The worker app of the benchmarks: ``keyserial worker --app benchmarks.ops``.

``slow_deposit`` is the slow-I/O workload's op: it reads the balance, waits on I/O while it holds
the key (a slow API call, here ``anyio.sleep``), then writes. The lock baselines do the same wait
while they hold their lock. As an ``async`` op it holds its key, not its shard: ops on other keys
of the shard run meanwhile.

``cpu_spin`` and ``cpu_spin_inline`` keep a core busy for a while, declared ``blocking=True`` (run
in a worker thread) or not (run on the worker's event loop): ``python -m benchmarks.blocking``.
"""

from __future__ import annotations

import time

import anyio

import keyserial

#: Seconds of I/O per op (what the lock baselines wait too).
SLOW_IO_SECONDS = 0.005


@keyserial.op(name="bench_slow_deposit")
async def slow_deposit(
    ctx: keyserial.Context, amount: int, io_seconds: float = SLOW_IO_SECONDS
) -> int:
    """Read the balance, wait ``io_seconds`` on I/O, write balance + ``amount``."""
    balance = ctx.state or 0
    await anyio.sleep(io_seconds)
    ctx.state = balance + amount
    return int(ctx.state)


def _spin(seconds: float) -> float:
    """Keep a core busy in Python for ``seconds``; how long it took."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return time.perf_counter() - began


@keyserial.op(name="bench_cpu_spin", blocking=True)
def cpu_spin(ctx: keyserial.Context, seconds: float) -> float:
    """CPU-bound for ``seconds``, declared blocking: it runs in a worker thread."""
    return _spin(seconds)


@keyserial.op(name="bench_cpu_spin_inline")
def cpu_spin_inline(ctx: keyserial.Context, seconds: float) -> float:
    """The same op, not declared blocking: it runs on the worker's event loop."""
    return _spin(seconds)


@keyserial.op(name="bench_add")
def add(ctx: keyserial.Context, amount: int) -> int:
    """A quick op on the event loop: add ``amount`` to the key's count."""
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)


@keyserial.op(name="bench_add_blocking", blocking=True)
def add_blocking(ctx: keyserial.Context, amount: int) -> int:
    """:func:`add` declared blocking: what a thread hop costs a quick op."""
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)
