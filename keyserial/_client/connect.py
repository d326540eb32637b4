"""``keyserial.connect``: the one way in for callers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sniffio

from .._backend.backend import AnyRedis, Backend
from .._backend.durability import check_durability
from .._settings import Settings, default_url
from .._wire.resharding import LayoutRecord
from ..errors import ShardCountMismatch
from .api import Client
from .asyncio_client import AsyncioClient
from .foreign import ForeignLoopClient

log = logging.getLogger("keyserial.client")


@asynccontextmanager
async def connect(
    redis: str | AnyRedis | None = None,
    *,
    shards: int | None = None,
    namespace: str | None = None,
    **options: Any,
) -> AsyncIterator[Client]:
    """Connect to a namespace: ``async with keyserial.connect(url, shards=16) as ks``.

    ``redis`` is a URL (a cluster is detected and used as one; default: ``KEYSERIAL_REDIS_URL``,
    else ``keyserial dev``'s server, :data:`DEFAULT_URL`) or a ``redis.asyncio`` client you
    configured (retries, TLS) and keep owning. ``shards`` is the count a new namespace records;
    ``None`` adopts the recorded one (16 for a new namespace). Another count than the recorded
    one is refused, unless a reshard changed it since: then the client warns and follows the
    recorded layout, as it always routes by it. ``options`` are
    :class:`Settings` fields. An argument left out (or ``None``) comes from its
    ``KEYSERIAL_<FIELD>`` variable, else the default (namespace ``"default"``).

    Under trio (through anyio) the client runs on an asyncio loop in a thread of its own, and
    ``redis`` must be a URL.

    :raises ConfigError: on a shard-count mismatch (``ShardCountMismatch``), a bad setting or
        ``KEYSERIAL_*`` variable.
    :raises BackendUnavailable: if Redis cannot be reached.
    """
    if sniffio.current_async_library() == "asyncio":
        async with connect_asyncio(redis, shards, namespace, options) as client:
            yield client
        return
    if redis is not None and not isinstance(redis, str):
        raise TypeError("under trio, pass a Redis URL: a redis.asyncio client runs on asyncio only")
    foreign = await ForeignLoopClient.open(
        lambda: connect_asyncio(redis, shards, namespace, options)
    )
    async with foreign:
        yield foreign


@asynccontextmanager
async def connect_asyncio(
    redis: str | AnyRedis | None,
    shards: int | None,
    namespace: str | None,
    options: dict[str, Any],
) -> AsyncIterator[AsyncioClient]:
    if "shard_count" in options:  # (Settings' name for it: Python's error would be a puzzle)
        raise TypeError("connect() takes the shard count as shards=, not shard_count=")
    settings = Settings.resolve(namespace=namespace, shard_count=shards, **options)
    backend = await Backend.connect(default_url() if redis is None else redis)
    try:
        configured_by = "KEYSERIAL_SHARD_COUNT=" if shards is None else "shards="
        record = await _layout_record(backend, settings, configured_by)
        await check_durability(backend, settings.durability)
    except BaseException:
        await backend.aclose()
        raise
    async with AsyncioClient(backend, settings, record) as client:
        yield client


async def _layout_record(backend: Backend, settings: Settings, configured_by: str) -> LayoutRecord:
    """The namespace's layout record, its shard count recorded first if the namespace is new.

    A configured count (``configured_by``: ``shards=`` or ``KEYSERIAL_SHARD_COUNT=``) other than
    the recorded one is refused while the namespace never changed its count: another deployment,
    or another server, has it otherwise. Once a reshard has moved it, the count is only out of
    date (the README's ``shards=16`` after ``keyserial reshard --to 32``): a client routes by
    the recorded layout whatever it was given, as one connected before the reshard follows it,
    so it warns and connects.

    :raises ShardCountMismatch: the count differs, and the namespace was never resharded.
    """
    namespace = settings.namespace
    try:
        await backend.ensure_layout(namespace, settings.shard_count)
    except ShardCountMismatch as exc:
        record = await backend.layout_record(namespace)
        if record is None or not resharded(record):
            raise exc.configured_by(configured_by) from None
        if settings.shard_count != record.routing.shards:
            log.warning(
                "namespace %r was resharded to %d shards (layout generation %d), and this"
                " client was given %s%d: it routes by the recorded layout, as every client"
                " does. Leave %s out, or make it %d.",
                namespace,
                record.routing.shards,
                record.routing.generation,
                configured_by,
                settings.shard_count,
                configured_by,
                record.routing.shards,
            )
    record = await backend.layout_record(namespace)
    assert record is not None, "ensured just now"
    return record


def resharded(record: LayoutRecord) -> bool:
    """Whether the namespace's shard count was ever changed, or is being changed, by a reshard."""
    return record.live.generation > 0 or record.move is not None
