"""What a fetched entry asks of its shard: decode it, answer what needs no run (already done,
already running, misrouted, malformed) and hand back the ops that must run. Pure: no Redis, no
I/O, so every rule here is testable on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from .._logfields import fields as log_fields
from .._ops import is_timer_id
from .._wire.codec import (
    GRANT_OP,
    Envelope,
    MalformedEntry,
    binding,
    binding_of,
    decode_entry,
    encode_error,
    salvage_replies,
    taken_outcome,
)
from .._wire.deadletters import entry_raw
from .._wire.routing import home_of, route, shard_for
from ..errors import MalformedOperation
from .commits import DeadLetter, Finished
from .execution import Entry, Run

log = logging.getLogger("keyserial.worker")

_RESERVED_ID = "'#' is reserved in op ids (keyserial names its coordination records with it)"
_RESERVED_NAME = (
    f"{GRANT_OP!r} is reserved: workers ask each other for grants in coordination messages,"
    " never in a stream"
)


@dataclass(slots=True)
class Accepted:
    """One entry, as its shard's owner takes it in."""

    entry: Entry
    #: Ops to run: new runs, each already added to the ``running`` map it was given.
    runs: list[Run] = field(default_factory=list)
    #: Ops answered without running: their outcome goes out with the next commit.
    finished: list[Finished] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)


def accept(
    entry_id: str,
    fields: Mapping[bytes, bytes],
    *,
    place: str,
    shard: int,
    shard_count: int,
    done: Mapping[str, str],
    running: MutableMapping[str, Run],
) -> Accepted:
    """Take in one entry (``place``: what its replies name it by, see ``Entry``). ``done``:
    stored outcomes of op ids that already ran; ``running``: the owner's runs by op id (an op
    id seen again joins its run, or reuses its outcome; never an op id with '#', which names a
    record of keyserial's or a grant request's run)."""
    try:
        items = decode_entry(fields)
    except MalformedEntry as exc:
        log.error(
            "shard %d: dead-lettering malformed entry %s: %s",
            shard,
            entry_id,
            exc,
            extra=log_fields(shard=shard, error="MalformedOperation"),
        )
        accepted = Accepted(
            Entry(entry_id, 0, place), dead=[(entry_id, exc.reason, entry_raw(fields))]
        )
        _answer_salvaged(accepted, fields, exc.reason, done, running)
        return accepted
    accepted = Accepted(Entry(entry_id, len(items), place))
    entry = accepted.entry
    fired = fields.get(b"timer") == b"1"
    for item in items:
        if item.op_id is not None and reserved(item.op_id, fired):  # (before it joins a run)
            _reject(accepted, MalformedEntry(_RESERVED_ID, op_id=item.op_id, reply=item.reply))
            continue
        # An op id that already ran, or runs, keeps its outcome: a malformed copy appended
        # again (a foreign client's retry gone wrong) is answered with it, never stored over it.
        if item.op_id is not None and _answered(
            accepted, item, item.op_id, item.reply, entry, done, running
        ):
            continue
        if isinstance(item, MalformedEntry):
            _reject(accepted, item)
        elif item.name == GRANT_OP:
            _reject(accepted, MalformedEntry(_RESERVED_NAME, op_id=item.op_id, reply=item.reply))
        elif (wrong := misrouted(item, shard, shard_count, fired=fired)) is not None:
            _reject(accepted, MalformedEntry(wrong, op_id=item.op_id, reply=item.reply))
        else:
            run = running[item.op_id] = Run(item, [entry], channels(item.reply))
            accepted.runs.append(run)
    return accepted


def _answer_salvaged(
    accepted: Accepted,
    fields: Mapping[bytes, bytes],
    reason: str,
    done: Mapping[str, str],
    running: MutableMapping[str, Run],
) -> None:
    """Answer each op id (and reply channel) salvaged from a malformed entry: with its outcome
    if it has one (or joining its run), else with the refusal."""
    outcome = encode_error(MalformedOperation.wire_type, reason)
    for op_id, reply in salvage_replies(fields):
        if "#" in op_id or not _answered(accepted, None, op_id, reply, None, done, running):
            accepted.finished.append(
                Finished(op_id, outcome, [], channels(reply), store=storable(op_id))
            )


def _answered(
    accepted: Accepted,
    item: Envelope | MalformedEntry | None,
    op_id: str,
    reply: str | None,
    entry: Entry | None,
    done: Mapping[str, str],
    running: MutableMapping[str, Run],
) -> bool:
    """Answer an occurrence of an op id that has a stored outcome, or a run (joined while it
    runs), or that another op holds (refused); False if it has neither."""
    entries = [] if entry is None else [entry]
    envelope = item if isinstance(item, Envelope) else None
    if (stored := done.get(op_id)) is not None:
        if envelope is not None and binding_of(stored) not in (None, binding(envelope) or None):
            stored = taken_outcome(op_id)
        accepted.finished.append(Finished(op_id, stored, entries, channels(reply), store=False))
    elif (run := running.get(op_id)) is None:
        return False
    elif envelope is not None and binding(run.envelope) != binding(envelope):
        accepted.finished.append(
            Finished(op_id, taken_outcome(op_id), entries, channels(reply), store=False)
        )
    elif run.outcome is None:
        run.entries.extend(entries)
        run.replies.extend(channels(reply))
    else:
        accepted.finished.append(
            Finished(op_id, run.outcome, entries, channels(reply), store=False)
        )
    return True


def _reject(accepted: Accepted, problem: MalformedEntry) -> None:
    entry = accepted.entry
    if problem.op_id is None:
        accepted.dead.append((entry.entry_id, problem.reason, problem.raw))
        accepted.finished.append(Finished("", "", [entry], [], store=False))
        return
    outcome = encode_error(MalformedOperation.wire_type, problem.reason)
    accepted.finished.append(
        Finished(
            problem.op_id,
            outcome,
            [entry],
            channels(problem.reply),
            store=storable(problem.op_id),
        )
    )


def storable(op_id: str) -> bool:
    """Whether a refusal may be stored under ``op_id``: not if it holds '#'. Such an id names
    one of keyserial's records (``<op id>#<attempt>`` is where a participant stores what became
    of its part of a cross-shard op, ``…#d`` a decision), and a refusal stored there would stand
    in for that record: a participant's part, found answered, would never apply. Refused, then,
    it is replied to and not stored."""
    return "#" not in op_id


def reserved(op_id: str, fired: bool = False) -> bool:
    """Whether an entry may not carry ``op_id``: one with '#' names a record of keyserial's,
    but for a timer's op id (``<op id>#t<n>``) in an entry its timer fired (``fired``: marked
    so by the step that fired it, which no client can make)."""
    return "#" in op_id and not (fired and is_timer_id(op_id))


def misrouted(
    envelope: Envelope, shard: int, shard_count: int, *, fired: bool = False
) -> str | None:
    """Why the envelope does not belong on ``shard``, or None. A multi-key op belongs on the
    lowest shard of its keys (its home), which coordinates the others. ``fired``: see
    :func:`reserved`."""
    if not envelope.multi and shard_for(envelope.keys[0], shard_count) == shard:
        return _RESERVED_ID if reserved(envelope.op_id, fired) else None  # (most ops: one key)
    if reserved(envelope.op_id, fired):
        return _RESERVED_ID
    shards = route(envelope, shard_count)
    if envelope.multi:
        if (home := home_of(shards)) != shard:
            placed = ", ".join(
                f"{key!r} on {home}" for key, home in zip(envelope.keys, shards, strict=True)
            )
            return (
                f"its keys are on shards of {shard_count} ({placed}): a multi-key op goes to"
                f" the lowest, shard {home}, not to shard {shard}"
            )
        return None
    for key, home in zip(envelope.keys, shards, strict=True):
        if home != shard:
            return f"key {key!r} routes to shard {home} of {shard_count}, not to shard {shard}"
    return None


def entry_place(entry_id: str, fields: Mapping[bytes, bytes]) -> str:
    """What a fetched entry's replies name it by: its place in the inbox it was pushed to (the
    field ``p`` its owner's step gave it when moving it in), or, for an entry appended to the
    stream itself (as before the inbox), its id."""
    place = fields.get(b"p")
    return entry_id if place is None else place.decode(errors="replace")


def channels(reply: str | None) -> list[str]:
    """The reply channels of one occurrence of an op (none if its caller wants no reply)."""
    return [] if reply is None else [reply]


def entry_keys(fields: Mapping[bytes, bytes]) -> list[str]:
    """Every key the entry's well-formed envelopes name."""
    try:
        items = decode_entry(fields)
    except MalformedEntry:
        return []
    return [key for item in items if not isinstance(item, MalformedEntry) for key in item.keys]
