"""What a fetched entry asks of its shard: decode it, answer what needs no run (already done,
already running, misrouted, malformed) and hand back the ops that must run. Pure: no Redis, no
I/O, so every rule here is testable on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from .._logfields import fields as log_fields
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
from .._wire.json_text import dumps
from .._wire.routing import home_of, route, shard_for
from ..errors import MalformedOperation
from .commits import DeadLetter, Finished
from .execution import Entry, Run

log = logging.getLogger("keyserial.worker")

_RESERVED_ID = "'#' is reserved in op ids (keyserial names its coordination records with it)"

#: Why a grant request (an envelope of ``keyserial.grant``) is not taken, or None (see
#: ``_wire.requests``).
GrantRefusal = Callable[[Envelope], str | None]


def _no_refusal(envelope: Envelope) -> str | None:
    return None


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
    shard: int,
    shard_count: int,
    done: Mapping[str, str],
    running: MutableMapping[str, Run],
    grant_refusal: GrantRefusal = _no_refusal,
) -> Accepted:
    """Take in one entry. ``done``: stored outcomes of op ids that already ran; ``running``:
    the owner's runs by op id (an op id seen again joins its run, or reuses its outcome);
    ``grant_refusal``: the rule for grant requests (a refused one is dead-lettered, holding no
    key and storing nothing, so the genuine request of that id, if any, still runs)."""
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
        accepted = Accepted(Entry(entry_id, 0), dead=[(entry_id, exc.reason, entry_raw(fields))])
        outcome = encode_error(MalformedOperation.wire_type, exc.reason)
        for op_id, reply in salvage_replies(fields):
            if not _answered(accepted, None, op_id, reply, None, done, running):
                accepted.finished.append(
                    Finished(op_id, outcome, [], channels(reply), store=storable(op_id))
                )
        return accepted
    accepted = Accepted(Entry(entry_id, len(items)))
    entry = accepted.entry
    for item in items:
        # An op id that already ran, or runs, keeps its outcome: a malformed copy appended
        # again (a foreign client's retry gone wrong) is answered with it, never stored over it.
        if item.op_id is not None and _answered(
            accepted, item, item.op_id, item.reply, entry, done, running
        ):
            continue
        if isinstance(item, MalformedEntry):
            _reject(accepted, item)
        elif item.name == GRANT_OP and (
            refused := grant_refusal(item) or misrouted(item, shard, shard_count)
        ):
            _refuse_request(accepted, item, refused, shard)
        elif (wrong := misrouted(item, shard, shard_count)) is not None:
            _reject(accepted, MalformedEntry(wrong, op_id=item.op_id, reply=item.reply))
        else:
            run = running[item.op_id] = Run(item, [entry], channels(item.reply))
            accepted.runs.append(run)
    return accepted


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
        # A grant request answered already: any hold recorded under its id is over (a copy
        # appended as fresh, which no lookup stopped, may have recorded one before its answer
        # was refused as a replay).
        releases = op_id if envelope is not None and envelope.name == GRANT_OP else ""
        accepted.finished.append(
            Finished(op_id, stored, entries, channels(reply), store=False, releases=releases)
        )
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


def _refuse_request(accepted: Accepted, request: Envelope, reason: str, shard: int) -> None:
    entry_id = accepted.entry.entry_id
    log.warning(
        "shard %d: dead-lettering grant request %s (entry %s): %s",
        shard,
        request.op_id,
        entry_id,
        reason,
        extra=log_fields(shard=shard, error="MalformedOperation"),
    )
    raw = dumps({"id": request.op_id, "keys": list(request.keys), "kwargs": request.kwargs})
    accepted.dead.append((entry_id, reason, raw))
    accepted.finished.append(Finished("", "", [accepted.entry], [], store=False))


def misrouted(envelope: Envelope, shard: int, shard_count: int) -> str | None:
    """Why the envelope does not belong on ``shard``, or None. A multi-key op belongs on the
    lowest shard of its keys (its home), which coordinates the others."""
    if not envelope.multi and shard_for(envelope.keys[0], shard_count) == shard:
        return _RESERVED_ID if "#" in envelope.op_id else None  # most ops: one key, routed right
    if envelope.name == GRANT_OP:
        request = envelope.kwargs
        if envelope.op_id != f"{request.get('op')}#{request.get('attempt')}":
            return "a grant request's id must be '<op id>#<attempt>' (keyserial's own op)"
    elif "#" in envelope.op_id:
        return _RESERVED_ID
    shards = route(envelope, shard_count)
    if envelope.multi and envelope.name != GRANT_OP:
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
