"""The worker app of the benchmarks: ``keyserial worker --app benchmarks.ops``.

``slow_deposit`` is the slow-I/O workload's op: it reads the balance, waits on I/O while it holds
the key (a slow API call, here ``anyio.sleep``), then writes. The lock baselines do the same wait
while they hold their lock. As an ``async`` op it holds its key, not its shard: ops on other keys
of the shard run meanwhile.
"""

from __future__ import annotations

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
