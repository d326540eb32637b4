"""An operator's hold on a key (``keyserial keys pause|resume|paused``, the dashboard), recorded
in the shard's paused hash (``_wire.pauses``; the worker ACL user: a client user may not write
it). A paused key's ops queue and none runs, whoever owns the shard, until it is resumed; its
shard's other keys flow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .._backend.backend import Backend
from .._wire.layout import Layout, ShardKeys
from .._wire.pauses import PauseRecord
from .._wire.resharding import LayoutRecord
from .._wire.routing import shard_for
from .namespace import layout_in_use, record_in_use


@dataclass(frozen=True, slots=True)
class PausedKey:
    """A key paused on a shard of the live layout."""

    key: str
    shard: int
    record: PauseRecord

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "shard": self.shard, **self.record.as_json()}


async def list_paused(backend: Backend, namespace: str) -> list[PausedKey]:
    """Every paused key of the namespace's live layout, shard by shard."""
    shards = (await layout_in_use(backend, namespace)).all_keys()
    return [
        PausedKey(key.decode(), keys.shard, PauseRecord.decode(found))
        for keys, records in zip(shards, await backend.all_paused(shards), strict=True)
        for key, found in records.items()
    ]


async def pause(backend: Backend, namespace: str, key: str, *, pausing: bool) -> tuple[int, bool]:
    """Pause ``key`` (or resume it, ``pausing`` False); its shard in the live layout, and
    whether it was paused there.

    A reshard copies the paused keys to the new layout before its flip, so a pause written only
    to the layout that was live when it was read is lost if it lands after that copy. So the
    record is written to the key's shard of the live layout and then, while a move is under
    way, of the move's target; then the layout record is read again, and, while the live layout
    or the move differs from the reading written by, written again by the new reading. The
    writes of the last round thus fall between two readings that find the same layouts:

    - no move under way: the writes precede any move's record, so its copy, which reads the
      live shards after the record, carries them;
    - a move under way: the writes precede its flip. The mover's copy ends with a round that
      writes the target's paused hashes from one reading of the source's and then finds the
      source's unchanged (``_reshard.mover._copy_paused``). If this target write followed that
      round's writes, it stands (nothing else writes the target before the flip). If it
      preceded them, so did this source write, which came first: so it preceded the round's
      second reading, and, that finding nothing changed, its first, and the round wrote this
      value;
    - the move's target live: the writes are in the live layout.

    Each write wakes its shard's owner, as a pause always did.
    """
    record = PauseRecord(int(time.time() * 1000)).encode() if pausing else None
    layouts = await record_in_use(backend, namespace)
    was = await _write_pause(backend, layouts, key, record)
    while True:
        again = await record_in_use(backend, namespace)
        if (again.live, again.move) == (layouts.live, layouts.move):
            return shard_for(key, again.live.shards), was
        layouts = again
        await _write_pause(backend, layouts, key, record)


async def _write_pause(
    backend: Backend, layouts: LayoutRecord, key: str, record: str | None
) -> bool:
    """Write ``key``'s pause ``record`` (None: resume it) to its shard of the live layout, then,
    if a move is under way, of the move's target; whether it was paused in the live one."""
    was = await backend.set_paused(_shard_keys(layouts.live, key), key, record)
    if layouts.move is not None:
        await backend.set_paused(_shard_keys(layouts.move.target, key), key, record)
    return was


def _shard_keys(layout: Layout, key: str) -> ShardKeys:
    return layout.keys(shard_for(key, layout.shards))
