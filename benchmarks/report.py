"""What a suite run leaves behind: a Markdown table, a JSON file of every figure, a PNG chart."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .config import SYSTEM_LABELS, SYSTEMS, WORKLOAD_LABELS
from .targets import find

Record = dict[str, Any]

_COLORS = {
    "keyserial": "#1b9e77",
    "keyserial-durable": "#66a61e",
    "keyserial-thread": "#a6761d",
    "lock-default": "#d95f02",
    "lock-tuned": "#e6ab02",
    "lock-notify": "#7570b3",
    "no-lock": "#999999",
    "lua": "#e7298a",
}
_MAIN = ("hot", "zipf", "uniform", "transfer", "local-transfer")


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{value:.2f}" if value < 10 else f"{value:,.0f}"


def _system_label(record: Record) -> str:
    label = SYSTEM_LABELS[record["system"]]
    lock = record.get("lock") or {}
    if record["system"] == "lock-tuned":
        return f"{label} (TTL {lock['timeout']:g} s, sleep {lock['sleep'] * 1000:g} ms: best)"
    if record["system"] == "lock-default":
        return f"{label} (sleep {lock['sleep'] * 1000:g} ms, no TTL)"
    return label


def _cpu(record: Record, role: str) -> float | None:
    cpu = record["cpu"]
    if role == "client":
        parts = [cpu["clients"]["percent"], cpu["workers"]["percent"]]
        return sum(p for p in parts if p is not None) if parts[0] is not None else None
    value: float | None = cpu[role]["percent"]
    return value


def _rows(results: list[Record], workload: str, variant: dict[str, Any]) -> list[Record]:
    """One row per system: the tuned lock's best sleep only; skipped and failed runs too."""
    rows = []
    for system in SYSTEMS:
        for record in results:
            if record["workload"] != workload or record["system"] != system:
                continue
            if any(record["variant"].get(k) != v for k, v in variant.items()):
                continue
            if system == "lock-tuned" and record["status"] == "ok" and not record.get("best_tuned"):
                continue
            rows.append(record)
            break
    return rows


HEADER = (
    "| system | ops/s | p50 ms | p99 ms | p99.9 ms | cmds/op | server CPU | client CPU"
    " | lost updates | keyserial ÷ it, ops/s | keyserial ÷ it, p99 |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


#: Other processes' CPU (% of one core) above which a run is flagged as noisy.
NOISY_PERCENT = 25.0


def _noise(record: Record) -> float | None:
    others = record.get("cpu", {}).get("others", {}).get("percent")
    return others if others is not None and others > NOISY_PERCENT else None


def _row(record: Record, keyserial: Record | None) -> str:
    if record["status"] != "ok":
        return f"| {SYSTEM_LABELS[record['system']]} | {record.get('reason', record['status'])} |"
    noisy = " †" if _noise(record) is not None else ""
    latency = record["latency_ms"]
    correctness = record["correctness"]
    lost = correctness["lost_updates"]
    lost_text = f"{lost:,}" if not lost else f"**{lost:,}** of {correctness['acknowledged_ops']:,}"
    ratio_ops = ratio_p99 = "—"
    if keyserial is not None and record is not keyserial:
        ratio_ops = f"{keyserial['throughput'] / record['throughput']:.1f}×"
        ratio_p99 = f"{keyserial['latency_ms']['p99'] / latency['p99']:.2f}"
    return (
        f"| {_system_label(record)}{noisy} | {_num(record['throughput'])} | {_ms(latency['p50'])}"
        f" | {_ms(latency['p99'])} | {_ms(latency['p99_9'])} | {_num(record['commands_per_op'], 2)}"
        f" | {_num(_cpu(record, 'server'))}% | {_num(_cpu(record, 'client'))}%"
        f" | {lost_text} | {ratio_ops} | {ratio_p99} |"
    )


def _main_tables(results: list[Record]) -> list[str]:
    lines: list[str] = []
    for workload in _MAIN:
        rows = _rows(results, workload, {})
        if not rows:
            continue
        keyserial = find(results, workload, "keyserial")
        sample = rows[0]
        lines += [
            f"### {WORKLOAD_LABELS[workload]} — {sample['callers']} callers"
            f" ({sample['clients']} processes × {sample['callers_per_client']})",
            "",
            HEADER,
        ]
        lines += [_row(record, keyserial) for record in rows]
        lines.append("")
        lines += _noise_note(rows)
        lines += _rounds_note(rows)
    return lines


def _rounds_note(rows: list[Record]) -> list[str]:
    """Every round's throughput, in run order, for the systems that ran in rounds."""
    parts = [
        f"{_system_label(r)}: "
        + " · ".join(_num(t["throughput"]) if t["status"] == "ok" else t["status"]
                     for t in r["rounds"])
        for r in rows
        if r.get("rounds")
    ]  # fmt: skip
    if not parts:
        return []
    return [f"Each round's ops/s, in run order (the median one is shown): {'; '.join(parts)}.", ""]


def _noise_note(rows: list[Record]) -> list[str]:
    noisy = [(r["system"], n) for r in rows if r["status"] == "ok" and (n := _noise(r))]
    if not noisy:
        return []
    parts = ", ".join(f"{system} {percent:.0f}%" for system, percent in noisy)
    return [f"† other processes on the machine took CPU during the run ({parts} of a core).", ""]


def _variant_table(results: list[Record], workload: str, axis: str, unit: str) -> list[str]:
    records = [r for r in results if r["workload"] == workload]
    points = sorted({r["variant"][axis] for r in records})
    if not points:
        return []
    title = WORKLOAD_LABELS[workload]
    if workload == "slow":
        title += f" ({records[0]['variant'].get('shards')} keyserial shards)"
    lines = [
        f"### {title}: ops/s (p99 ms) by {unit}",
        "",
        "| system | "
        + " | ".join(f"{p} {unit.removesuffix('s') if p == 1 else unit}" for p in points)
        + " |",
        "|---|" + "---:|" * len(points),
    ]
    for system in SYSTEMS:
        cells = []
        for point in points:
            row = _rows(results, workload, {axis: point})
            record = next((r for r in row if r["system"] == system), None)
            cells.append(_cell(record))
        if any(cell != "" for cell in cells):
            lines.append(f"| {SYSTEM_LABELS[system]} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _cell(record: Record | None) -> str:
    if record is None:
        return ""
    if record["status"] != "ok":
        return "n/a" if record["status"] == "skipped" else "failed"
    lost = record["correctness"]["lost_updates"]
    text = f"{_num(record['throughput'])} ({_ms(record['latency_ms']['p99'])})"
    return f"{text}, lost {lost:,}" if lost else text


def _durability_table(document: dict[str, Any]) -> list[str]:
    """keyserial-durable ÷ keyserial per workload: what waiting for a replica costs."""
    rows: list[Record] = document.get("durability", [])
    replication = document.get("replication")
    if replication is None:
        return []
    lines = ["### Durability's cost: durable_replicas=1 ÷ 0, same master and replica", ""]
    if replication.get("unavailable"):
        return [*lines, f"Not measured: {replication['unavailable']}.", ""]
    if not rows:
        why = "Not measured: run `keyserial` too (`--systems keyserial,keyserial-durable`)."
        return [*lines, why, ""]
    lines += [
        "| workload | keyserial ops/s | durable ops/s | durable ÷ keyserial, ops/s"
        " | keyserial p99 ms | durable p99 ms | durable ÷ keyserial, p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        plain, durable = row["keyserial"], row["durable"]
        lines.append(
            f"| {row['workload']}{_variant_text(row['variant'])} | {_num(plain['throughput'])}"
            f" | {_num(durable['throughput'])} | {row['throughput_ratio']:.2f}×"
            f" | {_ms(plain['p99_ms'])} | {_ms(durable['p99_ms'])} | {row['p99_ratio']:.2f}× |"
        )
    who = "started by the suite" if replication.get("started_by_suite") else "the server's own"
    count = replication.get("replicas_online")
    lines += [
        "",
        f"Every system of this run ran with the replica attached ({count} online, {who});"
        " the two keyserial systems ran back to back on each workload.",
        "",
    ]
    return lines


def _variant_text(variant: dict[str, Any]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in variant.items())})" if variant else ""


def _targets_table(targets: Iterable[Record]) -> list[str]:
    marks = {True: "met", False: "**missed**", None: "not measured"}
    lines = ["### Targets (ratios within this run)", "", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {marks[t['met']]} |" for t in targets]
    return [*lines, ""]


def _deployment(server: dict[str, Any]) -> str:
    masters = server.get("cluster_masters")
    return f" (a cluster of {masters} masters; server CPU sums them)" if masters else ""


def markdown(document: dict[str, Any]) -> str:
    results: list[Record] = document["results"]
    server = document["server"]
    machine = document["machine"]
    config = document["config"]
    version = server.get("valkey_version") or server.get("redis_version")
    name = "valkey" if server.get("valkey_version") else "redis"
    lines = [
        f"## keyserial bench — profile {config['profile']}",
        "",
        f"`{document['command']}` — {machine['cores']} cores ({machine['cpu_model']}),"
        f" {name} {version}{_deployment(server)}, Python {machine['python']},"
        f" redis-py {machine['packages']['redis']};"
        f" keyserial: {config['workers']} worker process, {config['shards']} shards"
        f"{' split between them' if config.get('split_shards') else ''}"
        f"{' on uvloop' if config.get('event_loop') == 'uvloop' else ''};"
        f" warm-up {config['warmup']:g} s, measured {config['duration']:g} s per run."
        " Clients, workers and the server share the machine's cores. CPU is % of one core;"
        " client CPU includes keyserial's worker processes.",
        "",
    ]
    rounds = config.get("rounds", 1)
    if rounds > 1:
        lines += [
            f"Hot key, Zipf, uniform and transfers ran in {rounds} rounds, back to back per"
            " workload (every system, then every system again); each row is the system's"
            " median round by throughput, every figure of the row from that round. Lost"
            " updates are checked in every round (the targets count them all).",
            "",
        ]
    lines += _main_tables(results)
    lines += _variant_table(results, "slow", "keys", "keys")
    lines += _variant_table(results, "sweep", "callers", "callers")
    lines += _durability_table(document)
    lines += _targets_table(document.get("targets", []))
    return "\n".join(lines)


def write_json(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"not JSON: {value!r}")


def write_chart(document: dict[str, Any], path: Path) -> None:
    """Bars of throughput, p99 and commands/op per workload; lines for the slow-I/O and sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: list[Record] = document["results"]
    panels: list[tuple[str, Callable[[Record], float] | None]] = [
        ("throughput (ops/s)", _throughput),
        ("p99 latency (ms)", _p99),
    ]
    panels.append(("Redis commands per op (incl. inside scripts)", _commands))
    panels.append(("CPU per op, µs (server + clients + workers)", _cpu_per_op))
    if any(r["workload"] == "slow" for r in results):
        panels.append(("slow I/O: ops/s by keys", None))
    if any(r["workload"] == "sweep" for r in results):
        panels.append(("hot-key sweep: ops/s by callers", None))
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(12, 4.2 * rows), squeeze=False)
    for axis, (title, value) in zip(axes.flat, panels, strict=False):
        if value is not None:
            _bars(axis, results, value, title)
        elif title.startswith("slow"):
            _lines(axis, results, "slow", "keys", title)
        else:
            _lines(axis, results, "sweep", "callers", title)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    config = document["config"]
    rounds = config.get("rounds", 1)
    medians = f"; bars: median of {rounds} rounds" if rounds > 1 else ""
    figure.suptitle(
        f"keyserial bench, profile {config['profile']}: {config['clients']} client processes"
        f" × {config['callers']} callers, {document['machine']['cores']} cores (log scales)"
        + medians
    )
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _throughput(record: Record) -> float:
    return float(record["throughput"])


def _p99(record: Record) -> float:
    return float(record["latency_ms"]["p99"])


def _commands(record: Record) -> float:
    return float(record["commands_per_op"])


def _cpu_per_op(record: Record) -> float:
    cpu = record["cpu"]
    parts = [cpu[role]["us_per_op"] for role in ("server", "clients", "workers")]
    return float(sum(part for part in parts if part is not None))


def _bars(axis: Any, results: list[Record], value: Any, title: str) -> None:
    workloads = [w for w in _MAIN if any(r["workload"] == w for r in results)]
    width = 0.8 / len(SYSTEMS)
    plotted = False
    for n, system in enumerate(SYSTEMS):
        xs, ys = [], []
        for x, workload in enumerate(workloads):
            position = x + (n - (len(SYSTEMS) - 1) / 2) * width
            record = find(results, workload, system)
            if record is not None and value(record) > 0:
                xs.append(position)
                ys.append(value(record))
            elif any(r["workload"] == workload and r["system"] == system for r in results):
                # skipped or failed: say so where the bar would be
                axis.text(
                    position, 0.03, "n/a", transform=axis.get_xaxis_transform(),
                    rotation=90, ha="center", fontsize=7, color=_COLORS[system],
                )  # fmt: skip
        axis.bar(xs, ys, width, label=system, color=_COLORS[system])
        plotted = plotted or bool(ys)
    axis.set_xticks(range(len(workloads)), workloads)
    if plotted:  # a log scale needs a positive value (every run may have been skipped)
        axis.set_yscale("log")
    axis.set_title(title)
    axis.grid(axis="y", alpha=0.3)


def _lines(axis: Any, results: list[Record], workload: str, key: str, title: str) -> None:
    for system in SYSTEMS:
        points = sorted(
            (r["variant"][key], r["throughput"])
            for r in results
            if r["workload"] == workload
            and r["system"] == system
            and r["status"] == "ok"
            and (system != "lock-tuned" or r.get("best_tuned"))
        )
        if points:
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", label=system, color=_COLORS[system])
    axis.set_xscale("log", base=2)
    ticks = sorted({r["variant"][key] for r in results if r["workload"] == workload})
    axis.set_xticks(ticks, [str(t) for t in ticks])
    axis.set_yscale("log")
    axis.set_xlabel(key)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
