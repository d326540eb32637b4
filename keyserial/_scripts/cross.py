"""Typed calls of the grant protocol's scripts (``_worker.crossshard.cross_shard``): a participant
``grant`` s its keys, the coordinator ``decide`` s, a participant that missed the decision
``resolve`` s it.

``grant`` and ``decide`` are fenced (refused with ``Fenced`` when another owner took the shard
over).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._wire.layout import ShardKeys
from .calls import ScriptArgs, ScriptCall, acknowledged, script_args, text


@script_args("grant")
class GrantArgs(ScriptArgs):
    """A participant's grant of its keys to an attempt's coordinator."""

    epoch: int
    #: The grant's record in the results hash: ``<op>#<attempt>#g``.
    field: str
    #: The grant (JSON): the keys' committed states and fencing token.
    grant: str
    #: The coordinator's channel ('' with durable_replicas: the owner publishes the grant once
    #: replicas have it).
    channel: str
    #: The request's entry, where the keys were held (``RequestGone`` if the stream lacks it).
    entry_id: str
    #: What is published: the grant, signed for the coordinator's worker (which then takes it
    #: without reading the record back).
    message: str


def grant(shard: ShardKeys, args: GrantArgs) -> ScriptCall[None]:
    """Record a grant of the participant shard's keys and publish it (fenced)."""
    return args.call([shard.epoch, shard.results, shard.stream], acknowledged)


@script_args("decide")
class DecideArgs(ScriptArgs):
    """A coordinator's decision of one attempt, and what the home shard commits with it."""

    epoch: int
    op_id: str
    #: The home epoch the attempt began in.
    attempt: int
    #: The decision (JSON): ``{"w": {shard: writes}}``.
    decision: str
    #: The home shard's writes: (key, JSON state or '' to delete).
    home_writes: Sequence[tuple[str, str]]
    #: The op's outcome (JSON).
    outcome: str
    #: Messages to publish if the decision wins: (channel, message).
    notices: Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Decided:
    """What ``decide`` found: this decision won (also when an earlier call of it did), or the
    abort a participant recorded first (nothing written)."""

    won: bool
    abort: str | None = None


def _decided(reply: list[Any]) -> Decided:
    if int(reply[0]) == 1:
        return Decided(won=True)
    return Decided(won=False, abort=text(reply[1]))


def decide(home: ShardKeys, args: DecideArgs) -> ScriptCall[Decided]:
    """Record the attempt's decision, with the home shard's writes and the op's result, if the
    attempt has none yet (fenced)."""
    keys = [home.epoch, home.state, home.results, home.results_old]
    return args.call(keys, _decided)


@script_args("resolve")
class ResolveArgs(ScriptArgs):
    """The attempt whose decision a participant looks up."""

    op_id: str
    #: The home epoch the attempt began in.
    attempt: int


def _decision(reply: bytes | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    decision: dict[str, Any] = json.loads(reply)
    return decision


def resolve(home: ShardKeys, args: ResolveArgs) -> ScriptCall[dict[str, Any] | None]:
    """The attempt's decision; an abort, recorded now, if its coordinator's epoch is over; None
    while it is undecided and its coordinator still owns the home shard. Not fenced."""
    keys = [home.epoch, home.results, home.results_old]
    return args.call(keys, _decision)
