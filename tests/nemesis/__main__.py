"""``python -m tests.nemesis --seeds 200 [--profile short|long|timers|cluster|takeover]
[--seed-start K] [--json OUT]``"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import anyio

from tests.helpers import ROOT
from tests.nemesis.runner import RunReport, run_seed
from tests.nemesis.schedule import PROFILES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.nemesis", description=__doc__)
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (default: 20)")
    parser.add_argument("--seed-start", type=int, default=0, help="first seed (default: 0)")
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="long",
        help="short (CI), long, timers (long, with delayed ops and timers ops set), cluster"
        " (3 masters + 3 replicas), or takeover (cluster, with leases that outlive a TAKEOVER)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every report here")
    parser.add_argument("--keep", action="store_true", help="keep logs of passing seeds too")
    parser.add_argument("--verbose", action="store_true", help="print every seed's schedule")
    args = parser.parse_args(argv)
    # Worker processes import tests.apps from this checkout.
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    root = Path(tempfile.mkdtemp(prefix="nemesis-"))
    reports: list[RunReport] = []
    began = time.monotonic()
    for seed in range(args.seed_start, args.seed_start + args.seeds):
        workdir = root / f"seed-{seed}"
        workdir.mkdir()
        report = anyio.run(run_seed, seed, PROFILES[args.profile], workdir)
        reports.append(report)
        print(report.describe(verbose=args.verbose), flush=True)
        if report.ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if args.json:
            args.json.write_text(
                json.dumps([asdict(each) for each in reports], indent=1, default=repr)
            )
    failed = [report.seed for report in reports if not report.ok]
    for report in reports:
        if not report.ok:
            print(f"  seed {report.seed}: {summary(report)}")
    print(
        f"{len(reports)} seeds in {time.monotonic() - began:.0f}s; "
        f"{len(failed)} failed: {failed}; logs of failures under {root}"
    )
    return 1 if failed else 0


def summary(report: RunReport) -> str:
    """The failed checkers and what they found, counted: ``bank: a payment applied twice (3)``."""
    counts = Counter(f"{v.checker}: {v.what}" for v in report.violations)
    return "; ".join(f"{what} ({count})" for what, count in sorted(counts.items()))


if __name__ == "__main__":
    sys.exit(main())
