"""``keyserial bench``: run the suite, print the table, write the JSON file and the PNG chart."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from .config import (
    DEFAULT_SYSTEMS,
    DURABLE,
    PROFILES,
    RESULTS_DIR,
    SYSTEMS,
    WORKLOADS,
    BenchConfig,
    default_out_dir,
)
from .durability import cost
from .report import markdown, write_chart, write_json
from .runner import run_suite, stderr_progress
from .targets import evaluate


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(allowed)}"
            )
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyserial bench",
        description="keyserial against lock baselines on one private (or given) Redis server.",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="quick",
        help="quick: hot, zipf, uniform, transfer, < 2 min; full: every workload but"
        " local-transfer (default: %(default)s)",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="use this server (standalone, or a node of a Redis Cluster) instead of a private"
        " one (its statistics are diffed, never reset; the run's keys are deleted)",
    )
    parser.add_argument(
        "--cluster",
        type=_positive_int,
        default=None,
        metavar="MASTERS",
        help="run on a private Redis Cluster of this many masters (no replicas) instead of a"
        " standalone server",
    )
    parser.add_argument(
        "--systems",
        type=_choices(SYSTEMS),
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all but {DURABLE},"
        " which attaches a replica to the server for the whole run)",
    )
    parser.add_argument(
        "--workloads",
        type=_choices(WORKLOADS),
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: the profile's)",
    )
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="measured seconds per run (default: the profile's)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        default=None,
        help="rounds of the hot, zipf, uniform, transfer and local-transfer runs, back to back"
        " per workload;"
        " each system's median round counts (default: the profile's: quick 1, full 3)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        metavar="SECONDS",
        help="warm-up seconds per run (default: the profile's)",
    )
    parser.add_argument(
        "--clients", type=_positive_int, default=2, help="client processes (default: %(default)s)"
    )
    parser.add_argument(
        "--callers",
        type=_positive_int,
        default=32,
        help="concurrent callers per client process (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="keyserial worker processes (default: %(default)s)",
    )
    parser.add_argument(
        "--shards", type=_positive_int, default=16, help="keyserial shards (default: %(default)s)"
    )
    parser.add_argument(
        "--split-shards",
        action="store_true",
        help="each keyserial worker process owns its own contiguous range of shards (no standby),"
        " so cross-shard ops between ranges go through grant requests",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the keyserial workers' event loop (keyserial worker --event-loop; default:"
        " %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the JSON, PNG and Markdown go (default: keyserial-bench/<date-time>/ in the"
        f" working directory; {RESULTS_DIR.parent.name}/{RESULTS_DIR.name} holds the published"
        " results)",
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: redraw the table and chart of a JSON file this suite wrote (next to it)",
    )
    parser.add_argument(
        "--py-spy",
        action="store_true",
        help="record py-spy profiles (collapsed stacks) of keyserial's processes"
        " (into OUT/profiles; costs CPU, so figures of those runs drop)",
    )
    return parser  # fmt: skip


def config_from(args: argparse.Namespace) -> BenchConfig:
    profile = PROFILES[args.profile]
    duration = args.duration or profile.duration
    return BenchConfig(
        profile=profile.name,
        systems=tuple(s for s in SYSTEMS if s in args.systems),
        workloads=tuple(w for w in WORKLOADS if w in (args.workloads or profile.workloads)),
        duration=duration,
        warmup=profile.warmup if args.warmup is None else args.warmup,
        variant_duration=args.duration or profile.variant_duration,
        clients=args.clients,
        callers=args.callers,
        workers=args.workers,
        split_shards=args.split_shards,
        event_loop=args.event_loop,
        shards=args.shards,
        tuned_sleeps=profile.tuned_sleeps,
        slow_keys=profile.slow_keys,
        sweep_callers=profile.sweep_callers,
        drain_timeout=profile.drain_timeout,
        rounds=args.rounds or profile.rounds,
        redis_url=args.redis,
        cluster_masters=args.cluster or 0,
        out_dir=args.out or default_out_dir(),
        py_spy=args.py_spy,
    )


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(arguments)
    if args.render is not None:
        document = json.loads(args.render.read_text())
        stem = args.render.with_suffix("")
    else:
        if args.cluster and args.redis:
            parser.error("--cluster starts a private cluster; --redis names a server: pick one")
        config = config_from(args)
        fewest = config.shards
        if "slow" in config.workloads:
            fewest = min(fewest, config.slow_shards)
        if config.split_shards and config.workers > fewest:
            parser.error(f"--split-shards: {config.workers} workers cannot split {fewest} shards")
        ranges = config.workers if config.split_shards else 1
        if "local-transfer" in config.workloads and config.shards < 2 * ranges:
            parser.error(f"local-transfer: {config.shards} shards give a worker fewer than two")
        command = shlex.join(["keyserial", "bench", *arguments])
        document = anyio.run(run_suite, config, stderr_progress, command)
        stem = config.out_dir / f"bench-{config.profile}"
        stem.parent.mkdir(parents=True, exist_ok=True)
    runs = document.get("runs", document["results"])
    document["targets"] = evaluate(document["results"], document["config"]["slow_io"], runs)
    document["durability"] = cost(document["results"])
    table = markdown(document)
    write_json(document, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table + "\n")
    if not args.no_chart:
        write_chart(document, stem.with_suffix(".png"))
    print(table)
    written = ", ".join(str(stem.with_suffix(s)) for s in (".json", ".md", ".png"))
    print(f"\nwritten: {written}", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
