"""Ops pushed to a shard after a reshard retired it, by a client that pushes with a plain
``RPUSH`` and still routes by the count it read before the move.

Until the flip, the sealed shard's owner moves such ops into its stream and forwards them (see
``ShardRunner``). After it, no worker serves the old shard, so the owner of its heir, shard
``old % M`` of the live layout, forwards them: every ``idle_poll`` it reads the first items of
the retired shard's inbox, pushes each op to its home where new ops go now, and takes the items
out (the ``forwarded`` script, once: another worker forwarding them too takes out none it did
not read). They are never moved into the retired stream, where a client user could read their
op ids and push other ops under them to their new home first; a client user cannot read an
inbox. An op forwarded twice (two workers, or a crash between the push and the take) still
runs once: its id finds the first one's outcome, here or in a layout before (the runner looks
there for twice ``result_ttl``). An item that is malformed, or that asks for a grant (no op
of a retired layout is under way to have sent it), goes to the heir's dead letters instead.
Entries of the retired stream past the one it was recorded drained through (appended to the
stream itself) are forwarded the same way, and deleted.
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
        retired.append(Retired(keys, drained.through, keys.shard % record.live.shards))
    return retired


async def _forward_pass(backend: Backend, settings: Settings, shards: Sequence[Retired]) -> None:
    """Forward what was pushed to ``shards`` after they drained, to where new ops go now: the
    first items of their inboxes, then any entries of their streams past the drained one."""
    reads: list[Sequence[str | int]] = []
    for shard in shards:
        reads += [("GET", shard.keys.inbox_taken), ("LRANGE", shard.keys.inbox, 0, STRAY_BATCH - 1)]
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
    for shard, taken, items in pushed:
        if items:
            await _forward_items(backend, record, shard, int(taken or 0), items)
    for shard, found in zip(shards, entries, strict=True):
        for entry_id, fields in found:
            letters = await _forward_ops(backend, record, shard, entry_id.decode(), fields)
            raise_errors(await backend.pipeline([*letters, ("XDEL", shard.keys.stream, entry_id)]))


async def _forward_items(
    backend: Backend, record: LayoutRecord, shard: Retired, taken: int, items: list[bytes]
) -> None:
    """Forward the ops of the first ``items`` of a retired shard's inbox (its taken count:
    ``taken``), dead-lettering what cannot run, then take the items out."""
    letters: list[Sequence[str | bytes]] = []
    for place, item in enumerate(items, taken + 1):
        fields = item_fields(item) or {b"raw": item}
        letters += await _forward_ops(backend, record, shard, f"inbox {place}", fields)
    if letters:
        raise_errors(await backend.pipeline(letters))
    await backend.run_call(forwarded(shard.keys, taken, len(items)))


async def _forward_ops(
    backend: Backend,
    record: LayoutRecord,
    shard: Retired,
    name: str,
    fields: dict[bytes, bytes],
) -> list[Sequence[str | bytes]]:
    """Forward the ops of one stray entry (``name``: its stream id, or ``inbox <place>``); the
    command that dead-letters what cannot run, if anything."""
    try:
        items = decode_entry(fields)
    except MalformedEntry as exc:
        items = [exc]
    refused = [item for item in items if not _forwardable(item)]
    for item in items:
        if isinstance(item, Envelope) and _forwardable(item):
            there = await forward(backend, item, record.routing)
            log.warning(
                "op %s was appended to shard %s after a reshard retired it (a client routing by"
                " an old count, with a plain RPUSH): forwarded to shard %d of %d",
                item.op_id,
                _name(shard.keys),
                there.shard,
                record.routing.shards,
            )
    if not refused:
        return []
    heir = record.live.keys(shard.heir)
    reason = "; ".join(_refusal(item) for item in refused)
    letter = DeadLetterRecord(name, reason, entry_raw(fields))
    log.error("stray entry %s of shard %s dead-lettered: %s", name, _name(shard.keys), reason)
    return [("XADD", heir.dead, "*", *letter.fields())]


def _name(keys: ShardKeys) -> str:
    return shard_name(keys.shard, keys.generation)


def _forwardable(item: Envelope | MalformedEntry) -> bool:
    return isinstance(item, Envelope) and item.name != GRANT_OP


def _refusal(item: Envelope | MalformedEntry) -> str:
    if isinstance(item, MalformedEntry):
        return f"malformed, appended after a reshard retired its shard: {item.reason}"
    return f"grant request {item.op_id} appended after a reshard retired its shard"
