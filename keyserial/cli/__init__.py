"""The ``keyserial`` command, one module per group of subcommands: ``serving`` (``worker``,
``dev``), ``status``, ``deadletters`` (``dead-letters``), ``timers``, ``keys`` (``call``, ``read``,
``result``, ``keys``), ``dashboard``, ``reshard`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Protocol, TypeVar

from .. import __version__
from ..errors import ConfigError, KeyserialError, ShardCountMismatch, redact
from . import bench, dashboard, deadletters, keys, reshard, serving, status, timers
from .arguments import Subcommands, chosen_server, import_from_cwd
from .logs import configure

log = logging.getLogger("keyserial")


class _Group(Protocol):
    """A group's module: the commands it adds to the parser, and how it runs one of them."""

    @property
    def COMMANDS(self) -> tuple[str, ...]: ...

    def add_commands(self, commands: Subcommands) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


_GROUPS: tuple[_Group, ...] = (serving, status, deadletters, timers, keys, dashboard, reshard)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyserial", description="Per-key serialized execution on Redis streams."
    )
    parser.add_argument("--version", action="version", version=f"keyserial {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in _GROUPS:
        group.add_commands(commands)
    bench.add_commands(commands)  # (its arguments are the suite's: see main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; its exit code. Output piped to a reader that stops reading early
    (``keyserial status | head``) ends the command quietly with code 141, as a program killed by
    SIGPIPE reports in a shell: the Python docs' recipe (the ``signal`` module, "Note on
    SIGPIPE"), for every command. (SIGPIPE itself is left ignored, as Python sets it: a worker's
    socket to a vanished peer must raise, not kill it.)"""
    try:
        code = _main(argv)
        sys.stdout.flush()  # (a reader gone shows here, not in the interpreter's flush at exit)
    except BrokenPipeError:
        return _reader_gone()
    return code


def _main(argv: Sequence[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        return bench.run_suite(arguments[1:])
    args = build_parser().parse_args(arguments)
    configure(args.log_level, getattr(args, "log_format", "text"))
    import_from_cwd()
    if "redis" in vars(args):  # (every command but dev, which names the server it starts)
        _name_the_server(args)
    run = next(group.run for group in _GROUPS if args.command in group.COMMANDS)
    try:
        return run(args)
    except KeyboardInterrupt:  # (Ctrl-C outside a worker's drain: status, dead-letters)
        print("keyserial: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a group, when it comes through the worker's task group
        if _found(exc, BrokenPipeError) is not None:
            return _reader_gone()
        problem = _usage_error(exc, args)
        if problem is None:
            log.error("keyserial %s stopped by an unexpected error", args.command, exc_info=exc)
            return 1
        print(f"keyserial: error: {problem}", file=sys.stderr)
        return 2


def _name_the_server(args: argparse.Namespace) -> None:
    """Say which server the command uses (``--redis``, else ``$KEYSERIAL_REDIS_URL``, else
    ``keyserial dev``'s: ``arguments.chosen_server``, as each command finds it), password
    hidden, when its command line does not: on stderr, as stdout is the command's answer. (A
    worker logs it whatever chose it: ``cli.serving``.) No command uses a server unnamed."""
    url, chosen_by = chosen_server(args.redis)
    if args.command != "worker" and chosen_by != "--redis":
        print(f"keyserial: using {redact(url)} ({chosen_by})", file=sys.stderr, flush=True)


_READER_GONE = 128 + signal.SIGPIPE


def _reader_gone() -> int:
    """Stdout's reader has gone: point stdout at /dev/null, so that no later write or flush (the
    interpreter's at exit) fails again, and exit as a program killed by SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return _READER_GONE


def _usage_error(exc: Exception, args: argparse.Namespace) -> KeyserialError | None:
    """The error to report in one line, with exit code 2: a setup error (``ConfigError``),
    or any keyserial error of a command that reads or steers a namespace (Redis down, say);
    None for a crash."""
    problem = _config_error(exc)
    if isinstance(problem, ShardCountMismatch):
        flag = (
            getattr(args, "shard_count", None) is not None
            or "KEYSERIAL_SHARD_COUNT" not in os.environ
        )
        return problem.configured_by("--shard-count" if flag else "KEYSERIAL_SHARD_COUNT=")
    if problem is None and args.command not in serving.COMMANDS:
        return exc if isinstance(exc, KeyserialError) else None
    return problem


def _config_error(exc: BaseException) -> ConfigError | None:
    """The setup error (``ConfigError``) in ``exc``, or among the errors it groups."""
    return _found(exc, ConfigError)


E = TypeVar("E", bound=BaseException)


def _found(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` if it is a ``kind``, else the first ``kind`` among the errors it groups."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for each in exc.exceptions:
            found = _found(each, kind)
            if found is not None:
                return found
    return None
