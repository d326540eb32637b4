"""What one op costs, by kind, next to a lock and a Lua script: ``python -m benchmarks.cost``.

One ``keyserial bench`` run per deployment shape, each with keyserial, the redis-py lock (its
best tuned sleep) and the Lua script on the same private server, so every figure has its
baselines from the same run:

- **one worker** owning every shard: uniform deposits (a *single-key* op) and transfers
  between two random accounts (a *transfer in one worker*: one script across both shards);
- **two workers** splitting the shards (``--split-shards``): transfers, of which those whose
  shards fall in different ranges go *between workers* (the grant protocol), the others stay
  in one worker; and transfers kept within one worker's range (``local-transfer``: a
  *transfer in one of two workers*, which pays the split's smaller steps but not the grant
  protocol). The rows show the measured mix, and the per-op cost of a transfer between
  workers derived from it and the local transfers of the same run
  (``mix = f × between + (1 - f) × within``, ``f`` the share that crosses, counted from the
  shard ranges);
- **a cluster** of three masters, one worker: transfers (*on a cluster* every cross-shard op
  takes the grant protocol, one script cannot touch two hash slots).

Per op kind and system it prints the round trips on the caller's path (a count from the
design, not measured: sequential calls to Redis that the caller's answer waits on, with
the pub/sub messages that ride them), and measures the Redis commands (scripts' commands
included), script calls and pub/sub messages per op, and the CPU per op of the clients, the
workers and Redis. It writes ``cost.json`` and ``cost.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.workloads import shard_range_of, shard_table

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("keyserial", "lock-tuned", "lua")
#: Sequential calls to Redis on the caller's path, by op kind and system (see the docstring):
#: keyserial's append, then the owner's step or script that commits and replies; between
#: workers on one server the participant lends its keys (its request and grant are messages,
#: which no call waits on), and the home's step writes them; on a cluster the grant protocol
#: adds the step that records the hold per other shard; a lock takes, reads, writes and
#: releases (one of each per key, the reads and writes of two keys in one MGET/MSET).
ROUND_TRIPS = {
    "single key": {"keyserial": 2, "lock-tuned": 4, "lua": 1},
    "transfer in one worker": {"keyserial": 2, "lock-tuned": 6, "lua": 1},
    "transfer in one of two workers": {"keyserial": 2, "lock-tuned": 6, "lua": 1},
    "transfer between workers": {"keyserial": 2, "lock-tuned": 6, "lua": 1},
    "transfer on a cluster": {"keyserial": 3, "lock-tuned": 6, "lua": 1},
}
SHARDS = 16
ACCOUNTS = 10_000


@dataclass(frozen=True)
class Shape:
    name: str
    workloads: tuple[str, ...]
    options: tuple[str, ...]


SHAPES = (
    Shape("one worker", ("uniform", "transfer"), ("--workers", "1")),
    Shape("two workers", ("transfer", "local-transfer"), ("--workers", "2", "--split-shards")),
    Shape("cluster", ("transfer",), ("--workers", "1", "--cluster", "3")),
)
#: The workloads that measure each op kind, in their shape (a transfer between workers is
#: derived from the mix and the local transfers of the same run).
KIND_WORKLOADS = {
    "single key": ("one worker", ("uniform",)),
    "transfer in one worker": ("one worker", ("transfer",)),
    "transfer between workers": ("two workers", ("transfer", "local-transfer")),
    "transfer on a cluster": ("cluster", ("transfer",)),
}


def shapes_for(shapes: set[str], kinds: set[str]) -> list[Shape]:
    """The shapes to run, each with only the workloads of ``kinds`` it measures (a shape left
    with none is not run)."""
    wanted = {(shape, w) for shape, ws in map(KIND_WORKLOADS.__getitem__, kinds) for w in ws}
    chosen = []
    for shape in SHAPES:
        workloads = tuple(w for w in shape.workloads if (shape.name, w) in wanted)
        if shape.name in shapes and workloads:
            chosen.append(replace(shape, workloads=workloads))
    return chosen


def run_shape(shape: Shape, seconds: float) -> list[dict[str, Any]]:
    """One bench run of the shape; its results (the tuned lock's best sleep only)."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "keyserial", "bench", "--systems", ",".join(SYSTEMS)]
        command += ["--workloads", ",".join(shape.workloads), "--shards", str(SHARDS)]
        command += ["--duration", str(seconds), "--warmup", "0.5", "--no-chart", "--out", out]
        command += list(shape.options)
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        (found,) = Path(out).glob("bench-*.json")
        results = json.loads(found.read_text())["results"]
    return [
        result
        for result in results
        if result["status"] == "ok"
        and (result["system"] != "lock-tuned" or result.get("best_tuned"))
    ]


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    """What one op cost in ``result``."""
    ops = result["ops_in_window"] or 1
    commands = result["commands"]
    messages = commands.get("publish", 0) + commands.get("spublish", 0)
    cpu = result["cpu"]
    return {
        "ops_per_s": round(result["throughput"]),
        "commands": round(result["commands_per_op"], 2),
        "scripts": round(result["script_calls_per_op"], 2),
        "messages": round(messages / ops, 2),
        "clients_us": _us(cpu["clients"]),
        "workers_us": _us(cpu["workers"]),
        "redis_us": _us(cpu["server"]),
    }


def _us(part: dict[str, float | None]) -> float | None:
    value = part.get("us_per_op")
    return None if value is None else round(value, 1)


def crossing_share(shards: int = SHARDS, workers: int = 2) -> float:
    """The share of the bench's transfers (two random accounts of :data:`ACCOUNTS` on
    different shards) whose shards fall in different workers' contiguous ranges."""
    per_shard = Counter(shard_table(ACCOUNTS, shards))
    pairs = crossing = 0
    for first, first_count in per_shard.items():
        for second, second_count in per_shard.items():
            if first != second:
                apart = shard_range_of(first, shards, workers) != shard_range_of(
                    second, shards, workers
                )
                pairs += first_count * second_count
                crossing += first_count * second_count * apart
    return crossing / pairs


def derived_between(mix: dict[str, Any], within: dict[str, Any], share: float) -> dict[str, Any]:
    """The per-op figures of a transfer between workers, from the two-worker mix and the
    figures of transfers that stay within a worker: ``(mix - (1 - share) × within) / share``."""
    derived: dict[str, Any] = {}
    for name, value in mix.items():
        other = within.get(name)
        if name == "ops_per_s" or value is None or other is None:
            derived[name] = None
        else:
            derived[name] = round((value - (1 - share) * other) / share, 1)
    return derived


def rows_of(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A row per op kind and system."""
    rows: list[dict[str, Any]] = []

    def add(kind: str, results: list[dict[str, Any]], workload: str, note: str = "") -> None:
        for result in results:
            if result["workload"] == workload:
                system = result["system"]
                rows.append(
                    {
                        "kind": kind,
                        "system": system,
                        "round_trips": ROUND_TRIPS[kind][system],
                        "note": note if system == "keyserial" else "",
                        **figures(result),
                    }
                )

    add("single key", runs["one worker"], "uniform")
    add("transfer in one worker", runs["one worker"], "transfer")
    share = crossing_share()
    add("transfer in one of two workers", runs["two workers"], "local-transfer")
    add("transfer between workers", runs["two workers"], "transfer", "measured mix")
    within, mix = (_keyserial_row(rows, k) for k in ("transfer in one of two workers", "mix"))
    if mix is not None and within is not None:
        fields = {k: v for k, v in mix.items() if k in figures_keys()}
        rows.append(
            {
                "kind": "transfer between workers",
                "system": "keyserial",
                "round_trips": ROUND_TRIPS["transfer between workers"]["keyserial"],
                "note": f"derived: the {share:.0%} that cross",
                **derived_between(fields, {k: within[k] for k in fields}, share),
            }
        )
    add("transfer on a cluster", runs["cluster"], "transfer")
    return rows


def _keyserial_row(rows: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """keyserial's row of ``kind`` ("mix": the measured two-worker transfers)."""
    if kind == "mix":
        kind = "transfer between workers"
    return next((r for r in rows if r["kind"] == kind and r["system"] == "keyserial"), None)


def figures_keys() -> tuple[str, ...]:
    return ("ops_per_s", "commands", "scripts", "messages", "clients_us", "workers_us", "redis_us")


_LABELS = {"keyserial": "keyserial", "lock-tuned": "best redis-py lock", "lua": "Lua script"}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| op kind | system | round trips | Redis cmds/op | scripts/op | messages/op"
        " | clients µs/op | workers µs/op | Redis µs/op | ops/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        system = _LABELS[row["system"]] + (f" ({row['note']})" if row["note"] else "")
        cells = [_cell(row[key]) for key in figures_keys()[1:]] + [_cell(row["ops_per_s"])]
        lines.append(f"| {row['kind']} | {system} | {row['round_trips']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 1000 else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument(
        "--shapes",
        default=",".join(shape.name for shape in SHAPES),
        help="comma-separated subset of: " + ", ".join(shape.name for shape in SHAPES),
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KIND_WORKLOADS),
        help="comma-separated subset of the op kinds: " + ", ".join(KIND_WORKLOADS),
    )
    parser.add_argument("--out", type=Path, default=Path("keyserial-cost"))
    args = parser.parse_args(argv)
    kinds = set(args.kinds.split(","))
    if unknown := kinds - KIND_WORKLOADS.keys():
        parser.error(f"unknown op kinds: {', '.join(sorted(unknown))}")
    runs: dict[str, list[dict[str, Any]]] = {shape.name: [] for shape in SHAPES}
    for shape in shapes_for(set(args.shapes.split(",")), kinds):
        runs[shape.name] = run_shape(shape, args.seconds)
        print(f"{shape.name}: {len(runs[shape.name])} runs", flush=True)
    rows = rows_of(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.cost " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = markdown(rows, command.strip())
    (args.out / "cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
