"""An in-process worker for the length of a block: ``keyserial.testing.running_worker``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .._backend.backend import AnyRedis
from .._ops import Registry
from .._settings import Settings
from .._worker.worker import Worker


@asynccontextmanager
async def running_worker(
    redis: str | AnyRedis,
    namespace: str = "default",
    *,
    shards: str | Sequence[int] | None = None,
    shard_count: int | None = None,
    apps: Sequence[str] = (),
    registry: Registry | None = None,
    start_timeout: float = 10.0,
    **settings: Any,
) -> AsyncIterator[Worker]:
    """A :class:`~keyserial.Worker` in this process that owns its shards for the whole block.

    The block starts only once the worker owns every shard it serves, so an op submitted in it
    runs at once instead of waiting for a lease; on exit the worker drains its ops and releases
    its leases, so the next block's worker takes over at once. ``apps`` (module names) are
    served besides the ledger's ops, or besides those of ``registry``, which replaces them;
    ``settings`` are other
    :class:`~keyserial.Settings` fields (``lease_ttl=1.0``). Settings come from the arguments
    only, never from ``KEYSERIAL_*`` variables: a test runs as it is written.

    :raises TimeoutError: if the worker does not own its shards within ``start_timeout``
        seconds (another worker holds their leases, or Redis is unreachable).
    :raises ConfigError: if the shards or the shard count do not fit the namespace.
    """
    worker = Worker(
        redis,
        shards=shards,
        apps=apps,
        registry=registry,
        settings=Settings(namespace=namespace, shard_count=shard_count, **settings),
    )
    # Entered by hand rather than with ``async with``: the block's own error is then not handed
    # to the task group, so it reaches the caller as itself, not inside an exception group.
    task_group = anyio.create_task_group()
    await task_group.__aenter__()
    try:
        task_group.start_soon(worker.run)
        await _owning_every_shard(worker, start_timeout)
        yield worker
    finally:
        worker.stop()
        await _exit_unwrapped(task_group)


async def _owning_every_shard(worker: Worker, timeout: float) -> None:
    # Polled: the worker has no event for owning every shard (leases come one round at a time).
    with anyio.move_on_after(timeout):
        while not worker.shards or len(worker.owned_shards) < len(worker.shards):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return
    raise TimeoutError(
        f"the worker owned shards {worker.owned_shards} of {worker.shards or 'its shards'} after"
        f" {timeout}s: another worker holds their leases, or Redis is unreachable"
    )


async def _exit_unwrapped(task_group: TaskGroup) -> None:
    """Wait for the worker to return; its one error (a ConfigError) is raised as itself."""
    try:
        await task_group.__aexit__(None, None, None)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
