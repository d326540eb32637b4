"""The worker app of the benchmarks: ``keyserial worker --app benchmarks.ops``.

``slow_deposit`` is the slow-I/O workload's op: it reads the balance, waits on I/O while it holds
the key (a slow API call, here ``anyio.sleep``), then writes. The lock baselines do the same wait
while they hold their lock. As an ``async`` op it holds its key, not its shard: ops on other keys
of the shard run meanwhile.

``cpu_spin`` and ``cpu_spin_inline`` keep a core busy for a while, as a plain sync op (run in a
worker thread) or declared ``inline=True`` (run on the worker's event loop); ``add`` and
``add_inline`` are a quick op both ways: ``python -m benchmarks.blocking``.

``deposit_in_thread`` and ``transfer_in_thread`` are the ledger's deposit and transfer as a user
writes them, with no declaration (run in a worker thread; the ledger's are declared inline):
the ``keyserial-thread`` system of ``keyserial bench``.

``stamp`` returns when it ran: the lateness of delayed ops, ``python -m benchmarks.timers``.
"""

from __future__ import annotations

import time

import anyio

import keyserial
from keyserial import InsufficientFunds

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


@keyserial.op(name="bench_cpu_spin")
def cpu_spin(ctx: keyserial.Context, seconds: float) -> float:
    """CPU-bound for ``seconds``, a plain sync op: it runs in a worker thread."""
    return _spin(seconds)


@keyserial.op(name="bench_cpu_spin_inline", inline=True)
def cpu_spin_inline(ctx: keyserial.Context, seconds: float) -> float:
    """The same op declared inline (wrongly: it is not quick): it runs on the event loop."""
    return _spin(seconds)


@keyserial.op(name="bench_add")
def add(ctx: keyserial.Context, amount: int) -> int:
    """A quick op, plain: add ``amount`` to the key's count, in a worker thread."""
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)


@keyserial.op(name="bench_add_inline", inline=True)
def add_inline(ctx: keyserial.Context, amount: int) -> int:
    """:func:`add` declared inline: on the event loop, no thread hop."""
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)


@keyserial.op(name="bench_deposit_thread")
def deposit_in_thread(ctx: keyserial.Context, amount: int) -> int:
    """The ledger's ``deposit``, undeclared: add ``amount`` to the balance, in a thread."""
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)


@keyserial.multi_op(name="bench_transfer_thread")
def transfer_in_thread(ctx: keyserial.MultiContext, amount: int) -> int:
    """The ledger's ``transfer``, undeclared: move ``amount`` from the first key to the
    second (``InsufficientFunds`` if it holds less), in a thread; the source's new balance."""
    source, target = ctx.keys
    available = ctx.states[source] or 0
    if available < amount:
        raise InsufficientFunds(balance=available, amount=amount, key=source, op_id=ctx.op_id)
    ctx.states[source] = available - amount
    ctx.states[target] = (ctx.states[target] or 0) + amount
    return int(ctx.states[source])


@keyserial.op(name="bench_stamp", inline=True)
def stamp(ctx: keyserial.Context) -> float:
    """When it ran, by the worker's clock: ``python -m benchmarks.timers`` compares it with the
    op's due time (Redis runs on the same machine, so their clocks agree)."""
    ctx.state = (ctx.state or 0) + 1
    return time.time()
