"""Repeated rounds of the main workloads, combined into one figure per system: the median round.

This machine's speed drifts by tens of percent over a minute (a shared VM), and one run per
system puts each system at a different moment: the same suite measured the best lock on uniform
keys at 2,101 ops/s in one run and 3,468 in another. Rounds run back to back per workload (every
system once, then every system again), so each system samples the same stretch of time, and the
median round of each system stands for it, for keyserial and every baseline alike. Every round
is kept in the JSON (``runs``), and correctness is checked over every round, not the median.
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]

#: Workloads whose runs are repeated: those with ratio targets between systems. (The slow-I/O
#: target compares keyserial with itself, and the sweep is a curve: one round each.)
REPEATED: tuple[str, ...] = ("hot", "zipf", "uniform", "transfer", "local-transfer")


def median_rounds(runs: list[Record]) -> list[Record]:
    """One record per workload variant × system: the round with the median throughput (the
    lower of the two middle ones for an even count), with every round's figures under
    ``rounds``. Systems measured once pass through unchanged."""
    groups: dict[str, list[Record]] = {}
    for record in runs:
        identity = f"{record['workload']}|{record['system']}|{sorted(record['variant'].items())}"
        groups.setdefault(identity, []).append(record)
    combined = []
    for group in groups.values():
        if len(group) == 1:
            combined.append(group[0])
            continue
        measured = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["throughput"])
        chosen = measured[(len(measured) - 1) // 2] if measured else group[0]
        combined.append({**chosen, "rounds": [_summary(r) for r in group]})
    return combined


def _summary(record: Record) -> Record:
    if record["status"] != "ok":
        return {"run_id": record["run_id"], "status": record["status"]}
    return {
        "run_id": record["run_id"],
        "status": "ok",
        "throughput": record["throughput"],
        "p99_ms": record["latency_ms"]["p99"],
        "lost_updates": record["correctness"]["lost_updates"],
    }
