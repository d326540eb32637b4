"""Throughput against worker processes and shards: ``python -m benchmarks.scaling``.

Runs ``keyserial bench`` once per point of a matrix, each worker process owning its own range of
shards (``--split-shards``), on a private standalone server (``--cluster M``: a private Redis
Cluster of M masters): uniform deposits (one key per op)
and transfers between two random accounts (across shards, so between workers when the two
shards belong to different ones). Per point it keeps throughput, p99, Redis commands per op
and the CPU per op of the server, the workers and the clients (from the bench's own JSON), and
writes ``scaling.json``, ``scaling.md`` and, with matplotlib, ``scaling.png`` to ``--out``.

Every point shares one machine: on a machine with fewer cores than processes, more workers
compete for the same cores, so read the CPU per op, not only the throughput.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("uniform", "transfer")


def run_point(workers: int, shards: int, seconds: float, cluster: int) -> list[dict[str, Any]]:
    """One bench run of keyserial alone (on a cluster of ``cluster`` masters, if not 0); a row
    per workload."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "keyserial", "bench", "--systems", "keyserial"]
        command += ["--workloads", ",".join(WORKLOADS), "--workers", str(workers)]
        command += ["--shards", str(shards), "--duration", str(seconds), "--warmup", "0.5"]
        command += ["--no-chart", "--out", out]
        if workers > 1:
            command.append("--split-shards")
        if cluster:
            command += ["--cluster", str(cluster)]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        (found,) = Path(out).glob("bench-*.json")
        results = json.loads(found.read_text())["results"]
    return [_row(workers, shards, result) for result in results]


def _row(workers: int, shards: int, result: dict[str, Any]) -> dict[str, Any]:
    cpu = result["cpu"]
    return {
        "workers": workers,
        "shards": shards,
        "workload": result["workload"],
        "ops_per_s": round(result["throughput"]),
        "p99_ms": round(result["latency_ms"]["p99"], 2),
        "commands_per_op": round(result["commands_per_op"], 2),
        "server_us_per_op": _us(cpu["server"]),
        "workers_us_per_op": _us(cpu["workers"]),
        "clients_us_per_op": _us(cpu["clients"]),
    }


def _us(part: dict[str, float | None]) -> float | None:
    value = part.get("us_per_op")
    return None if value is None else round(value, 1)


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", ""]
    for workload in WORKLOADS:
        lines += [f"### {workload}", ""]
        lines.append(
            "| workers | shards | ops/s | p99 ms | cmds/op | Redis µs/op | workers µs/op"
            " | clients µs/op |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            if row["workload"] == workload:
                lines.append(
                    f"| {row['workers']} | {row['shards']} | {row['ops_per_s']:,} |"
                    f" {row['p99_ms']} | {row['commands_per_op']} | {row['server_us_per_op']} |"
                    f" {row['workers_us_per_op']} | {row['clients_us_per_op']} |"
                )
        lines.append("")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> bool:
    """Throughput by workers, a line per shard count, a panel per workload; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, len(WORKLOADS), figsize=(10, 4))
    for axis, workload in zip(axes, WORKLOADS, strict=True):
        for shards in sorted({row["shards"] for row in rows}):
            points = sorted(
                (row["workers"], row["ops_per_s"])
                for row in rows
                if row["workload"] == workload and row["shards"] == shards
            )
            axis.plot(*zip(*points, strict=True), marker="o", label=f"{shards} shards")
        axis.set_title(workload)
        axis.set_xticks(sorted({row["workers"] for row in rows}))
        axis.set_xlabel("worker processes")
        axis.set_ylabel("ops/s")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling")
    parser.add_argument("--workers", default="1,2,4", help="worker process counts")
    parser.add_argument("--shards", default="16,256,1024", help="shard counts")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per run")
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="M", help="on a private cluster of M masters"
    )
    parser.add_argument("--out", type=Path, default=Path("keyserial-scaling"))
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for shards in (int(count) for count in args.shards.split(",")):
        for workers in (int(count) for count in args.workers.split(",")):
            point = run_point(workers, shards, args.seconds, args.cluster)
            for row in point:
                print(json.dumps(row), flush=True)
            rows += point
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.scaling " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "scaling.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "scaling.md").write_text(markdown(rows, command.strip()) + "\n")
    chart(rows, args.out / "scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
