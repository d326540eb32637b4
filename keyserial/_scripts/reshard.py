"""Typed calls of the reshard scripts: ``move`` (record a move), ``seal`` (an old shard),
``drained`` (its owner says it is), ``quiet`` (read the three at once), ``flip`` (end the move)
and ``forwarded`` (a retired shard's inbox items, once its heir forwarded them). See
``_wire.resharding`` for the records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._wire.layout import ShardKeys, meta_key
from .._wire.resharding import Drained, Move, drained_key, seal_target, sealed_key
from .calls import Script, ScriptArgs, ScriptCall, script_args, text


@script_args("move")
class MoveArgs(ScriptArgs):
    #: ``<generation> <shards>`` of the layout the move leaves.
    leaves: str
    record: str


def record_move(move: Move) -> ScriptCall[str]:
    """Record ``move`` unless another is under way (``MoveRefused``); the record."""
    leaves = f"{move.source.generation} {move.source.shards}"
    return MoveArgs(leaves, move.encode()).call([meta_key(move.source.namespace)], text)


@script_args("seal")
class SealArgs(ScriptArgs):
    #: JSON ``[generation, shards]`` of the layout the shard's ops go to now.
    target: str


def seal(shard: ShardKeys, move: Move) -> ScriptCall[str]:
    """Seal ``shard`` of the move's source layout; its seal record."""
    keys = [shard.stream, sealed_key(shard), shard.inbox, shard.inbox_taken]
    return SealArgs(seal_target(move.target)).call(keys, text)


@script_args("forwarded")
class ForwardedArgs(ScriptArgs):
    #: The inbox's taken count, read with the items.
    taken: int
    #: How many of its first items were forwarded.
    count: int


def forwarded(shard: ShardKeys, taken: int, count: int) -> ScriptCall[int]:
    """Take the first ``count`` items of a retired shard's inbox out, forwarded, if its taken
    count is still ``taken``; 1 if it did, 0 if another worker had taken some out first."""
    return ForwardedArgs(taken, count).call([shard.inbox, shard.inbox_taken], int)


@script_args("drained")
class DrainedArgs(ScriptArgs):
    epoch: int
    #: The last entry the owner has taken in, and how many ops it has run: ``<id> <count>``.
    at: str


def record_drained(shard: ShardKeys, epoch: int, at: str, ran: int) -> ScriptCall[Any]:
    """Record that the owner of ``shard`` at ``epoch`` has drained it up to ``at``, having run
    ``ran`` ops."""
    return DrainedArgs(epoch, f"{at} {ran}").call([shard.epoch, drained_key(shard)], text)


@dataclass(frozen=True, slots=True)
class Quiet:
    """One sealed shard at one moment: its records as they are, and the stream's last id."""

    sealed: str
    drained: str
    last_id: str
    #: Holds of its keys for other shards' cross-shard ops (its held hash's length).
    held: int = 0

    @property
    def drained_record(self) -> Drained | None:
        return Drained.decode(self.drained)

    @property
    def drained_through(self) -> str | None:
        """The entry its owner has drained the shard up to, if it recorded one."""
        record = self.drained_record
        return None if record is None else record.through


def _quiet(reply: list[Any]) -> Quiet:
    sealed, drained, last = map(text, reply[:3])
    return Quiet(sealed, drained, last, int(reply[3]))


QUIET = Script.load("quiet")


def quiet(shard: ShardKeys) -> ScriptCall[Quiet]:
    """Read the shard's seal, drained record, last stream id and holds; writes nothing."""
    keys = [shard.stream, sealed_key(shard), drained_key(shard), shard.held]
    return ScriptCall(QUIET, keys, [], _quiet)


@script_args("flip")
class FlipArgs(ScriptArgs):
    record: str
    generation: int
    shards: int
    history: str


def flip(move: Move, history: str) -> ScriptCall[bool]:
    """Make the move's target the live layout: whether it was flipped now (not before)."""
    target = move.target
    args = FlipArgs(move.encode(), target.generation, target.shards, history)
    return args.call([meta_key(target.namespace)], lambda reply: reply == 1)
