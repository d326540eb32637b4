"""Coalesce script calls from many shard runners into one pipeline per round trip.

A worker serving 16 shards under spread-out load would otherwise pay one round trip (and
the per-call overhead) per shard step; batched, the steps of every ready shard go out
together. Each call is routed by its keys, so this is cluster-safe: on a cluster the pipeline
is split per node.
"""

from __future__ import annotations

from typing import Any

import anyio

from ._backend import Backend, ScriptCall
from .errors import BackendUnavailable


class _Slot:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: Any = None


class Pipeliner:
    """Runs :class:`ScriptCall` s in pipelines, one in flight at a time; calls that arrive while
    it is in flight go out together in the next. (Two in flight measured slower: smaller batches,
    more CPU per op.) Start :meth:`serve` in a task group."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._queue: list[tuple[ScriptCall, _Slot]] = []
        self._queued = anyio.Event()

    async def run(self, call: ScriptCall) -> Any:
        """The script's reply.

        :raises redis.exceptions.ResponseError: the script's own error (``FENCED …``).
        :raises BackendUnavailable: if the server does not answer.
        """
        slot = _Slot()
        self._queue.append((call, slot))
        self._queued.set()
        await slot.done.wait()
        if isinstance(slot.reply, Exception):
            raise slot.reply
        return slot.reply

    async def serve(self) -> None:
        while True:
            await self._queued.wait()
            self._queued = anyio.Event()
            batch, self._queue = self._queue, []
            try:
                replies = await self._backend.run_many([call for call, _ in batch])
            except BackendUnavailable as exc:
                replies = [exc] * len(batch)
            for (_, slot), reply in zip(batch, replies, strict=True):
                slot.reply = reply
                slot.done.set()
