"""Typed calls of the script an operator cancels a pending timer with (``cancel.lua``)."""

from __future__ import annotations

from collections.abc import Sequence

from .._wire.layout import ShardKeys
from .calls import Script, ScriptCall

CANCEL = Script.load("cancel")


def cancel_timer(
    shard: ShardKeys, timer_id: str, item: bytes, outcome: str, op_ids: Sequence[str]
) -> ScriptCall[bool]:
    """Remove the pending timer ``timer_id`` if its item is still ``item`` (it has not fired),
    answering its ``op_ids`` with ``outcome``; whether it did."""
    keys = [shard.timers, shard.timed, shard.results, shard.results_old]
    return ScriptCall(CANCEL, keys, [timer_id, item, outcome, *op_ids], lambda reply: bool(reply))
