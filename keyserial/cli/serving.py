"""``keyserial worker`` serves shards of a namespace, draining on SIGTERM or SIGINT and stopping
at once on a second; ``keyserial dev`` runs a private server and a supervised worker
(``cli.dev``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import anyio

from .._backend.transport import check_url
from .._settings import (
    DEFAULT_URL,
    DEV_PORT,
    EVENT_LOOP_VARIABLE,
    METRICS_PORT_VARIABLE,
    URL_VARIABLE,
    Settings,
)
from .._worker.worker import Worker
from ..errors import ConfigError, redact
from .arguments import Subcommands, chosen_server, port, positive, seconds
from .dev import run_dev
from .logs import FORMATS, LEVELS

COMMANDS = ("worker", "dev")
log = logging.getLogger("keyserial")
EVENT_LOOPS = ("asyncio", "uvloop")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level; choose from {', '.join(LEVELS)}"
        )
    return level


def _module_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an app module name is needed, such as myapp.ops")
    return text


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--app",
        action="append",
        type=_module_name,
        default=[],
        metavar="MODULE",
        help="module whose @keyserial.op functions to serve (repeatable);"
        " the ledger ops are always served",
    )
    parser.add_argument(
        "--namespace", default=None, help="namespace (default: $KEYSERIAL_NAMESPACE or default)"
    )
    parser.add_argument(
        "--lease-ttl",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="shard lease TTL; a dead worker's shards move within it"
        " (default: $KEYSERIAL_LEASE_TTL or 10)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port, every interface (default:"
        " $KEYSERIAL_METRICS_PORT, else none); see docs/metrics.md",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=None,
        help="the worker's event loop: uvloop (pip install 'keyserial[uvloop]') serves cross-"
        "shard ops between workers faster; see docs/scaling.md (default: $KEYSERIAL_EVENT_LOOP,"
        " else asyncio)",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        metavar="LEVEL",
        help=f"{', '.join(LEVELS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="json: one JSON object per line (default: %(default)s)",
    )


def add_commands(commands: Subcommands) -> None:
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
        help=f"Redis URL; a cluster is detected (default: ${URL_VARIABLE}, else {DEFAULT_URL},"
        " where keyserial dev serves)",
    )
    worker.add_argument(
        "--shard-count",
        type=positive,
        default=None,
        metavar="N",
        help="shards in the namespace; must match the recorded count (default:"
        " $KEYSERIAL_SHARD_COUNT, else the recorded count, 16 for a new namespace)",
    )
    _add_common(worker)

    dev = commands.add_parser(
        "dev", help="run a private Redis/Valkey server and workers for every shard"
    )
    dev.add_argument(
        "--port", type=port, default=DEV_PORT, help="(default: %(default)s; 0 picks a free port)"
    )
    dev.add_argument(
        "--shard-count",
        type=positive,
        default=None,
        metavar="N",
        help="(default: $KEYSERIAL_SHARD_COUNT, else the count --data-dir's data recorded,"
        " else 16)",
    )
    dev.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="keep data here with AOF (appendfsync always); default: a temporary"
        " directory, removed on exit",
    )
    _add_common(dev)


def run(args: argparse.Namespace) -> int:
    if args.command == "worker":
        return _run_worker(args)
    return _run_dev(args)


def _settings(args: argparse.Namespace) -> Settings:
    """A flag, else its ``KEYSERIAL_*`` variable, else the default; every other setting from
    its variable or the default."""
    return Settings.resolve(
        namespace=args.namespace, shard_count=args.shard_count, lease_ttl=args.lease_ttl
    )


def _metrics_port(args: argparse.Namespace) -> int | None:
    """``--metrics-port``, else ``KEYSERIAL_METRICS_PORT``, else None (no metrics served)."""
    if args.metrics_port is not None:
        return int(args.metrics_port)
    raw = os.environ.get(METRICS_PORT_VARIABLE, "")
    if not raw:
        return None
    try:
        return port(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{METRICS_PORT_VARIABLE}={raw!r}: {exc}") from None


def _run_worker(args: argparse.Namespace) -> int:
    url, chosen_by = chosen_server(args.redis)
    worker = Worker(
        url,
        shards=args.shards,
        settings=_settings(args),
        apps=args.app,
        metrics_port=_metrics_port(args),
    )
    check_url(url)  # (a URL it cannot use: that error, alone)
    # (Whatever chose it, and first: a worker's log is read where its command line is not.)
    log.info("worker using Redis at %s (%s)", redact(url), chosen_by)
    anyio.run(_serve_until_signalled, worker, **_event_loop_options(_event_loop(args)))
    return 0


def _event_loop(args: argparse.Namespace) -> str:
    """``--event-loop``, else ``KEYSERIAL_EVENT_LOOP``, else asyncio."""
    if args.event_loop is not None:
        return str(args.event_loop)
    chosen = os.environ.get(EVENT_LOOP_VARIABLE, "") or "asyncio"
    if chosen not in EVENT_LOOPS:
        raise ConfigError(f"{EVENT_LOOP_VARIABLE}={chosen!r}: choose from {', '.join(EVENT_LOOPS)}")
    return chosen


def _event_loop_options(loop: str) -> dict[str, Any]:
    """``anyio.run``'s options for ``loop``.

    :raises ConfigError: uvloop asked for and not installed (never a silent fallback).
    """
    if loop == "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the uvloop event loop was asked for and uvloop is not installed:"
            " pip install 'keyserial[uvloop]' (Linux and macOS)"
        ) from None
    return {"backend_options": {"use_uvloop": True}}


def _run_dev(args: argparse.Namespace) -> int:
    settings = _settings(args)  # (no shard count: kept data's, or 16 for a new namespace)
    return run_dev(args, settings, _worker_flags(args))


def _worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``keyserial worker`` that ``dev``'s own flags pass on to its worker (the
    ``KEYSERIAL_*`` variables reach it as they are)."""
    flags = ["--log-level", args.log_level, "--log-format", args.log_format]
    for flag, value in (
        ("--namespace", args.namespace),
        ("--shard-count", args.shard_count),
        ("--lease-ttl", args.lease_ttl),
        ("--metrics-port", args.metrics_port),
        ("--event-loop", args.event_loop),
    ):
        if value is not None:
            flags += [flag, str(value)]
    for app in args.app:
        flags += ["--app", app]
    return flags


async def _serve_until_signalled(
    worker: Worker, on_ready: Callable[[], None] | None = None
) -> None:
    """Run the worker; SIGTERM or SIGINT drains it, releases its leases, and returns.
    ``on_ready`` is called once the worker serves."""
    async with anyio.create_task_group() as task_group:

        async def announce(ready: Callable[[], None]) -> None:
            await worker.wait_started()
            ready()

        if on_ready is not None:
            task_group.start_soon(announce, on_ready)

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                draining = False
                async for received in signals:
                    if draining:  # (not dying: that would leave the leases to expire)
                        log.warning(
                            "received %s again: stopping at once; the ops in flight are"
                            " abandoned (the next owner runs them again), and the leases"
                            " released",
                            received.name,
                        )
                        worker.stop(at_once=True)
                        continue
                    log.info(
                        "received %s: draining and releasing leases (again: stop at once)",
                        received.name,
                    )
                    draining = True
                    worker.stop()

        task_group.start_soon(stop_on_signal)
        await worker.run()
        task_group.cancel_scope.cancel()
