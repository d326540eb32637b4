"""One batch in flight per Redis node: what is queued while it is out goes in the next.

The client's appends and a worker's script calls both go to Redis this way. Under load, each
round trip carries everything that queued up during the one before (one pipeline, one write and
one read on the connection), and at low load an item goes out at once. Each master of a cluster
has its own queue, so a stalled node delays its own items and no others; a node's items go out in
the order they were queued. (Two batches in flight per node measured slower: smaller batches, more
CPU per item.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from .backend import Backend

T = TypeVar("T")


class _NodeQueue(Generic[T]):
    """The items bound for one node, and the loop that sends them a batch at a time."""

    __slots__ = ("items", "queued")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.queued = anyio.Event()

    def add(self, item: T) -> None:
        if not self.items:  # (else set already: it is, whenever items are queued)
            self.queued.set()
        self.items.append(item)

    async def serve(self, send: Callable[[list[T]], Awaitable[None]]) -> None:
        while True:
            await self.queued.wait()
            self.queued = anyio.Event()
            batch, self.items = self.items, []
            if batch:
                await send(batch)


class NodeBatcher(Generic[T]):
    """Sends items in batches, one batch in flight per Redis node; ``send`` gets each batch
    (the items of one node, in the order queued). Start :meth:`serve` in a task group."""

    def __init__(self, backend: Backend, send: Callable[[list[T]], Awaitable[None]]) -> None:
        self._backend = backend
        self._send = send
        self._by_node: dict[str, _NodeQueue[T]] = {}
        self._task_group: TaskGroup | None = None

    def add(self, key: str, item: T) -> None:
        """Queue ``item`` for the node that serves ``key`` (as this process knows now)."""
        node = self._backend.node_of(key)
        queue = self._by_node.get(node)
        if queue is None:
            queue = self._by_node[node] = _NodeQueue()
            if self._task_group is not None:
                self._task_group.start_soon(queue.serve, self._send)
        queue.add(item)

    def withdraw(self, item: T) -> bool:
        """Take ``item`` out of its queue if it has not been sent (True if so)."""
        for queue in self._by_node.values():
            try:
                queue.items.remove(item)
            except ValueError:
                continue
            return True
        return False

    def take_unsent(self) -> list[T]:
        """Empty every queue (once :meth:`serve` has stopped): the items never sent."""
        unsent = [item for queue in self._by_node.values() for item in queue.items]
        for queue in self._by_node.values():
            queue.items = []
        return unsent

    async def serve(self) -> None:
        """Send batches until cancelled."""
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            for queue in self._by_node.values():
                task_group.start_soon(queue.serve, self._send)
            await anyio.sleep_forever()
