"""keyserial's commands and their replies as data, with no I/O: a command's shape, the commands
a read is made of and how its replies merge, and a pipeline's replies with their errors raised.
``_backend.backend.Backend`` sends them (its methods name each read and write by what the keys
hold) and turns every error reply into keyserial's exceptions first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._scripts.calls import ScriptArg
from .._wire.layout import ShardKeys, is_shard_channel

Command = Sequence[ScriptArg]


def raise_errors(replies: list[Any]) -> list[Any]:
    """``replies``, once none of them is an error (the first one is raised)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def raised(reply: Any) -> Any:
    """``reply``, unless it is an error: raised."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def publish_command(channel: str, message: str) -> Command:
    """The command that publishes on ``channel``: SPUBLISH for a shard channel (routed to the
    node of its slot), PUBLISH for any other."""
    return ("SPUBLISH" if is_shard_channel(channel) else "PUBLISH", channel, message)


def stored_commands(shard: ShardKeys, fields: Sequence[str]) -> list[Command]:
    """The reads of :meth:`.Backend.stored`: both generations of the shard's results."""
    return [("HMGET", shard.results, *fields), ("HMGET", shard.results_old, *fields)]


def merged_stored(replies: Sequence[Any]) -> list[bytes | None]:
    """The replies of :func:`stored_commands` as one value per field: the current
    generation's, else the previous one's."""
    current, previous = replies
    return [
        now if now is not None else before for now, before in zip(current, previous, strict=True)
    ]
