"""A client process: C concurrent callers of one system, timed, for one run at a time.

Started by :mod:`benchmarks.procs` as ``python -m benchmarks.agent INDEX`` and driven with JSON
lines on stdin; it answers with JSON lines on stdout (logs go to stderr):

* ``{"cmd": "prepare", "spec": {...}}`` — open the system (connect, pool): ``{"ready": true}``;
* ``{"cmd": "go", "start", "measure_from", "measure_until", "drain", "latency_path"}`` — wall
  clock times. Callers run from ``start``; ops that complete inside the measured window count
  for throughput and latency (the rest is warm-up or drain); at ``measure_until`` callers stop
  issuing ops, and ops still running ``drain`` seconds later are cancelled and reported as
  unfinished. Answer: the tally (every acknowledged op per account, for the correctness check);
  latencies go to ``latency_path`` as raw doubles (seconds);
* ``{"cmd": "exit"}``.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .config import RunSpec
from .systems import System, make_system
from .workloads import Chooser, make_chooser

Op = Callable[..., Awaitable[None]]


@dataclass(slots=True)
class Window:
    start: float
    measure_from: float
    measure_until: float
    drain: float


@dataclass(slots=True)
class Tally:
    """What the callers of one process did."""

    acked: Counter[int] = field(default_factory=Counter)
    slack: Counter[int] = field(default_factory=Counter)
    latencies: array[float] = field(default_factory=lambda: array("d"))
    acked_ops: int = 0
    window_ops: int = 0
    unfinished: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)

    def ack(self, deltas: tuple[tuple[int, int], ...], elapsed: float, window: Window) -> None:
        for account, delta in deltas:
            self.acked[account] += delta
        self.acked_ops += 1
        if window.measure_from <= time.time() < window.measure_until:
            self.window_ops += 1
            self.latencies.append(elapsed)

    def doubt(self, deltas: tuple[tuple[int, int], ...]) -> None:
        """An op that may or may not have applied (cancelled, or failed)."""
        for account, delta in deltas:
            self.slack[account] += abs(delta)

    def to_json(self) -> dict[str, Any]:
        return {
            "acked_ops": self.acked_ops,
            "window_ops": self.window_ops,
            "unfinished": self.unfinished,
            "errors": dict(self.errors),
            "cpu_seconds": self.cpu.get("until", 0.0) - self.cpu.get("from", 0.0),
            "acked": {str(k): v for k, v in self.acked.items()},
            "slack": {str(k): v for k, v in self.slack.items()},
        }


def bind_op(system: System, op: str) -> tuple[Op, Callable[[tuple[int, ...]], Any]]:
    """The system's op, and the balance change it makes to each account it names."""
    if op == "deposit":
        return system.deposit, lambda accounts: ((accounts[0], 1),)
    if op == "slow":
        return system.slow_deposit, lambda accounts: ((accounts[0], 1),)
    if op == "transfer":
        return system.transfer, lambda accounts: ((accounts[0], -1), (accounts[1], 1))
    raise ValueError(f"unknown op {op!r}")


async def _sleep_until(moment: float) -> None:
    await anyio.sleep(max(0.0, moment - time.time()))


async def _caller(op: Op, deltas_of: Any, chooser: Chooser, tally: Tally, window: Window) -> None:
    await _sleep_until(window.start)
    while time.time() < window.measure_until:
        accounts = chooser()
        deltas = deltas_of(accounts)
        started = time.perf_counter()
        try:
            await op(*accounts)
        except anyio.get_cancelled_exc_class():
            tally.unfinished += 1
            tally.doubt(deltas)
            raise
        except Exception as exc:
            tally.errors[f"{type(exc).__name__}: {exc}"[:200]] += 1
            tally.doubt(deltas)
            await anyio.sleep(0.01)  # a failing system must not spin the CPU
            continue
        tally.ack(deltas, time.perf_counter() - started, window)


async def _probe_cpu(tally: Tally, window: Window) -> None:
    await _sleep_until(window.measure_from)
    tally.cpu["from"] = time.process_time()
    await _sleep_until(window.measure_until)
    tally.cpu["until"] = time.process_time()


async def run_callers(spec: RunSpec, system: System, index: int, window: Window) -> Tally:
    """Run the spec's callers on ``system`` for the window; the tally of what they did."""
    op, deltas_of = bind_op(system, spec.op)
    tally = Tally()
    async with anyio.create_task_group() as probes:
        probes.start_soon(_probe_cpu, tally, window)
        with anyio.move_on_after(window.measure_until + window.drain - time.time()):
            async with anyio.create_task_group() as callers:
                for n in range(spec.callers):
                    rng = random.Random(f"{spec.seed}:{index}:{n}")
                    chooser = make_chooser(
                        spec.distribution,
                        spec.keys,
                        rng,
                        zipf_s=spec.zipf_s,
                        shards=spec.shards,
                        ranges=spec.shard_ranges,
                    )
                    callers.start_soon(_caller, op, deltas_of, chooser, tally, window)
    return tally


class Agent:
    def __init__(self, index: int) -> None:
        self.index = index

    def reply(self, message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    async def receive(self) -> dict[str, Any]:
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return {"cmd": "exit"}
        message: dict[str, Any] = json.loads(line)
        return message

    async def serve(self) -> None:
        while True:
            message = await self.receive()
            if message["cmd"] == "exit":
                return
            if message["cmd"] == "prepare":
                await self.run(RunSpec.from_json(message["spec"]))

    async def run(self, spec: RunSpec) -> None:
        """One run; any failure is answered as ``{"error": traceback}``, never a crash."""
        try:
            system = make_system(spec)
            await system.open()
        except Exception:
            self.reply({"error": traceback.format_exc()})
            return
        try:
            self.reply({"ready": True})
            go = await self.receive()
            if go["cmd"] != "go":
                return
            window = Window(go["start"], go["measure_from"], go["measure_until"], go["drain"])
            tally = await run_callers(spec, system, self.index, window)
            _save(tally.latencies, go["latency_path"])
        except Exception:
            self.reply({"error": traceback.format_exc()})
            return
        finally:
            # Not shielded: the system's own task groups (keyserial's client) must unwind in
            # the scope they were opened in.
            await system.close()
        self.reply({"done": True, **tally.to_json()})


def _save(latencies: array[float], path: str) -> None:
    with open(path, "wb") as out:
        latencies.tofile(out)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    anyio.run(Agent(int(sys.argv[1]) if len(sys.argv) > 1 else 0).serve)


if __name__ == "__main__":
    main()
