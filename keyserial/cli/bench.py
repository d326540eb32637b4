"""``keyserial bench``: the benchmark suite of a keyserial checkout (``benchmarks/``), which
parses its own arguments."""

from __future__ import annotations

import importlib
import sys

from .arguments import Subcommands, import_from_cwd

COMMANDS = ("bench",)


def add_commands(commands: Subcommands) -> None:
    # Parsed by the suite itself (benchmarks/cli.py): main() hands it every argument after "bench".
    commands.add_parser(
        "bench",
        add_help=False,
        help="benchmark keyserial against lock baselines (see `keyserial bench --help`)",
    )


def run_suite(arguments: list[str]) -> int:
    """Dispatch to the suite in ``benchmarks/``, which lives in a keyserial checkout (it is not
    installed: run ``keyserial bench`` from the checkout's root)."""
    import_from_cwd()
    try:
        suite = importlib.import_module("benchmarks.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.cli"):
            raise
        print(
            f"keyserial: error: the benchmark suite is not here ({exc}); run `keyserial bench`"
            ' from the root of a keyserial checkout, after `pip install -e ".[bench]"`',
            file=sys.stderr,
        )
        return 2
    return int(suite.main(arguments))
