"""The records of a reshard (``keyserial reshard``), as they are kept in Redis.

A reshard moves a namespace from one :class:`Layout` to the next generation. Every step of it is
a record that only the worker (admin) user can write; pub/sub only says that one changed:

- the *move*, in the meta hash (field ``move``): which layout the namespace leaves, for which;
- each old shard's *seal* (``ks:{<ns>:<shard>}:sealed``): from it on, the submit script refuses
  clients' appends there (``RESHARDED``), and names the last entry appended before it;
- each old shard's *drained* record (``…:drained``): written by its owner, fenced by its epoch,
  once everything up to a given entry has taken effect and nothing is under way, with how many
  ops that owner has run (ops appended past the seal, which it forwards, do not count);
- the *flip*: the meta hash's ``shards`` and ``generation`` become the new layout's, the move is
  dropped, and the old layout joins the ``history`` (where results stored before are found).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .json_text import dumps
from .layout import Layout, ShardKeys

#: The wake-up published on :func:`layout_channel` once a move was recorded or flipped.
LAYOUT_CHANGED = "layout"


def layout_channel(namespace: str) -> str:
    """Where a change of the namespace's layout records is announced (a wake-up only: whoever
    hears it reads the meta hash)."""
    return f"ks:{namespace}:layout"


def sealed_key(shard: ShardKeys) -> str:
    """The shard's seal record (the submit script finds it next to the stream)."""
    return f"{shard.tag}:sealed"


def drained_key(shard: ShardKeys) -> str:
    """The shard's drained record: ``<epoch> <entry id> <ops run>`` (see :class:`Drained`)."""
    return f"{shard.tag}:drained"


@dataclass(frozen=True)
class Drained:
    """A sealed shard's drained record: its owner (by epoch) ran or forwarded every entry up to
    ``through``, with nothing under way, having run ``ran`` ops."""

    epoch: str
    through: str
    ran: str

    @classmethod
    def decode(cls, text: str) -> Drained | None:
        epoch, _, rest = text.partition(" ")
        through, _, ran = rest.partition(" ")
        return cls(epoch, through, ran) if through else None

    @property
    def work(self) -> tuple[str, str]:
        """Whose, and how much: unchanged between two readings while the shard ran nothing."""
        return self.epoch, self.ran


def _pair(layout: Layout) -> list[int]:
    return [layout.generation, layout.shards]


def _layout(namespace: str, value: Any) -> Layout:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(type(number) is int and number >= 0 for number in value)
        or value[1] < 1
    ):
        raise ConfigError(f"malformed layout {value!r} in the reshard records")
    return Layout(namespace, value[1], value[0])


def _decode(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise ConfigError(f"malformed {what} record {text!r}")
    return record


@dataclass(frozen=True, slots=True)
class Move:
    """A reshard under way: from ``source`` to ``target`` (the next generation)."""

    source: Layout
    target: Layout

    def encode(self) -> str:
        return dumps({"v": 1, "from": _pair(self.source), "to": _pair(self.target)})

    @classmethod
    def decode(cls, namespace: str, text: str | bytes) -> Move:
        record = _decode(text, "move")
        if record.get("v") != 1:
            raise ConfigError(f"move record {text!r} is of a version this keyserial lacks")
        source = _layout(namespace, record.get("from"))
        target = _layout(namespace, record.get("to"))
        if target.generation != source.generation + 1:
            raise ConfigError(f"malformed move record {text!r}: not to the next generation")
        return cls(source, target)


@dataclass(frozen=True, slots=True)
class Seal:
    """An old shard sealed by a move: its ops go to ``target`` now; ``last`` is the last entry
    appended before the seal ('0-0': none ever was)."""

    target: Layout
    last: str

    @classmethod
    def decode(cls, namespace: str, text: str | bytes) -> Seal:
        record = _decode(text, "seal")
        last = record.get("last")
        if not isinstance(last, str):
            raise ConfigError(f"malformed seal record {text!r}")
        return cls(_layout(namespace, record.get("to")), last)


def seal_target(layout: Layout) -> str:
    """The ``to`` of a seal record, as ``seal.lua`` writes it."""
    return dumps(_pair(layout))


@dataclass(frozen=True, slots=True)
class LayoutRecord:
    """The meta hash's layout fields: the live layout, the move under way if any, and the
    layouts before (oldest first), each with when (ms) it stopped taking ops."""

    live: Layout
    move: Move | None = None
    history: tuple[tuple[Layout, int], ...] = ()

    @property
    def routing(self) -> Layout:
        """Where new ops go: the move's target once one is recorded (its shards run nothing
        before the flip, and every op on a key appended to the old layout takes effect first)."""
        return self.live if self.move is None else self.move.target

    def history_after_flip(self, now_ms: int, keep_ms: int) -> str:
        """The ``history`` field the flip writes: the live layout added, those that stopped
        taking ops more than ``keep_ms`` ago (no result stored there is kept longer) dropped."""
        kept = [
            [layout.generation, layout.shards, until]
            for layout, until in self.history
            if until >= now_ms - keep_ms
        ]
        return dumps([*kept, [self.live.generation, self.live.shards, now_ms]])

    @classmethod
    def decode(
        cls,
        namespace: str,
        shards: bytes,
        generation: bytes | None,
        move: bytes | None,
        history: bytes | None,
    ) -> LayoutRecord:
        live = Layout(namespace, int(shards), 0 if generation is None else int(generation))
        return cls(
            live,
            None if move is None else Move.decode(namespace, move),
            () if history is None else _history(namespace, history),
        )


def _history(namespace: str, text: bytes) -> tuple[tuple[Layout, int], ...]:
    try:
        items = json.loads(text)
        return tuple(
            (_layout(namespace, [generation, shards]), int(until))
            for generation, shards, until in items
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"malformed layout history {text!r}") from exc
