"""An op call as it travels: the one thing a client sends of an op (its code stays on the
workers, registered under its name)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Call(Generic[R_co]):
    """A registered op's name and its JSON arguments: all that travels to the worker (its
    result type, ``R_co``, is the caller's to know)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
