"""Confirming writes: a barrier write, then WAIT (WAITAOF with ``durable_fsync``), on one
connection to the master that made them (the ``durable_replicas`` setting, :class:`Durability`).

The count a WAIT returns covers every write the server executed before the barrier, whoever sent
it: the replication stream and the AOF are ordered. So one barrier confirms a whole pipeline of
script calls, and on keyserial's own connection it rides in the same round trip as the calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._commands import Command
from ._layout import ShardKeys, same_slot_key
from ._refusals import Refused, ScriptMissing
from ._scripts import ScriptCall, decoded
from ._settings import Durability
from .errors import ConfigError

if TYPE_CHECKING:
    from ._backend import Backend

log = logging.getLogger("keyserial")

#: How long a barrier key lives: it only has to be written, never read.
_BARRIER_PX = 60_000


def barrier_then_wait(key: str, durability: Durability) -> list[Command]:
    """A write that is always replicated, then a WAIT (WAITAOF) for it."""
    wait: Command = (
        ("WAITAOF", 1, durability.replicas, durability.wait_ms) if durability.fsync
        else ("WAIT", durability.replicas, durability.wait_ms)
    )
    return [("SET", key, "1", "PX", _BARRIER_PX), wait]


async def confirm(backend: Backend, key: str, durability: Durability) -> bool:
    """Whether every write the server had executed before this call is on
    ``durability.replicas`` replicas (and in the AOFs, with ``fsync``), waiting at most
    ``durability.wait_ms``: a write to ``key`` (its node, on a cluster), then WAIT or WAITAOF,
    on one connection. False when the server refuses either.

    :raises BackendUnavailable: if the server does not answer.
    """
    waited = (await backend.on_node(key, barrier_then_wait(key, durability)))[-1]
    if isinstance(waited, Exception) and backend.is_cluster:
        # Most likely a failover moved the slot (MOVED, or a wait refused by what is now a
        # replica): learn where it lives now.
        await backend.refresh_routing()
    return _enough(backend.url, waited, durability)


async def stored_confirmed(
    backend: Backend, durability: Durability | None, shard: ShardKeys
) -> bool:
    """Whether what ``shard`` stores now is as durable as ``durability`` asks (always, when it
    asks nothing more than the master): a stored result is an answer only then, as a reply is.

    :raises BackendUnavailable: if the server does not answer.
    """
    return durability is None or await confirm(backend, shard.barrier, durability)


async def run_confirmed(
    backend: Backend, calls: Sequence[ScriptCall[Any]], durability: Durability
) -> tuple[list[Any], bool]:
    """``backend.run_many(calls)``, then :func:`confirm` behind their writes: the replies, and
    whether the durability asked for holds for them. On keyserial's own connection both go out
    in one round trip.

    :raises BackendUnavailable: if the server does not answer.
    """
    barrier = same_slot_key(calls[0].keys[0], "barrier")
    if not backend.in_order or backend.is_cluster:
        replies = await backend.run_many(calls)
        # On a cluster, one barrier on each master the calls wrote to.
        barriers = {backend.node_of(call.keys[0]): call.keys[0] for call in calls}
        for key in barriers.values():
            if not await confirm(backend, same_slot_key(key, "barrier"), durability):
                return replies, False
        return replies, True
    commands = [call.evalsha_command() for call in calls] + barrier_then_wait(barrier, durability)
    replies = await backend.on_node(barrier, commands)  # (on keyserial's own connection)
    waited = replies.pop()
    replies.pop()  # the barrier's OK
    if any(isinstance(reply, ScriptMissing) for reply in replies):
        # A restarted server: the EVALs that follow must be covered by a wait of their own.
        return await backend.run_many(calls), await confirm(backend, barrier, durability)
    return decoded(calls, replies), _enough(backend.url, waited, durability)


async def check_durability(backend: Backend, durability: Durability | None) -> None:
    """Refuse at once what could never be confirmed: ``durable_fsync`` on a server without
    WAITAOF or with appendonly off (every acknowledgement would wait forever).

    :raises ConfigError: naming what the server lacks.
    """
    if durability is None or not durability.fsync:
        return
    try:
        await backend.call("WAITAOF", 1, 0, 1)
    except Refused as exc:
        raise ConfigError(
            f"durable_fsync needs WAITAOF (Redis 7.2+, Valkey 8+) with appendonly on;"
            f" {backend.url} answered: {exc}"
        ) from None


def _enough(url: str, waited: Any, durability: Durability) -> bool:
    """Whether a WAIT's (or WAITAOF's) reply meets ``durability``."""
    if isinstance(waited, Exception):
        log.warning("cannot confirm writes (%s): %s", url, waited)
        return False
    if durability.fsync:
        local, replicas = waited
        return int(local) >= 1 and int(replicas) >= durability.replicas
    return int(waited) >= durability.replicas
