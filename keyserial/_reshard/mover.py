"""``keyserial reshard``: move a live namespace from N shards to M, with every record in Redis.

The steps, each idempotent, so a rerun after an interruption finishes the same move:

1. **Record the move** in the meta hash (``move.lua``): from then on, clients append new ops to
   the next layout generation, whose shards run nothing yet.
2. **Seal every old shard** (``seal.lua``): clients' appends there are refused (``RESHARDED``:
   they read the layout and append to the new shard), and each seal names the last entry
   appended before it.
3. **Wait until every old shard is quiet at one instant.** Each owner records its sealed shard
   drained once every entry up to its cursor has taken effect and nothing is under way. A
   shard drained may still be handed work: a grant request of an op homed on another shard
   (a coordination message, never an entry). So the mover reads every shard twice; when both
   passes find every shard drained through its seal, holding no keys for another shard's op
   (its held hash empty), by the same owner having run no op between (each record counts the
   ops and grant requests its owner ran), every shard was idle at the instant between the
   passes, and none can start anything again: a grant request comes only from an op under way
   on its home, which is then not drained. (Ops a client appended past a seal some other way
   are forwarded: those keep coming while a stale client appends, and must not keep the move
   from finishing.)
4. **Copy the states** (and paused keys) of the old shards to the new ones: nothing writes
   the states until the flip; an operator's pause or resume writes the old shards and, once
   the move is recorded, the new ones too, so the copy makes the new shards' paused keys the
   old ones' again until a second reading of the old ones finds what it wrote.
5. **Flip** (``flip.lua``): the new layout becomes the live one; workers let the old shards go
   and serve the new ones, and the old layout joins the history, where results stored before
   the move are found (for resubmits and ``result()``) while they are retained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio

from .._backend.backend import Backend
from .._backend.commands import publish_command, raise_errors
from .._scripts.refusals import MoveRefused
from .._scripts.reshard import Quiet, flip, quiet, record_move, seal
from .._settings import Settings
from .._wire.codec import parse_id
from .._wire.layout import Layout, ShardKeys, shard_name
from .._wire.resharding import LAYOUT_CHANGED, LayoutRecord, Move, Seal, layout_channel
from .._wire.roster import live_entries
from .._wire.routing import shard_for
from .._wire.timers import moved_timer_id, split_by_home
from ..errors import ConfigError, ReshardRefused

log = logging.getLogger("keyserial.reshard")

#: How often the mover reads the old shards while they drain.
DRAIN_POLL = 0.05
#: How often the mover says which old shards it still waits for (and when that changes).
REPORT_EVERY = 5.0
#: States copied per pipeline.
COPY_BATCH = 500

Progress = Callable[[str], None]
#: Stream entries as the backend reads them: (id, fields).
Entries = Sequence[tuple[bytes, Mapping[bytes, bytes]]]


@dataclass(frozen=True, slots=True)
class Resharded:
    """What a reshard did: the layout the namespace left and the one it has now, and how long
    (seconds) the old shards took to drain and the states to copy."""

    source: Layout
    target: Layout
    drained_s: float
    copied_s: float
    states: int


async def move_namespace(
    backend: Backend, settings: Settings, shards: int, progress: Progress = log.info
) -> Resharded | None:
    """Move ``settings.namespace`` to ``shards`` shards, or finish the move to them under way;
    None if it has that many already and no move is under way.

    :raises ReshardRefused: if another move is under way (its target named).
    :raises ConfigError: for a namespace nothing has used, or a shard count below 1.
    """
    if type(shards) is not int or shards < 1:
        raise ConfigError(f"a namespace needs at least 1 shard, not {shards!r}")
    namespace = settings.namespace
    record = await backend.layout_record(namespace)
    if record is None:
        raise ConfigError(f"namespace {namespace!r} has no layout recorded: nothing has used it")
    move = await _recorded_move(backend, record, shards, progress)
    if move is None:
        return None
    await _announce(backend, namespace)  # (clients route to the new layout from now on)
    await _seal(backend, move, progress)
    await _announce(backend, namespace)  # (owners read their seals: they drain from now on)
    began = time.monotonic()
    await _until_quiet(backend, move.source, progress)
    drained = time.monotonic()
    states = await _copy_states(backend, move, progress)
    await _move_timers(backend, move, progress)
    await _move_dead_letters(backend, move, progress)
    copied = time.monotonic()
    await _flip(backend, move, settings, progress)
    return Resharded(move.source, move.target, drained - began, copied - drained, states)


async def _recorded_move(
    backend: Backend, record: LayoutRecord, shards: int, progress: Progress
) -> Move | None:
    """The move to ``shards`` shards, recorded now or before; None if there is nothing to do."""
    if record.move is not None:
        if record.move.target.shards != shards:
            raise ReshardRefused(
                f"a reshard of namespace {record.live.namespace!r} to"
                f" {record.move.target.shards} shards is under way: finish it first (keyserial"
                f" reshard --to {record.move.target.shards})"
            )
        progress(
            f"resuming the move from {record.move.source.shards} to {shards} shards"
            f" (layout generation {record.move.target.generation})"
        )
        return record.move
    live = record.live
    if live.shards == shards:
        progress(f"namespace {live.namespace!r} has {shards} shards already: nothing to do")
        return None
    await _check_workers(backend, live.namespace)
    move = Move(live, Layout(live.namespace, shards, live.generation + 1))
    try:
        await backend.run_call(record_move(move))
    except MoveRefused as exc:  # (another mover, between the read and the write)
        raise ReshardRefused(
            f"the namespace's layout changed meanwhile ({exc}): try again"
        ) from None
    progress(
        f"recorded the move from {live.shards} to {shards} shards (layout generation"
        f" {move.target.generation}): new ops go to the new shards, which run them after the flip"
    )
    return move


async def _check_workers(backend: Backend, namespace: str) -> None:
    """Refuse to start while a worker of a version that cannot follow a reshard runs: it would
    serve the old layout's names with the new count."""
    live, _ = live_entries(await backend.roster(namespace))
    older = [entry.token for entry in live if entry.generation is None]
    if older:
        raise ReshardRefused(
            f"workers {', '.join(older)} run a keyserial version that cannot follow a reshard:"
            " upgrade them (and every client) first"
        )


async def _announce(backend: Backend, namespace: str) -> None:
    """Wake workers and clients to read the layout record (it, not this, says what changed)."""
    await backend.pipeline([publish_command(layout_channel(namespace), LAYOUT_CHANGED)])


async def _seal(backend: Backend, move: Move, progress: Progress) -> None:
    calls = [seal(shard, move) for shard in move.source.all_keys()]
    raise_errors(await backend.run_many(calls))
    progress(f"sealed the {move.source.shards} old shards: clients append to the new ones now")


class QuietReadings:
    """The rule that ends the drain: two readings in a row find every old shard drained, with
    the same owner and count of ops run each time. One reading is not enough: an owner may
    record its shard drained while an op it took in a moment ago commits, and a shard that
    changes hands between two readings may have run ops the first reading did not see."""

    def __init__(self) -> None:
        self._previous: list[tuple[str, str]] | None = None

    def settled(self, busy: Sequence[int], work: list[tuple[str, str]]) -> bool:
        """Take one reading (``busy``: the shards not drained; ``work``: each drained record's
        owner and count): whether the drain is over."""
        if not busy and work == self._previous:
            return True
        self._previous = None if busy else work
        return False


async def _until_quiet(backend: Backend, source: Layout, progress: Progress) -> None:
    """Until two reads in a row find every old shard drained (see :func:`_drained`), each by the
    same owner having run no op between."""
    readings = QuietReadings()
    reported: tuple[list[int], float] = ([], 0.0)
    while True:
        now = await _read_quiet(backend, source)
        busy = [shard for shard, each in enumerate(now) if not _drained(source.keys(shard), each)]
        work = [record.work for each in now if (record := each.drained_record) is not None]
        if readings.settled(busy, work):
            progress(f"all {source.shards} old shards drained")
            return
        if busy and (busy != reported[0] or time.monotonic() > reported[1] + REPORT_EVERY):
            reported = (busy, time.monotonic())
            waiting = [_waiting_for(shard, now[shard]) for shard in busy]
            progress(f"waiting for {len(busy)} old shards to drain: {_few(waiting)}")
        await anyio.sleep(DRAIN_POLL)


def _waiting_for(shard: int, quiet: Quiet) -> str:
    """Shard ``shard`` and how far its owner drained it, against its stream's last entry."""
    through = quiet.drained_through or "nothing yet"
    return f"{shard} (drained through {through}, last entry {quiet.last_id})"


async def _read_quiet(backend: Backend, source: Layout) -> list[Quiet]:
    replies = await backend.run_many([quiet(shard) for shard in source.all_keys()])
    return list(raise_errors(replies))


def _drained(keys: ShardKeys, shard: Quiet) -> bool:
    """Sealed, its owner drained it through every entry appended before the seal (what follows
    the seal is ops a client appended some other way than the submit script, which the owner
    forwards, and after the flip the owner of the shard's heir does: see ``_worker.strays``),
    and it holds no keys for another shard's op."""
    through = shard.drained_through
    if not shard.sealed or through is None or shard.held:
        return False
    return parse_id(through) >= parse_id(Seal.decode(keys.namespace, shard.sealed).last)


def _few(shards: Sequence[str]) -> str:
    shown = ", ".join(shards[:10])
    return shown + (f" and {len(shards) - 10} more" if len(shards) > 10 else "")


async def _copy_states(backend: Backend, move: Move, progress: Progress) -> int:
    """Copy the paused keys (:func:`_copy_paused`), then every key's state, to its shard in the
    new layout: the old shards are quiet and sealed, the new ones run nothing, so the states
    stand still. (A rerun copies the same values again.)"""
    await _copy_paused(backend, move)
    target = move.target
    new_keys = target.all_keys()
    copied = 0
    for old in move.source.all_keys():
        states = await backend.all_states(old)
        copied += len(states)
        commands = _writes(states, target, lambda shard: new_keys[shard].state)
        raise_errors(await backend.pipeline(commands))
    progress(f"copied {copied} states to the {target.shards} new shards")
    return copied


async def _copy_paused(backend: Backend, move: Move) -> None:
    """Make the new shards' paused keys the old ones': empty the new paused hashes, write what
    the old ones hold, and read those again, until that reading finds what was written.

    An operator pauses and resumes keys in the old layout and, once the move is recorded, in
    the new one too, the old first (``_operator.pauses.pause``). So each run of the mover makes
    the new hashes the old ones again (a key resumed after an interrupted copy does not stay
    paused), and a pause or resume written between a reading and the writes made from it (whose
    old write the reading missed, and whose new write those writes undid) changes the next
    reading, and another round carries it. Once a reading matches, every pause or resume has
    either written the old shards before it (and the new ones then hold its value) or writes
    the new ones after the round's writes (and stands: nothing else writes them before the
    flip)."""
    target = move.target
    new_keys = target.all_keys()
    old_keys = move.source.all_keys()
    paused = await backend.all_paused(old_keys)
    while True:
        raise_errors(await backend.pipeline([("DEL", keys.paused) for keys in new_keys]))
        fields = {key: value for each in paused for key, value in each.items()}
        commands = _writes(fields, target, lambda shard: new_keys[shard].paused)
        raise_errors(await backend.pipeline(commands))
        again = await backend.all_paused(old_keys)
        if again == paused:
            return
        paused = again


def _writes(
    fields: dict[bytes, bytes], target: Layout, hash_of: Callable[[int], str]
) -> list[tuple[str | bytes, ...]]:
    """``HSET`` commands that write ``fields`` (key -> value) to the key's shard of ``target``."""
    by_shard: dict[int, list[bytes]] = {}
    for key, value in fields.items():
        by_shard.setdefault(shard_for(key.decode(), target.shards), []).extend((key, value))
    return [
        ("HSET", hash_of(shard), *values[at : at + 2 * COPY_BATCH])
        for shard, values in by_shard.items()
        for at in range(0, len(values), 2 * COPY_BATCH)
    ]


async def _move_timers(backend: Backend, move: Move, progress: Progress) -> None:
    """Move each old shard's timers (delayed ops not due yet, or due since its seal: a sealed
    shard fires none) to their ops' home shards in the new layout, under the same due times,
    then delete them: the new shards run nothing until the flip, so none has fired, and a rerun
    after an interruption writes the same timers again (see ``_wire.timers``)."""
    target = move.target
    new_keys = target.all_keys()
    moved = 0
    for old in move.source.all_keys():
        writes: list[tuple[str | bytes | float, ...]] = []
        for timer_id, due, item in await backend.timers(old):
            new_id = moved_timer_id(old, timer_id)
            fallback = old.shard % target.shards
            for home, split in split_by_home(item, target.shards, fallback).items():
                writes.append(("ZADD", new_keys[home].timers, due, new_id))
                writes.append(("HSET", new_keys[home].timed, new_id, split))
        if writes:
            raise_errors(await backend.pipeline(writes))
            moved += len(writes) // 2
        raise_errors(await backend.pipeline([("DEL", old.timers), ("DEL", old.timed)]))
    if moved:
        progress(f"moved {moved} timers to the new shards")


async def _move_dead_letters(backend: Backend, move: Move, progress: Progress) -> None:
    """Move each old shard's dead letters to a shard of the new layout (``old % M``), so that
    ``keyserial dead-letters`` still lists and replays them (a replay routes each op by its
    keys). Each copy names the letter it copies (``moved``), and a letter whose copy is there
    already is not copied again: a mover interrupted between a shard's copy and its delete
    lists each letter once after its rerun (``replay --new-id`` would run a second copy
    again)."""
    moved = 0
    for old in move.source.all_keys():
        letters = await backend.dead_letters(old)
        if not letters:
            continue
        there = move.target.keys(old.shard % move.target.shards)
        copied = await _copied_letters(backend, there)
        copies: list[list[str | bytes]] = [
            ["XADD", there.dead, "*", *_fields(fields), "moved", origin]
            for letter_id, fields in letters
            if (origin := _origin(old, letter_id)) not in copied
        ]
        if copies:
            raise_errors(await backend.pipeline(copies))
        progress(f"copied the dead letters of old shard {old.shard}")
        delete: list[str | bytes] = ["XDEL", old.dead, *(letter_id for letter_id, _ in letters)]
        raise_errors(await backend.pipeline([delete]))
        moved += len(letters)
    if moved:
        progress(f"moved {moved} dead letters to the new shards")


def _origin(old: ShardKeys, letter_id: bytes) -> bytes:
    """What a moved dead letter's copy says it copies: ``<old shard's name> <letter id>``."""
    return f"{shard_name(old.shard, old.generation)} ".encode() + letter_id


def _fields(fields: Mapping[bytes, bytes]) -> list[bytes]:
    """A letter's fields, as XADD takes them (less the ``moved`` of an earlier move's copy)."""
    return [part for name, value in fields.items() if name != b"moved" for part in (name, value)]


async def _copied_letters(backend: Backend, there: ShardKeys) -> set[bytes]:
    """The letters that copies in ``there`` name (a rerun's: this move's copies)."""
    return {
        fields[b"moved"] for _, fields in await backend.dead_letters(there) if b"moved" in fields
    }


async def _longest_retention(backend: Backend, settings: Settings) -> float:
    """The longest ``result_ttl`` of this mover's and the running workers': the history keeps a
    layout while any of them may still find an op's outcome there (pruned by this mover's
    alone, a resubmit to a worker that keeps results longer would run again)."""
    live, _ = live_entries(await backend.roster(settings.namespace))
    return max([settings.result_ttl, *(e.result_ttl for e in live if e.result_ttl is not None)])


async def _flip(backend: Backend, move: Move, settings: Settings, progress: Progress) -> None:
    record = await backend.layout_record(move.source.namespace)
    assert record is not None, "read before"
    if record.live.generation == move.target.generation:
        progress("the new layout was live already")
        return
    now_ms = int(time.time() * 1000)
    retention = await _longest_retention(backend, settings)
    history = record.history_after_flip(now_ms, round(2 * retention * 1000))
    await backend.run_call(flip(move, history))
    await _announce(backend, move.source.namespace)
    progress(
        f"flipped: namespace {move.source.namespace!r} has {move.target.shards} shards"
        f" (layout generation {move.target.generation})"
    )
