"""What the commands share: argument types, each rejecting bad input as a usage error, and the
connection options of the commands that read or steer a namespace."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TypeAlias, TypeVar

import anyio

from .._backend.backend import Backend
from .._settings import DEFAULT_URL, URL_VARIABLE, Settings

T = TypeVar("T")

#: What a group of subcommands adds its commands to.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _checked(
    text: str, convert: Callable[[str], T], kind: str, out_of_range: Callable[[T], bool], why: str
) -> T:
    """``text`` converted; a usage error if it is not ``kind``, or ``why`` (``{}``: the value) if
    it is out of range."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    if out_of_range(value):
        raise argparse.ArgumentTypeError(why.format(value))
    return value


def seconds(text: str) -> float:
    return _checked(text, _finite, "a number of seconds", lambda s: s <= 0, "must be positive")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def positive(text: str) -> int:
    return _checked(text, int, "a whole number", lambda n: n < 1, "must be at least 1")


def port(text: str) -> int:
    """A TCP port to listen on; 0 lets the system pick a free one."""
    why = "{} is not a port number (0-65535)"
    return _checked(text, int, "a port number", lambda n: not 0 <= n <= 65535, why)


def connection_options() -> argparse.ArgumentParser:
    """``--redis`` and ``--namespace``, for the commands that read or steer a namespace."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help=f"Redis URL (default: ${URL_VARIABLE}, else {DEFAULT_URL}, where keyserial dev"
        " serves)",
    )
    common.add_argument(
        "--namespace", default=None, help="(default: $KEYSERIAL_NAMESPACE or default)"
    )
    common.set_defaults(log_level="WARNING")
    return common


def chosen_server(given: str | None) -> tuple[str, str]:
    """The Redis URL a command uses, and what chose it, in words: ``--redis``, else
    ``$KEYSERIAL_REDIS_URL``, else the default, where ``keyserial dev`` serves (never a Redis
    on the standard port, which may be anyone's: docs/deployment.md#the-default-server)."""
    if given:
        return given, "--redis"
    if os.environ.get(URL_VARIABLE):
        return os.environ[URL_VARIABLE], f"${URL_VARIABLE}"
    return DEFAULT_URL, f"the default, keyserial dev's; --redis or ${URL_VARIABLE} sets another"


def run_connected(
    args: argparse.Namespace, command: Callable[[Backend, argparse.Namespace], Awaitable[int]]
) -> int:
    """Run an operator's ``command`` on a connection to ``--redis``; its exit code. First
    ``args.settings`` and ``args.namespace`` are resolved: the flags, else their
    ``KEYSERIAL_*`` variables, as the worker's are."""
    args.settings = Settings.resolve(namespace=args.namespace)
    args.namespace = args.settings.namespace

    async def connected() -> int:
        backend = await Backend.connect(chosen_server(args.redis)[0])
        try:
            return await command(backend, args)
        finally:
            await backend.aclose()

    return anyio.run(connected)


def import_from_cwd() -> None:
    """Let ``--app myapp.ops`` find ``myapp`` in the current directory, as ``python -m`` would:
    a console script's path starts at its own directory, not the current one."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
