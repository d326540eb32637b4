"""Confirming writes: a barrier write, then WAIT (WAITAOF with ``durable_fsync``), on one
connection to the master that made them (the ``durable_replicas`` setting, :class:`Durability`).

The count a WAIT returns covers every write the server executed before the barrier, whoever sent
it: the replication stream and the AOF are ordered. So one barrier confirms a whole pipeline of
script calls, or what a read found, sent on the same connection in the same round trip. A WAIT is
never sent on its own: after a failover, the master that answers it may not be the one that
made the writes (or answered the read) it is meant to confirm.

A message a call has to publish once it succeeds (a reply is an acknowledgement) goes out the
same way on every connection (:func:`run_publishing`): only after its writes, and once they are
confirmed, before anything sent next, at most once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._scripts.calls import REPLIES, ScriptCall, decoded
from .._scripts.refusals import Refused, ScriptMissing
from .._settings import Durability
from .._wire.json_text import dumps
from .._wire.layout import ShardKeys, same_slot_key
from ..errors import BackendUnavailable, ConfigError
from .commands import Command, merged_stored, raise_errors, stored_commands

if TYPE_CHECKING:
    from .backend import Backend

log = logging.getLogger("keyserial")

#: How long a barrier key lives: it only has to be written, never read.
_BARRIER_PX = 60_000

T = TypeVar("T")
#: ``(channel, message)`` pairs to publish.
Messages = list[tuple[str, str]]


def barrier_then_wait(key: str, durability: Durability) -> list[Command]:
    """A write that is always replicated, then a WAIT (WAITAOF) for it."""
    wait: Command = (
        ("WAITAOF", 1, durability.replicas, durability.wait_ms)
        if durability.fsync
        else ("WAIT", durability.replicas, durability.wait_ms)
    )
    return [("SET", key, "1", "PX", _BARRIER_PX), wait]


async def stored_confirmed(
    backend: Backend, durability: Durability | None, shard: ShardKeys, fields: Sequence[str]
) -> tuple[list[bytes | None], bool]:
    """What ``shard`` stores under ``fields`` (its results, or cross-shard records), as
    :meth:`~.backend.Backend.stored` reads it, and whether that is as durable as
    ``durability`` asks: read and confirmed on one connection, so the WAIT covers the master
    that answered the read (a master a failover has left behind answers no WAIT). A value
    found unconfirmed is no answer yet; without durability, the master's word is enough. So is
    its word that nothing is stored (no WAIT is spent on that: at worst an op is appended
    again, and its op id answers it from the outcome found later).

    :raises BackendUnavailable: if the server does not answer.
    """
    commands = stored_commands(shard, fields)
    return await _read_confirmed(backend, durability, shard, commands, merged_stored)


async def held_confirmed(
    backend: Backend, durability: Durability | None, shard: ShardKeys, field: str
) -> tuple[bytes | None, bool]:
    """The hold ``shard`` records under ``field`` (its held hash), and whether that is as
    durable as ``durability`` asks, read and confirmed as :func:`stored_confirmed` reads.

    :raises BackendUnavailable: if the server does not answer.
    """
    command: Command = ("HGET", shard.held, field)
    (held,), confirmed = await _read_confirmed(backend, durability, shard, [command], list)
    return held, confirmed


async def _read_confirmed(
    backend: Backend,
    durability: Durability | None,
    shard: ShardKeys,
    commands: list[Command],
    values: Callable[[list[Any]], list[bytes | None]],
) -> tuple[list[bytes | None], bool]:
    """The ``values`` of the replies to ``commands`` (reads of ``shard``), and whether they are
    confirmed: read again before a barrier and a WAIT when something was found (see
    :func:`stored_confirmed`)."""
    found = values(raise_errors(await backend.pipeline(commands)))
    if durability is None or not any(found):
        return found, True
    replies, confirmed = await _then_wait(backend, shard.barrier, commands, durability)
    return values(raise_errors(replies)), confirmed


async def run_confirmed(
    backend: Backend, calls: Sequence[ScriptCall[Any]], durability: Durability
) -> tuple[list[Any], bool]:
    """``backend.run_many(calls)`` followed, on the same connection, by a WAIT (WAITAOF)
    behind them: the replies, and whether the durability asked for holds for them. The calls
    and the WAIT go out in one round trip, to the master that serves the first call's keys (on
    a cluster, a call whose keys live elsewhere gets ``MOVED``, as ``BackendUnavailable``). A
    WAIT sent separately could reach another master, after a failover, and confirm writes that
    are not these.

    :raises BackendUnavailable: if the server does not answer.
    """
    barrier = same_slot_key(calls[0].keys[0], "barrier")
    commands = [call.evalsha_command() for call in calls]
    replies, confirmed = await _then_wait(backend, barrier, commands, durability)
    missing = [index for index, reply in enumerate(replies) if isinstance(reply, ScriptMissing)]
    if missing:
        # A restarted server: those are sent as EVAL, with a WAIT of their own. The calls that
        # did run stay covered by the first WAIT only (the second may reach another node).
        again, confirmed_again = await _then_wait(
            backend, barrier, [calls[index].eval_command() for index in missing], durability
        )
        for index, reply in zip(missing, again, strict=True):
            replies[index] = reply
        confirmed = confirmed_again and (confirmed or len(missing) == len(calls))
    return decoded(calls, replies), confirmed


async def run_publishing(
    backend: Backend,
    calls: Sequence[ScriptCall[Any]],
    outgoing: Sequence[T | None],
    messages: Callable[[Sequence[T]], Messages],
    durability: Durability | None,
) -> tuple[list[Any], bool]:
    """Run ``calls`` in one round trip (confirmed as ``durability`` asks, see
    :func:`run_confirmed`) and publish what each call that succeeds has to say: ``outgoing``,
    one per call (None: nothing), made into messages by ``messages``, which merges several
    calls' into one per channel. The replies, and whether they are confirmed.

    On every connection a call's messages go out only if it succeeded and its writes are
    confirmed, after them and before anything sent once this returns, at most once. A script
    that can (``Script.publishes``) publishes its call's itself, in the same round trip, where
    that saves one and no confirmation has to come first: it is the batch's only call with
    something to say, or :meth:`~.backend.Backend.publish_after` would wait for an answer.
    The others' go out after the batch, merged.

    :raises BackendUnavailable: if the server does not answer.
    """
    calls, after = list(calls), list(outgoing)
    if durability is None:
        saying = [index for index, said in enumerate(after) if said is not None]
        if len(saying) == 1 or backend.publish_after_waits:
            for index in saying:
                said = after[index]
                if said is not None and calls[index].script.publishes:
                    calls[index] = calls[index].with_arg(REPLIES, dumps(messages([said])))
                    after[index] = None
        replies, confirmed = await backend.run_many(calls), True
    else:
        replies, confirmed = await run_confirmed(backend, calls, durability)
    if confirmed:
        succeeded = [
            said
            for said, reply in zip(after, replies, strict=True)
            if said is not None and not isinstance(reply, Exception)
        ]
        published = messages(succeeded) if succeeded else []
        if published:
            await backend.publish_after(published)
    return replies, confirmed


async def _then_wait(
    backend: Backend, key: str, commands: Sequence[Command], durability: Durability
) -> tuple[list[Any], bool]:
    """``commands``, then a barrier and a WAIT, on one connection to the master serving
    ``key``: the commands' replies, and whether the WAIT confirms them. On a cluster, a refused
    WAIT or a redirected command means a slot moved (a failover): the routing is learnt again."""
    replies = await backend.on_node(key, [*commands, *barrier_then_wait(key, durability)])
    waited = replies.pop()
    replies.pop()  # the barrier's OK
    moved = any(isinstance(reply, BackendUnavailable) for reply in replies)
    if backend.is_cluster and (moved or isinstance(waited, Exception)):
        await backend.refresh_routing()
    return replies, _enough(backend.url, waited, durability)


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
