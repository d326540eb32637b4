"""Typed calls of an owner's fenced commit: ``step``, which also writes the other shards of the
cross-shard ops it commits when one worker owns them all, on a standalone server.

It takes the replies it publishes once committed as its ``replies`` argument, which the
pipeliner fills by name (``ScriptCall.with_arg``). It refuses with ``Fenced`` when another owner
took the shard over, and with ``OwnedElsewhere`` when one of those other shards changed hands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._wire.json_text import dumps
from .._wire.layout import ShardKeys
from .._wire.resharding import sealed_key
from .calls import ScriptArgs, ScriptCall, pairs, script_args, text


@script_args("step")
class StepArgs(ScriptArgs):
    """What one step commits, and where it fetches from."""

    epoch: int
    #: The last entry whose ops have all finished, or '' to keep progress where it is.
    progress: str
    #: Start a new results generation if the current one is a retention period old.
    rotate: bool
    #: The last entry fetched already (exclusive).
    cursor: str
    #: Entries to fetch (0: commit only).
    fetch: int
    #: What to commit, one JSON object (``{"s": …, "r": …, "d": …, "x": …}``), or ''.
    commit: str
    replaying: bool
    result_ttl_ms: int
    #: The last committed entry not trimmed from the stream yet, or ''.
    trim_to: str
    #: Trim through ``trim_to`` now, rather than only once the fetch finds nothing new.
    trim_now: bool
    #: The owner holds every state of the shard: the script reads none.
    states_held: bool
    #: Replies to publish once committed (JSON), or '' (the pipeliner fills it).
    replies: str = ""
    #: The last entry taken in from a push since the last step, or '': the horizon covers it.
    pushed_to: str = ""
    #: This owner takes pushed entries from now on: the step records its epoch as the one that
    #: does (a takeover then counts every entry in the stream as fetched).
    takes_pushes: bool = False
    #: The entries taken in from pushes since the last step, to confirm in the stream before
    #: anything is committed (``Wakeups.to_confirm``; their fields and values follow ARGV), or
    #: ''.
    pushed: str = ""
    #: The op ids to look up in the layouts before a reshard (set by :func:`step`).
    earlier: str = ""


@dataclass(slots=True)
class StepReply:
    """What a step fetched."""

    #: The fetched entries, in stream order: (entry id, fields).
    entries: list[tuple[str, dict[bytes, bytes]]]
    #: The stored outcome (JSON) of each fetched op id that already has one.
    done: dict[str, str]
    #: The committed state (JSON, None: none) of every key the entries name, unless the owner
    #: holds them all.
    states: dict[str, str | None]
    #: The shard's seal record, read with the entries (None: not sealed, or nothing fetched).
    sealed: str | None = None
    #: The shard's paused keys, read with the entries (None: nothing fetched).
    paused: set[str] | None = None


def fields(raw: Any) -> dict[bytes, bytes]:
    """A stream entry's fields (a flat list in RESP2, a map in RESP3)."""
    return raw if isinstance(raw, dict) else dict(pairs(raw))


def _step_reply(reply: list[Any]) -> StepReply:
    entries, outcomes, states, sealed, paused = reply
    return StepReply(
        entries=[(text(entry_id), fields(raw)) for entry_id, raw in entries],
        done={text(op_id): text(outcome) for op_id, outcome in pairs(outcomes)},
        states={text(key): text(state) or None for key, state in pairs(states)},
        sealed=text(sealed) if sealed else None,
        paused={text(key) for key, _ in pairs(paused)} if entries else None,
    )


def step(
    shard: ShardKeys,
    args: StepArgs,
    others: Sequence[ShardKeys] = (),
    earlier: Sequence[tuple[ShardKeys, Sequence[str]]] = (),
    pushed_fields: Sequence[bytes] = (),
) -> ScriptCall[StepReply]:
    """Commit what finished, then fetch the next entries (fenced by ``args.epoch``; refused with
    ``PushUnconfirmed`` if a pushed entry is not in the stream as pushed, with ``Replayed`` if
    an outcome it stores is stored already). ``others``: the shards whose writes the commit's
    ``"o"`` carries, in its order (see step.lua), each fenced by the epoch it names there.
    ``earlier``: shards of layouts before a reshard, each with the op ids of the commit homed
    there; ``Replayed`` too if one has an outcome there (both on a standalone server only).
    ``pushed_fields``: the fields and values of the entries ``args.pushed`` names, in order."""
    k = shard
    keys = [
        k.epoch,
        k.state,
        k.progress,
        k.stream,
        k.results,
        k.results_old,
        k.dead,
        k.horizon,
        k.results_since,
        k.pushes,
        sealed_key(k),
        k.paused,
    ]
    for other in others:
        keys += [other.epoch, other.state]
    if earlier:
        checks = []
        for there, op_ids in earlier:
            checks.append([len(keys) + 1, op_ids])  # (Lua counts KEYS from 1)
            keys += [there.results, there.results_old]
        args.earlier = dumps(checks)
    call = args.call(keys, _step_reply)
    if pushed_fields:
        call.args = [*call.args, *pushed_fields]
    return call
