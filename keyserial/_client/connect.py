"""``keyserial.connect``: the one way in for callers."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sniffio

from .._backend.backend import AnyRedis, Backend
from .._backend.durability import check_durability
from .._settings import Settings
from ..errors import ShardCountMismatch
from .api import Client
from .client import AsyncioClient
from .foreign import ForeignLoopClient

#: The port ``keyserial dev`` serves on unless told otherwise.
DEV_PORT = 6390
#: Where a client or command given no URL, and no ``KEYSERIAL_REDIS_URL``, connects: the server
#: ``keyserial dev`` starts, never a Redis on the standard port that may be someone else's
#: (docs/deployment.md#the-default-server).
DEFAULT_URL = f"redis://127.0.0.1:{DEV_PORT}/0"
URL_VARIABLE = "KEYSERIAL_REDIS_URL"


def default_url() -> str:
    """``KEYSERIAL_REDIS_URL`` (unless empty), else :data:`DEFAULT_URL`, ``keyserial dev``'s."""
    return os.environ.get(URL_VARIABLE) or DEFAULT_URL


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
    configured (retries, TLS) and keep owning. ``shards`` must match the namespace's recorded
    shard count; ``None`` adopts it. ``options`` are
    :class:`Settings` fields. An argument left out (or ``None``) comes from its
    ``KEYSERIAL_<FIELD>`` variable, else the default (namespace ``"default"``).

    Under trio (through anyio) the client runs on an asyncio loop in a thread of its own, and
    ``redis`` must be a URL.

    :raises ConfigError: on a shard-count mismatch, a bad setting or ``KEYSERIAL_*`` variable.
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
        await backend.ensure_layout(settings.namespace, settings.shard_count)
        record = await backend.layout_record(settings.namespace)
        assert record is not None, "ensured just now"
        await check_durability(backend, settings.durability)
    except ShardCountMismatch as exc:
        await backend.aclose()
        if shards is None:  # the count came from the environment
            raise exc.configured_by("KEYSERIAL_SHARD_COUNT=") from None
        raise
    except BaseException:
        await backend.aclose()
        raise
    async with AsyncioClient(backend, settings, record) as client:
        yield client
