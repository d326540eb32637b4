"""A namespace's pending timers (delayed ops, and timers ops set), as an operator lists and
cancels them. Each shard keeps its own in Redis (``_wire.timers``); a cancel is atomic with the
owner's firing (``cancel.lua``): it removes a timer that has not fired, and answers its ops as
cancelled, or changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._scripts.timers import cancel_timer
from .._wire.codec import encode_error, keys_named
from .._wire.json_text import parse
from .._wire.layout import Layout
from .._wire.routing import shard_for
from ..errors import TimerCancelled


@dataclass(frozen=True, slots=True)
class PendingTimer:
    shard: int
    #: Its id in the shard's timers: a delayed op's entry place (16 digits), or the
    #: ``<op id>#t<n>`` of a timer an op set (after a reshard, prefixed by its old shard).
    timer_id: str
    #: When it is due, in ms since the Unix epoch, by Redis's clock.
    due_ms: int
    #: Its ops: (op id, op name, keys), as far as its item can be read.
    ops: tuple[tuple[str, str, tuple[str, ...]], ...]
    #: Its item, as Redis holds it (a cancel checks it has not changed).
    item: bytes

    @property
    def keys(self) -> set[str]:
        return {key for _, _, keys in self.ops for key in keys}

    def as_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "id": self.timer_id,
            "due_ms": self.due_ms,
            "ops": [
                {"id": op_id, "op": name, "keys": list(keys)} for op_id, name, keys in self.ops
            ],
        }


def _ops(item: bytes) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """The ops of a timer's item (an inbox item: ``<version>[ fresh]\\n<ops JSON>``); those that
    cannot be read are left out."""
    try:
        envelopes = parse(item.partition(b"\n")[2])
    except ValueError:
        return ()
    found = []
    for envelope in envelopes if isinstance(envelopes, list) else ():
        if not isinstance(envelope, dict) or not isinstance(envelope.get("id"), str):
            continue
        named = tuple(keys_named(envelope) or ())
        found.append((envelope["id"], str(envelope.get("op", "")), named))
    return tuple(found)


async def pending(
    backend: Backend, layout: Layout, shards: Sequence[int], *, key: str | None = None
) -> list[PendingTimer]:
    """The pending timers of ``shards`` (``key`` given: those whose ops name it, on its shard),
    soonest due first."""
    if key is not None:
        shards = [shard_for(key, layout.shards)]
    found = [
        PendingTimer(shard, timer_id.decode(errors="replace"), int(due), _ops(item), item)
        for shard in shards
        for timer_id, due, item in await backend.timers(layout.keys(shard))
    ]
    if key is not None:
        found = [timer for timer in found if key in timer.keys]
    return sorted(found, key=lambda timer: (timer.due_ms, timer.shard, timer.timer_id))


async def cancel(backend: Backend, layout: Layout, timer: PendingTimer) -> bool:
    """Cancel ``timer`` unless it has fired (its ops are answered ``keyserial.TimerCancelled``,
    unless one has an outcome already); whether it did."""
    outcome = encode_error(
        TimerCancelled.wire_type, f"timer {timer.timer_id!r} was cancelled by an operator"
    )
    op_ids = [op_id for op_id, _, _ in timer.ops]
    keys = layout.keys(timer.shard)
    return await backend.run_call(cancel_timer(keys, timer.timer_id, timer.item, outcome, op_ids))
