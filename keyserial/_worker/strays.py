"""Ops pushed to a shard after a reshard sealed it, by a client that pushes with a plain
``RPUSH`` and still routes by the count it read before the move.

Such items are never moved into the old stream, where a client user could read their op ids
and push other ops under them to their new home first; a client user cannot read an inbox.
They are forwarded from the inbox (:func:`forward_inbox`): each op pushed to its home where new
ops go now, and the items taken out by the ``forwarded`` script, once (another worker
forwarding them too takes out none it did not read). Until the flip the sealed shard's owner
forwards them (see ``Drain``); after it no worker serves the old shard, so the owner of its
heir, shard ``old % M`` of the live layout, does, every ``idle_poll``. An op forwarded twice (two
workers, or a crash between the push and the take) still runs once: its id finds the first
one's outcome, here or in a layout before (the runner looks there for twice ``result_ttl``). An
item that is malformed, or that asks for a grant (no op of an old layout is under way to have
sent it), goes to the heir's dead letters instead, before the flip as after it. Entries of a
retired stream past the one it was recorded drained through (appended to the stream itself)
are forwarded the same way, and deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from .._backend.backend import Backend
from .._backend.commands import raise_errors
from .._scripts.refusals import ShardSealed
from .._scripts.reshard import forwarded
from .._scripts.submit import SubmitArgs, submit
from .._settings import Settings
from .._wire.codec import (
    GRANT_OP,
    WIRE_VERSION,
    Envelope,
    MalformedEntry,
    decode_entry,
    item_fields,
    pack_entry,
    reencoded,
)
from .._wire.deadletters import DeadLetterRecord, entry_raw
from .._wire.layout import Layout, ShardKeys, shard_name
from .._wire.resharding import Drained, LayoutRecord, drained_key
from .._wire.routing import home_shard
from ..errors import BackendUnavailable

log = logging.getLogger("keyserial.worker")

#: Entries read from one retired shard per pass.
STRAY_BATCH = 64


async def forward(backend: Backend, envelope: Envelope, layout: Layout) -> ShardKeys:
    """Append ``envelope``'s op to its home shard in ``layout`` (as a resubmit: not fresh, so
    that its owner looks its id up), or where new ops go now if a later reshard sealed that
    shard too; the shard it went to."""
    while True:
        there = layout.keys(home_shard(envelope.keys, layout.shards))
        args = SubmitArgs(
            max_backlog=0,
            wire_version=WIRE_VERSION,
            ops=pack_entry([reencoded(envelope)]),
            wake_channel=there.wake(backend.sharded_pubsub),
        )
        try:
            await backend.run_call(submit(there, args))
            return there
        except ShardSealed:
            record = await backend.layout_record(layout.namespace)
            if record is None or record.routing == layout:
                raise
            layout = record.routing


@dataclass(frozen=True)
class Retired:
    """A shard of a layout before the live one."""

    keys: ShardKeys
    #: The last entry its last owner ran or forwarded (its drained record): every later one is
    #: a stray.
    drained_through: str
    #: Its shard in the live layout, whose owner forwards its strays.
    heir: int


async def forward_strays(
    backend: Backend, settings: Settings, record: LayoutRecord, owns: Callable[[int], bool]
) -> None:
    """Every ``idle_poll``, forward the strays of the retired shards whose heir ``owns``
    says this worker serves, until cancelled."""
    retired: list[Retired] | None = None
    while True:
        await anyio.sleep(settings.idle_poll)
        try:
            if retired is None:
                retired = await _retired(backend, record)
            mine = [shard for shard in retired if owns(shard.heir)]
            if mine:
                await _forward_pass(backend, settings, mine)
        except BackendUnavailable:
            continue  # (the next pass tries again: forwarding twice runs nothing twice)


async def _retired(backend: Backend, record: LayoutRecord) -> list[Retired]:
    """Every shard of the layouts before the live one, with the entry it was drained through."""
    shards = [keys for layout, _ in record.history for keys in layout.all_keys()]
    records = raise_errors(await backend.pipeline([("GET", drained_key(s)) for s in shards]))
    retired = []
    for keys, text in zip(shards, records, strict=True):
        drained = None if text is None else Drained.decode(text.decode())
        if drained is None:  # (a reshard flips once every old shard recorded it drained)
            log.warning("retired shard %s was never drained: its strays stay", _name(keys))
            continue
        retired.append(Retired(keys, drained.through, heir(keys.shard, record.live)))
    return retired


async def _forward_pass(backend: Backend, settings: Settings, shards: Sequence[Retired]) -> None:
    """Forward what was pushed to ``shards`` after they drained, to where new ops go now: the
    first items of their inboxes, then any entries of their streams past the drained one."""
    reads: list[Sequence[str | int]] = []
    for shard in shards:
        reads += _inbox_reads(shard.keys)
    read = raise_errors(await backend.pipeline(reads))
    pushed = list(zip(shards, read[0::2], read[1::2], strict=True))
    entries = await backend.entries_since(
        [(shard.keys, shard.drained_through) for shard in shards], STRAY_BATCH
    )
    if not any(items for _, _, items in pushed) and not any(entries):
        return
    record = await backend.layout_record(settings.namespace)
    if record is None:
        return
    for (shard, taken, items), found in zip(pushed, entries, strict=True):
        strays = Strays.of(shard.keys, record.routing, record.live)
        if items:
            await strays.forward_items(backend, int(taken or 0), items)
        for entry_id, fields in found:
            letters = await strays.forward_ops(backend, entry_id.decode(), fields)
            raise_errors(await backend.pipeline([*letters, ("XDEL", shard.keys.stream, entry_id)]))


def heir(shard: int, live: Layout) -> int:
    """The shard of ``live`` whose owner forwards an old shard's strays after the flip, and
    whose dead letters take those that cannot run (before the flip too)."""
    return shard % live.shards


def _inbox_reads(keys: ShardKeys) -> list[Sequence[str | int]]:
    """The inbox's taken count and first items, in one pipeline with others."""
    return [("GET", keys.inbox_taken), ("LRANGE", keys.inbox, 0, STRAY_BATCH - 1)]


async def forward_inbox(backend: Backend, strays: Strays) -> bool:
    """Forward the ops of the first items of a sealed or retired shard's inbox and take them
    out; whether there were any."""
    taken, items = raise_errors(await backend.pipeline(_inbox_reads(strays.keys)))
    if items:
        await strays.forward_items(backend, int(taken or 0), items)
    return bool(items)


@dataclass(frozen=True)
class Strays:
    """Where the strays of a sealed or retired shard go."""

    #: The old shard.
    keys: ShardKeys
    #: The layout where new ops go now (a later reshard's, if one sealed its shards too).
    routing: Layout
    #: The dead-letter stream for what cannot run there.
    dead: str

    @classmethod
    def of(cls, keys: ShardKeys, routing: Layout, live: Layout) -> Strays:
        """The strays of old shard ``keys``, going where ``routing`` routes them, and to the dead
        letters of its :func:`heir` in ``live`` if they cannot run."""
        return cls(keys, routing, live.keys(heir(keys.shard, live)).dead)

    async def forward_items(self, backend: Backend, taken: int, items: list[bytes]) -> None:
        """Forward the ops of the first ``items`` of the inbox (its taken count: ``taken``),
        dead-lettering what cannot run, then take the items out."""
        letters: list[Sequence[str | bytes]] = []
        for place, item in enumerate(items, taken + 1):
            fields = item_fields(item) or {b"raw": item}
            letters += await self.forward_ops(backend, f"inbox {place}", fields)
        if letters:
            raise_errors(await backend.pipeline(letters))
        await backend.run_call(forwarded(self.keys, taken, len(items)))

    async def forward_ops(
        self, backend: Backend, name: str, fields: dict[bytes, bytes]
    ) -> list[Sequence[str | bytes]]:
        """Forward the ops of one stray entry (``name``: its stream id, or ``inbox <place>``);
        the command that dead-letters what cannot run, if anything."""
        try:
            items = decode_entry(fields)
        except MalformedEntry as exc:
            items = [exc]
        refused = [item for item in items if not _forwardable(item)]
        for item in items:
            if isinstance(item, Envelope) and _forwardable(item):
                there = await forward(backend, item, self.routing)
                log.warning(
                    "op %s was pushed to shard %s after a reshard sealed it (a client routing"
                    " by an old count, with a plain RPUSH): forwarded to shard %d of %d",
                    item.op_id,
                    _name(self.keys),
                    there.shard,
                    self.routing.shards,
                )
        if not refused:
            return []
        reason = "; ".join(_refusal(item) for item in refused)
        letter = DeadLetterRecord(name, reason, entry_raw(fields))
        log.error("stray entry %s of shard %s dead-lettered: %s", name, _name(self.keys), reason)
        return [("XADD", self.dead, "*", *letter.fields())]


def _name(keys: ShardKeys) -> str:
    return shard_name(keys.shard, keys.generation)


def _forwardable(item: Envelope | MalformedEntry) -> bool:
    return isinstance(item, Envelope) and item.name != GRANT_OP


def _refusal(item: Envelope | MalformedEntry) -> str:
    if isinstance(item, MalformedEntry):
        return f"malformed, appended after a reshard sealed its shard: {item.reason}"
    return f"grant request {item.op_id} appended after a reshard sealed its shard"
