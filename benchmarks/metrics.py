"""Measurements: latency percentiles, ``INFO commandstats`` diffs, CPU time of processes.

CPU comes from ``/proc/<pid>/stat`` (the keyserial workers), ``time.process_time`` (each client
process measures itself) and ``INFO cpu`` (the server, so a remote ``--redis`` server works too).
No psutil.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

#: Commands the harness itself sends during a measured window; never charged to a system.
HARNESS_COMMANDS = frozenset({"info", "config|resetstat", "config|get", "ping"})

PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p99", 99.0),
    ("p99_9", 99.9),
)


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (``nan`` if empty)."""
    if not ordered:
        return math.nan
    # round() first: 99.9 / 100 * 1000 is 999.0000000000001 in binary floating point
    rank = max(1, math.ceil(round(pct / 100.0 * len(ordered), 9)))
    return ordered[min(rank, len(ordered)) - 1]


def latency_summary(samples: Sequence[float]) -> dict[str, float]:
    """Percentiles, mean and max of latencies in seconds, reported in milliseconds."""
    ordered = sorted(samples)
    summary = {name: percentile(ordered, pct) * 1000 for name, pct in PERCENTILES}
    summary["mean"] = (sum(ordered) / len(ordered) * 1000) if ordered else math.nan
    summary["max"] = ordered[-1] * 1000 if ordered else math.nan
    return summary


def parse_commandstats(info: Mapping[str, Any]) -> Counter[str]:
    """``{"get": 12, "evalsha": 3, ...}`` from redis-py's parsed ``INFO commandstats``."""
    calls: Counter[str] = Counter()
    for name, stats in info.items():
        command = name.removeprefix("cmdstat_")
        calls[command] = int(stats["calls"]) if isinstance(stats, Mapping) else 0
    return calls


async def commandstats(redis: Redis) -> Counter[str]:
    return parse_commandstats(await redis.info("commandstats"))


def diff_commands(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    """Calls per command between two snapshots, without the harness's own commands."""
    delta = {
        name: after[name] - before.get(name, 0)
        for name in after
        if name not in HARNESS_COMMANDS and after[name] - before.get(name, 0) > 0
    }
    return dict(sorted(delta.items(), key=lambda item: -item[1]))


SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})


def command_figures(calls: Mapping[str, int], ops: int) -> dict[str, float]:
    """Per-op figures of a window's command counts.

    ``commands_per_op`` counts every command the server ran, those run inside scripts included
    (``INFO commandstats`` counts both): the server's work per op. ``script_calls_per_op`` counts
    the script invocations among them.
    """
    total = sum(calls.values())
    scripts = sum(count for name, count in calls.items() if name in SCRIPT_COMMANDS)
    if ops <= 0:
        return {"commands_per_op": math.nan, "script_calls_per_op": math.nan}
    return {"commands_per_op": total / ops, "script_calls_per_op": scripts / ops}


async def server_cpu_seconds(redis: Redis) -> float:
    """User + system CPU seconds the server process has used (``INFO cpu``)."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, from ``/proc`` (``None`` where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # Fields 14 and 15 of proc(5), counted after the ")" that ends the command name.
    return (int(fields[11]) + int(fields[12])) / ticks


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``; ``None`` elsewhere).

    The difference over a window, less the CPU of the run's own processes, is what other
    processes on the machine took meanwhile: noise that the run's figures do not show.
    """
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    # guest time is already counted in user time
    busy = sum(fields[:8]) - idle
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_figures(seconds: float | None, window: float, ops: int) -> dict[str, float | None]:
    """CPU as a percentage of one core over the window, and in microseconds per op."""
    if seconds is None or window <= 0:
        return {"percent": None, "us_per_op": None}
    return {
        "percent": 100.0 * seconds / window,
        "us_per_op": (seconds / ops * 1e6) if ops else None,
    }
