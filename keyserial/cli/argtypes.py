"""Argument types the command line shares: each rejects bad input as a usage error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
