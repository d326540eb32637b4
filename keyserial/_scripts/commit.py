"""Typed calls of an owner's fenced commit: ``step``, which also writes the other shards of the
cross-shard ops it commits when one worker owns them all, on a standalone server; and
``StepCommit``, what one step commits, as the script takes it.

It takes the replies it publishes once committed as its ``replies`` argument, which the
pipeliner fills by name (``ScriptCall.with_arg``). It refuses with ``Fenced`` when another owner
took the shard over, and with ``OwnedElsewhere`` when one of those other shards changed hands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
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
    #: Whether the step commits (its parts follow the named arguments): set by :func:`step`.
    commit: bool = field(default=False, kw_only=True)
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
    #: ``<place> <keep>``: the place of the first inbox item taken in from a push since the
    #: last step, and per item '1' to move it into the stream or '0' if its ops have all
    #: committed (it goes); or '' (none). The step confirms that the inbox holds those items
    #: first, as pushed (they follow the commit's arguments), before anything is committed.
    pushed: str = ""
    #: This owner takes pushed entries from now on: the step records its epoch as the one that
    #: does (a takeover then counts every entry in the stream and the inbox as fetched).
    takes_pushes: bool = False
    #: The op ids to look up in the layouts before a reshard (set by :func:`step`).
    earlier: str = ""


#: A state write: (key, JSON state, or '' to delete it).
Write = tuple[str, str]


@dataclass(frozen=True, slots=True)
class StepCommit:
    """What one step commits, as step.lua takes it after its named arguments: the sizes of its
    twelve parts, then their values. The script hands the values to ``HSET`` and ``HMGET`` as they
    come: one JSON argument cost it about a microsecond per op to decode and flatten."""

    #: The sizes, then the values.
    args: list[str]

    @classmethod
    def of(
        cls,
        writes: Sequence[Write] = (),
        results: Sequence[tuple[str, str]] = (),
        *,
        answered: Sequence[tuple[str, str]] = (),
        decisions: Sequence[tuple[str, str]] = (),
        holds: Sequence[tuple[str, str]] = (),
        released: Sequence[str] = (),
        dead: Sequence[tuple[str, str, str]] = (),
        passed: Sequence[str] = (),
        timers: Sequence[tuple[str, int, str]] = (),
        cancelled: Sequence[tuple[str, str]] = (),
        others: Sequence[tuple[int, int, Sequence[Write]]] = (),
    ) -> StepCommit:
        """The commit of the shard's ``writes``; the ``results`` (op id, outcome) and
        ``answered`` records to store; the ``decisions`` (field, decision) of cross-shard ops
        this shard coordinates, the ``holds`` of its keys for others' (field, grant: each
        recorded unless its attempt has an outcome here already) and the holds ``released``
        (their fields); the ``dead`` letters (entry id, reason, raw entry); the ``passed``
        entries to delete from the stream; the ``timers`` its ops set (id, delay in ms, inbox
        item) and those they ``cancelled`` (id, the outcome its op is answered with); and
        ``others``, the writes to other shards (j, that shard's owner's epoch, writes), j
        counting from 1 in the order :func:`step` is given their keys."""
        sets, deletes = _split(writes)
        values = [
            str(len(sets) >> 1),
            str(len(deletes)),
            str(len(results)),
            str(len(answered)),
            str(len(decisions)),
            str(len(holds)),
            str(len(released)),
            str(len(dead)),
            str(len(passed)),
            str(len(others)),
            str(len(timers)),
            str(len(cancelled)),
            *sets,
            *deletes,
            *chain.from_iterable(results),
        ]
        if (
            answered
            or decisions
            or holds
            or released
            or dead
            or passed
            or others
            or timers
            or cancelled
        ):
            values += chain.from_iterable(answered)  # (seldom, these)
            values += chain.from_iterable(decisions)
            values += chain.from_iterable(holds)
            values += released
            values += chain.from_iterable(dead)
            values += passed
            values += (str(value) for timer in timers for value in timer)
            values += chain.from_iterable(cancelled)
            for j, epoch, other_writes in others:
                other_sets, other_deletes = _split(other_writes)
                values += (str(j), str(epoch), str(len(other_sets) >> 1), str(len(other_deletes)))
                values += other_sets
                values += other_deletes
        return cls(values)


def _split(writes: Sequence[Write]) -> tuple[list[str], list[str]]:
    """``writes`` as the script takes them: (key, state) pairs, flat, and the keys to delete."""
    sets = [item for write in writes if write[1] for item in write]
    return sets, [key for key, state in writes if not state]


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
    #: The holds the commit did not record: their attempts have an outcome here already.
    skipped: list[str] = field(default_factory=list)
    #: The ids of the stream entries the pushed items became, in order ('' for one not kept).
    moved: list[str] = field(default_factory=list)
    #: The inbox's taken count after the step (None: not read): the place of the next item to
    #: take from a push follows it.
    taken: int | None = None
    #: Milliseconds until the shard's next timer is due by Redis's clock (0: one is due now),
    #: read by a step that fetched; None if none waits, or the step did not fetch.
    next_timer_ms: int | None = None
    #: How many timers wait on the shard, read with :attr:`next_timer_ms` (0 if none, or not
    #: read).
    timers_waiting: int = 0


def fields(raw: Any) -> dict[bytes, bytes]:
    """A stream entry's fields (a flat list in RESP2, a map in RESP3)."""
    return raw if isinstance(raw, dict) else dict(pairs(raw))


def _step_reply(reply: list[Any] | int) -> StepReply:
    if isinstance(reply, int):  # (nothing fetched or moved: the inbox's taken count)
        return StepReply([], {}, {}, taken=reply)
    if not reply:  # (nothing fetched or moved, nor read)
        return StepReply([], {}, {})
    entries, outcomes, states, sealed, paused, skipped, moved, taken, next_timer, waiting = reply
    return StepReply(
        entries=[(text(entry_id), fields(raw)) for entry_id, raw in entries],
        done={text(op_id): text(outcome) for op_id, outcome in pairs(outcomes)},
        states={text(key): text(state) or None for key, state in pairs(states)},
        sealed=text(sealed) if sealed else None,
        paused={text(key) for key, _ in pairs(paused)} if entries else None,
        skipped=[text(name) for name in skipped],
        moved=[text(entry_id) for entry_id in moved],
        taken=None if taken is None else int(taken),
        next_timer_ms=None if next_timer is None else int(next_timer),
        timers_waiting=int(waiting),
    )


def step(
    shard: ShardKeys,
    args: StepArgs,
    others: Sequence[ShardKeys] = (),
    earlier: Sequence[tuple[ShardKeys, Sequence[str]]] = (),
    pushed: Sequence[bytes] = (),
    commit: StepCommit | None = None,
) -> ScriptCall[StepReply]:
    """Commit ``commit``, then fetch the next entries (fenced by ``args.epoch``; refused with
    ``PushUnconfirmed`` if a pushed item is not in the inbox as pushed, with ``Replayed`` if
    an outcome it stores is stored already). ``others``: the shards whose writes the commit's
    ``others`` carries, in its order, each fenced by the epoch it names there.
    ``earlier``: shards of layouts before a reshard, each with the op ids of the commit homed
    there; ``Replayed`` too if one has an outcome there (both on a standalone server only).
    ``pushed``: the inbox items taken in from pushes since the last step, from the place
    ``args.pushed``, as pushed."""
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
        k.held,
        k.inbox,
        k.inbox_taken,
    ]
    for other in others:
        keys += [other.epoch, other.state]
    if earlier:
        checks = []
        for there, op_ids in earlier:
            checks.append([len(keys) + 1, op_ids])  # (Lua counts KEYS from 1)
            keys += [there.results, there.results_old]
        args.earlier = dumps(checks)
    args.commit = commit is not None
    call = args.call(keys, _step_reply)
    if commit is not None or pushed:
        call.args = [*call.args, *(commit.args if commit else ()), *pushed]
    return call
