"""keyserial's Lua scripts as calls that are data: what each script is, and one call of it.

A call is data, not a coroutine, because calls are pipelined: the pipeliner batches the calls of
many shard runners into one round trip, and fills a call's ``replies`` argument (the replies a
script publishes once it has committed) by name. ``Backend.run_many`` sends them and hands back
each reply as its call decodes it, or the refusal it met (``_scripts.refusals``).

The typed calls of each script (KEYS from the key layout, ARGV from a dataclass whose fields are
named and ordered as the script's header, ``keyserial/_scripts/lua/<name>.lua``, documents them,
the reply as a dataclass) are in ``_scripts.submit``, ``_scripts.lease``, ``_scripts.commit`` and
``_scripts.cross``. Nothing here talks to Redis.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar, dataclass_transform

from .._wire.json_text import dumps

ScriptArg: TypeAlias = str | int | float | bytes
R = TypeVar("R")

#: The argument a script takes the replies to publish in, JSON ``[[channel, message], ...]``.
REPLIES = "replies"


class ScriptArgs:
    """Base of a script's arguments, declared with :func:`script_args`: a dataclass whose fields
    are its ARGV, in order. A bool is sent as 1 or 0 (scripts read '1' or '0'), a list or a tuple
    as JSON."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]
    #: The script these are the arguments of.
    SCRIPT: ClassVar[Script]
    #: Reads the fields in order (made once per class: the calls of a busy worker or client are
    #: many).
    _values: ClassVar[Callable[[Any], tuple[Any, ...]]]

    def argv(self) -> list[ScriptArg]:
        return [
            int(value) if type(value) is bool else dumps(value) if type(value) in _JSON else value
            for value in type(self)._values(self)
        ]

    def call(self, keys: Sequence[str], decode: Callable[[Any], R]) -> ScriptCall[R]:
        """A call of the script with these arguments."""
        return ScriptCall(type(self).SCRIPT, keys, self.argv(), decode)


_JSON = (list, tuple)

A = TypeVar("A", bound=ScriptArgs)


@dataclass_transform(field_specifiers=(field,))
def script_args(name: str) -> Callable[[type[A]], type[A]]:
    """Declare a class as the arguments of ``keyserial/_scripts/lua/<name>.lua``: a slotted
    dataclass (slots: one is made per step), its script loaded once as ``SCRIPT``."""

    def declare(cls: type[A]) -> type[A]:
        kind = dataclass(slots=True)(cls)  # a new class: slots need one
        names = tuple(kind.__dataclass_fields__)
        getter = operator.attrgetter(*names)
        kind._values = getter if len(names) > 1 else lambda args: (getter(args),)
        kind.SCRIPT = Script.load(name, kind)
        return kind

    return declare


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script from ``keyserial/_scripts/lua``, called by SHA (``EVAL`` when the server lacks
    it)."""

    name: str
    text: str
    sha: str
    #: Its ARGV's names, in order.
    argv: tuple[str, ...] = ()

    @classmethod
    def load(cls, name: str, args: type[ScriptArgs] | None = None) -> Script:
        """The script, after ``lib.lua`` if it uses a name defined there (every call of a script
        runs its whole text, and making the helpers' closures costs about a microsecond)."""
        lua = resources.files("keyserial._scripts").joinpath("lua")
        text = lua.joinpath(f"{name}.lua").read_text()
        lib = lua.joinpath("lib.lua").read_text()
        if any(re.search(rf"\b{helper}\b", text) for helper in _defined(lib)):
            text = lib + text
        names = () if args is None else tuple(args.__dataclass_fields__)
        return cls(name, text, hashlib.sha1(text.encode()).hexdigest(), names)

    @property
    def publishes(self) -> bool:
        """Whether the script can publish replies itself, given them as its ``replies``."""
        return REPLIES in self.argv


def _defined(lua: str) -> list[str]:
    """The names a Lua text defines at its top level (``local function f``, ``local X =``)."""
    return re.findall(r"^local (?:function )?(\w+)", lua, re.MULTILINE)


def as_sent(reply: Any) -> Any:
    """The reply as Redis sent it (a call no typed function built decodes nothing)."""
    return reply


@dataclass(slots=True)  # (not frozen: one is made per step, and frozen ones build slower)
class ScriptCall(Generic[R]):
    """One call of a script: its KEYS and ARGV, and how to read its reply."""

    script: Script
    keys: Sequence[str]
    args: Sequence[ScriptArg]
    decode: Callable[[Any], R] = as_sent

    def with_arg(self, name: str, value: ScriptArg) -> ScriptCall[R]:
        """This call with its argument ``name`` set to ``value``."""
        args = list(self.args)
        args[self.script.argv.index(name)] = value
        return ScriptCall(self.script, self.keys, args, self.decode)

    def evalsha_command(self) -> tuple[ScriptArg, ...]:
        """The command that runs it, by SHA."""
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def eval_command(self) -> tuple[ScriptArg, ...]:
        """The command that runs it, sending its text (for a server that lacks the SHA)."""
        return ("EVAL", self.script.text, len(self.keys), *self.keys, *self.args)


def decoded(calls: Sequence[ScriptCall[Any]], replies: Sequence[Any]) -> list[Any]:
    """Each call's reply as the call decodes it; an error as it is."""
    return [
        reply if isinstance(reply, Exception) else call.decode(reply)
        for call, reply in zip(calls, replies, strict=True)
    ]


def text(value: Any) -> str:
    """A bulk or integer reply as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def pairs(flat: Sequence[Any]) -> list[tuple[Any, Any]]:
    """``[a, 1, b, 2]`` as ``[(a, 1), (b, 2)]`` (how a script returns a table of fields)."""
    return list(zip(flat[::2], flat[1::2], strict=True))
