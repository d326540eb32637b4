"""The ``keyserial`` command: ``worker`` serves shards, ``dev`` runs a server and workers,
``bench`` runs the benchmark suite (``benchmarks/``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Sequence

import anyio

from ._connect import default_url
from ._operator_cli import OPERATOR_COMMANDS, add_operator_commands, run_operator_command
from ._server import LocalServer
from ._settings import Settings
from ._worker import Worker
from .errors import ConfigError

log = logging.getLogger("keyserial")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--app",
        action="append",
        default=[],
        metavar="MODULE",
        help="module whose @keyserial.op functions to serve (repeatable);"
        " the ledger ops are always served",
    )
    parser.add_argument("--namespace", default="default", help="namespace (default: %(default)s)")
    parser.add_argument(
        "--lease-ttl",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="shard lease TTL; a dead worker's shards move within it (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO", help="(default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyserial", description="Per-key serialized execution on Redis streams."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    worker = commands.add_parser("worker", help="serve shards of a namespace")
    worker.add_argument(
        "--shards",
        default=None,
        metavar="LIST",
        help="shards to serve: 0-15, 0,3,7 or 0-3,8-11 (default: all)",
    )
    worker.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="Redis URL; a cluster is detected (default: $KEYSERIAL_REDIS_URL"
        " or redis://127.0.0.1:6379/0)",
    )
    worker.add_argument(
        "--shard-count",
        type=_positive,
        default=None,
        metavar="N",
        help="shards in the namespace; must match the recorded count"
        " (default: the recorded count, 16 for a new namespace)",
    )
    _add_common(worker)

    dev = commands.add_parser(
        "dev", help="run a private Redis/Valkey server and workers for every shard"
    )
    dev.add_argument("--port", type=_positive, default=6390, help="(default: %(default)s)")
    dev.add_argument(
        "--shard-count", type=_positive, default=16, metavar="N", help="(default: %(default)s)"
    )
    dev.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="keep data here with AOF (appendfsync always); default: a temporary"
        " directory, removed on exit",
    )
    _add_common(dev)

    # Parsed by the suite itself (benchmarks/cli.py): main() hands it every argument after "bench".
    commands.add_parser(
        "bench",
        add_help=False,
        help="benchmark keyserial against lock baselines (see `keyserial bench --help`)",
    )
    add_operator_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        return _run_bench(arguments[1:])
    args = build_parser().parse_args(arguments)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command in OPERATOR_COMMANDS:
            return run_operator_command(args)
        if args.command == "worker":
            return _run_worker(args)
        return _run_dev(args)
    except ConfigError as exc:
        print(f"keyserial: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        # A worker's setup error surfaces through the task group that runs it.
        config_errors = group.subgroup(ConfigError)
        if config_errors is None:
            raise
        print(f"keyserial: error: {_first_leaf(config_errors)}", file=sys.stderr)
        return 2


def _run_bench(arguments: list[str]) -> int:
    """Dispatch to the suite in ``benchmarks/`` (installed with keyserial from a checkout)."""
    try:
        suite = importlib.import_module("benchmarks.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.cli"):
            raise
        print(
            f"keyserial: error: the benchmark suite is not installed ({exc}); from a checkout,"
            " run `pip install -e \".[bench]\"`",
            file=sys.stderr,
        )
        return 2
    return int(suite.main(arguments))


def _first_leaf(group: BaseExceptionGroup[ConfigError]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        namespace=args.namespace, shard_count=args.shard_count, lease_ttl=args.lease_ttl
    )


def _run_worker(args: argparse.Namespace) -> int:
    worker = Worker(
        args.redis or default_url(), shards=args.shards, settings=_settings(args), apps=args.app
    )
    anyio.run(_serve_until_signalled, worker)
    return 0


def _run_dev(args: argparse.Namespace) -> int:
    worker_settings = _settings(args)
    server = LocalServer(
        port=args.port, data_dir=args.data_dir, appendfsync="always" if args.data_dir else None
    )
    worker = Worker(server.url, settings=worker_settings, apps=args.app)
    try:
        server.start()
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot start {server.binary} on port {args.port}: {exc}"
            " (is the port taken? try --port)"
        ) from exc
    try:
        print(f"keyserial dev: {server.binary} serving {server.url}", flush=True)
        print(
            f"keyserial dev: {args.shard_count} shards in namespace {args.namespace!r};"
            f" connect with keyserial.connect({server.url!r}, shards={args.shard_count})."
            " Ctrl-C stops.",
            flush=True,
        )
        anyio.run(_serve_until_signalled, worker)
    finally:
        server.stop()
        print("keyserial dev: stopped", flush=True)
    return 0


async def _serve_until_signalled(worker: Worker) -> None:
    """Run the worker; SIGTERM or SIGINT drains it, releases its leases, and returns."""
    async with anyio.create_task_group() as task_group:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for received in signals:
                    log.info("received %s: draining and releasing leases", received.name)
                    worker.stop()
                    return

        task_group.start_soon(stop_on_signal)
        await worker.run()
        task_group.cancel_scope.cancel()
