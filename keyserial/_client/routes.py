"""Where a client's ops go: the namespace's layout as the client last read it.

A reshard (``_wire.resharding``) changes the layout under running clients. A client learns it
from the records, never from a message: when an append is refused because a reshard sealed the
shard (``RESHARDED``), and at every sweep. New ops go to the layout the namespace moves to as
soon as a move is recorded (they wait there until the flip, behind every op appended before);
reads of states go to the live layout until the flip; a stored result is looked for in the
live layout, then in the one it moves to, then in the layouts before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio

from .._backend.backend import Backend
from .._wire.layout import Layout, ShardKeys
from .._wire.resharding import LayoutRecord
from .._wire.routing import home_shard, shard_for
from ..errors import ConfigError

log = logging.getLogger("keyserial.client")


class Routes:
    """The client's layout record, and the shard names of each layout in it."""

    def __init__(
        self,
        backend: Backend,
        record: LayoutRecord,
        on_new_layout: Callable[[Layout], None],
    ) -> None:
        self._backend = backend
        self._record = record
        #: Told of each layout the client starts to route to after it started (see
        #: :meth:`learn`), before any op goes there.
        self._on_new_layout = on_new_layout
        self._keys: dict[int, list[ShardKeys]] = {}
        #: The routing layout's shards, where new ops go: every submit looks its home up here.
        self._homes = self.keys(record.routing)
        self._learning: anyio.Event | None = None

    @property
    def routing(self) -> Layout:
        """The layout new ops are appended to."""
        return self._record.routing

    @property
    def moving(self) -> bool:
        """Whether the client knows of a move under way (new ops go to another layout than
        the live one)."""
        return self._record.move is not None

    @property
    def live(self) -> Layout:
        """The layout whose states are the keys' committed states."""
        return self._record.live

    def home(self, keys: str | Sequence[str]) -> ShardKeys:
        """The shard an op on ``keys`` is appended to."""
        homes = self._homes
        if isinstance(keys, str):
            return homes[shard_for(keys, len(homes))]
        return homes[home_shard(keys, len(homes))]

    def keys(self, layout: Layout) -> list[ShardKeys]:
        """Every shard's names in ``layout`` (made once per layout)."""
        names = self._keys.get(layout.generation)
        if names is None:
            names = self._keys[layout.generation] = layout.all_keys()
        return names

    def where_stored(self, keys: Sequence[str]) -> list[ShardKeys]:
        """Where an op on ``keys`` may have stored its outcome, most likely first: its home in
        the live layout, in the layout it moves to, and in each layout before, newest first."""
        record = self._record
        layouts = [record.live, *([record.move.target] if record.move else [])]
        layouts += [layout for layout, _ in reversed(record.history)]
        return [self.keys(layout)[home_shard(keys, layout.shards)] for layout in layouts]

    async def learn(self) -> None:
        """Read the layout record again (one read at a time: callers meanwhile wait for it)."""
        if self._learning is not None:
            await self._learning.wait()
            return
        self._learning = anyio.Event()
        try:
            record = await self._backend.layout_record(self._record.live.namespace)
            if record is None:
                raise ConfigError("the namespace's layout record is gone from Redis")
            self._adopt(record)
        finally:
            self._learning.set()
            self._learning = None

    def _adopt(self, record: LayoutRecord) -> None:
        before = self._record
        if record.live.generation < before.live.generation:
            return  # (an older read, or a replica behind: keep the newer)
        if record.routing.generation != before.routing.generation:
            self._on_new_layout(record.routing)
            log.info(
                "namespace %r: routing new ops to %d shards (layout generation %d)",
                record.live.namespace,
                record.routing.shards,
                record.routing.generation,
            )
        self._record, self._homes = record, self.keys(record.routing)
