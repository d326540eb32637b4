"""The issue's targets, checked against the figures of one run (ratios within that run only)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

from .config import LOCKS, is_keyserial

Record = dict[str, Any]


def find(results: Iterable[Record], workload: str, system: str, **variant: Any) -> Record | None:
    """The measured record of ``system`` on ``workload`` (the tuned lock: its best sleep)."""
    for record in results:
        if record["workload"] != workload or record["system"] != system:
            continue
        if record["status"] != "ok":
            continue
        if any(record["variant"].get(k) != v for k, v in variant.items()):
            continue
        if system == "lock-tuned" and not record.get("best_tuned"):
            continue
        return record
    return None


def best_lock(
    results: list[Record], workload: str, systems: Iterable[str] = LOCKS
) -> Record | None:
    """The lock with the highest throughput on ``workload``."""
    found = [r for s in systems if (r := find(results, workload, s)) is not None]
    return max(found, key=lambda r: r["throughput"], default=None)


def _target(
    target_id: str, text: str, measured: str, value: float | None, met: bool | None
) -> Record:
    return {"id": target_id, "target": text, "measured": measured, "value": value, "met": met}


def _not_run(target_id: str, text: str, why: str = "not run") -> Record:
    return _target(target_id, text, why, None, None)


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.inf


def evaluate(results: list[Record], slow_io: float, runs: list[Record]) -> list[Record]:
    """The targets, from each system's figures (``results``: its median round where the
    workload ran in rounds); lost updates are counted over every run (``runs``)."""
    targets = _hot(results)
    for workload in ("zipf", "uniform"):
        targets += _spread(results, workload)
    targets.append(_transfer(results))
    targets.append(_slow(results, slow_io))
    targets += _correctness(runs)
    return targets


def _throughput_ratio(
    results: list[Record], workload: str, baseline: Record | None, factor: float, label: str
) -> Record:
    target_id = f"{workload}-vs-{label.replace(' ', '-')}"
    text = f"{workload}: keyserial ≥ {factor:g}× the {label}'s throughput"
    ks = find(results, workload, "keyserial")
    if ks is None or baseline is None:
        return _not_run(target_id, text)
    ratio = _ratio(ks["throughput"], baseline["throughput"])
    measured = (
        f"{ratio:.2f}× ({ks['throughput']:,.0f} vs {baseline['throughput']:,.0f} ops/s,"
        f" {_name(baseline)})"
    )
    return _target(target_id, text, measured, ratio, ratio >= factor)


def _name(record: Record) -> str:
    if record["system"] == "lock-tuned":
        return f"lock-tuned sleep {record['variant'].get('sleep_ms')} ms"
    return str(record["system"])


def _hot(results: list[Record]) -> list[Record]:
    default = find(results, "hot", "lock-default")
    targets = [_throughput_ratio(results, "hot", default, 10, "default Lock")]
    text = "hot: keyserial p99 ≤ 1/10 of the default Lock's p99"
    ks = find(results, "hot", "keyserial")
    if ks is None or default is None:
        targets.append(_not_run("hot-p99-vs-default-Lock", text))
    else:
        ratio = _ratio(ks["latency_ms"]["p99"], default["latency_ms"]["p99"])
        measured = (
            f"{ratio:.3f} ({ks['latency_ms']['p99']:.1f} vs {default['latency_ms']['p99']:.1f} ms)"
        )
        targets.append(_target("hot-p99-vs-default-Lock", text, measured, ratio, ratio <= 0.1))
    best = best_lock(results, "hot", ("lock-tuned", "lock-notify"))
    targets.append(_throughput_ratio(results, "hot", best, 3, "best tuned or notification lock"))
    targets.append(_throughput_ratio(results, "hot", find(results, "hot", "lua"), 1, "Lua script"))
    return targets


def _spread(results: list[Record], workload: str) -> list[Record]:
    targets = [_throughput_ratio(results, workload, best_lock(results, workload), 2, "best lock")]
    text = f"{workload}: fewer Redis commands per op than any lock"
    ks = find(results, workload, "keyserial")
    locks = [r for s in LOCKS if (r := find(results, workload, s)) is not None]
    if ks is None or not locks:
        targets.append(_not_run(f"{workload}-commands", text))
        return targets
    fewest = min(locks, key=lambda r: r["commands_per_op"])
    measured = f"{ks['commands_per_op']:.2f} vs {fewest['commands_per_op']:.2f} ({_name(fewest)})"
    met = ks["commands_per_op"] < fewest["commands_per_op"]
    targets.append(_target(f"{workload}-commands", text, measured, ks["commands_per_op"], met))
    return targets


def _transfer(results: list[Record]) -> Record:
    skipped = next(
        (
            r
            for r in results
            if r["workload"] == "transfer" and r["system"] == "keyserial" and r["status"] != "ok"
        ),
        None,
    )
    if skipped is not None:
        return _not_run(
            "transfer-vs-best-lock",
            "transfer: keyserial ≥ 2× the best lock's throughput",
            skipped.get("reason", "not run"),
        )
    return _throughput_ratio(results, "transfer", best_lock(results, "transfer"), 2, "best lock")


def _slow(results: list[Record], slow_io: float) -> Record:
    text = "slow I/O: keyserial's throughput grows with the number of keys, not shards"
    runs = sorted(
        (r for r in results if r["workload"] == "slow" and r["system"] == "keyserial"),
        key=lambda r: r["variant"]["keys"],
    )
    runs = [r for r in runs if r["status"] == "ok"]
    if len(runs) < 2:
        return _not_run("slow-grows-with-keys", text)
    shards = runs[-1]["variant"]["shards"]
    shard_bound = shards / slow_io
    series = ", ".join(
        f"{r['variant']['keys']} key{'s' if r['variant']['keys'] != 1 else ''}:"
        f" {r['throughput']:,.0f}"
        for r in runs
    )
    growing = all(b["throughput"] > a["throughput"] for a, b in itertools.pairwise(runs))
    beyond = runs[-1]["variant"]["keys"] <= shards or runs[-1]["throughput"] > shard_bound
    measured = f"{series} ops/s ({shards} shards would cap at {shard_bound:,.0f})"
    value = runs[-1]["throughput"]
    return _target("slow-grows-with-keys", text, measured, value, growing and beyond)


def _correctness(runs: list[Record]) -> list[Record]:
    ks_runs = [r for r in runs if is_keyserial(r["system"]) and r["status"] == "ok"]
    lost = sum(r["correctness"]["lost_updates"] for r in ks_runs)
    ks = _target(
        "keyserial-no-lost-updates",
        "keyserial: zero lost updates in every run",
        f"{lost} lost in {len(ks_runs)} runs",
        float(lost),
        (lost == 0) if ks_runs else None,
    )
    none = [r for r in runs if r["system"] == "no-lock" and r["status"] == "ok"]
    parts = [
        f"{r['workload']}{_variant(r)}{_round(r)}: {r['correctness']['lost_updates']:,}"
        f" of {r['correctness']['acknowledged_ops']:,}"
        for r in none
    ]
    reported = _target(
        "no-lock-lost-updates-reported",
        "no lock: its lost updates reported",
        "; ".join(parts) or "not run",
        float(sum(r["correctness"]["lost_updates"] for r in none)) if none else None,
        True if none else None,
    )
    return [ks, reported]


def _variant(record: Record) -> str:
    if not record["variant"]:
        return ""
    return " (" + ", ".join(f"{k} {v}" for k, v in record["variant"].items()) + ")"


def _round(record: Record) -> str:
    return f" round {record['round']}" if record.get("round", 1) > 1 else ""
