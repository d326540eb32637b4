"""``keyserial.connect_sync``: the client for synchronous code (Django, Flask, Celery, scripts).

Every thread of a process may share one :class:`SyncClient`: its calls run on one event loop in a
background thread, over one connection with one reply listener, so concurrent submits from many
threads are packed into stream entries exactly as concurrent tasks' submits are.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from .._settings import Settings
from .._wire.call import Call
from .api import Client
from .connect import connect_asyncio
from .hosted import HostedClient

R = TypeVar("R")


class SyncClient:
    """Blocking twins of :class:`keyserial.Client`'s calls, raising the same errors. Create it
    with :func:`keyserial.connect_sync`; close it with ``close()`` or a ``with`` block."""

    def __init__(self, hosted: HostedClient) -> None:
        self._hosted = hosted
        self._client: Client = hosted.client

    @property
    def settings(self) -> Settings:
        return self._client.settings

    @property
    def shard_count(self) -> int:
        return self._client.shard_count

    def shard_of(self, key: str) -> int:
        return self._client.shard_of(key)

    def new_op_id(self) -> str:
        """A fresh op id to pass as ``op_id=`` (see :meth:`keyserial.Client.new_op_id`; it
        raises in a forked child, where it would repeat the parent's ids)."""
        return self._client.new_op_id()

    def submit(
        self,
        key: str,
        call: Call[R],
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> R:
        """:meth:`keyserial.Client.submit`, blocking."""
        return self._hosted.run(
            lambda: self._client.submit(key, call, timeout=timeout, op_id=op_id, delay=delay, at=at)
        )

    def enqueue(
        self,
        key: str,
        call: Call[Any],
        *,
        op_id: str | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> str:
        """:meth:`keyserial.Client.enqueue`, blocking until the op is appended."""
        return self._hosted.run(
            lambda: self._client.enqueue(
                key, call, op_id=op_id, timeout=timeout, delay=delay, at=at
            )
        )

    def submit_many(
        self,
        keys: Sequence[str],
        call: Call[R],
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> R:
        """:meth:`keyserial.Client.submit_many`, blocking."""
        return self._hosted.run(
            lambda: self._client.submit_many(
                keys, call, timeout=timeout, op_id=op_id, delay=delay, at=at
            )
        )

    def transfer(
        self,
        source: str,
        target: str,
        amount: int,
        *,
        timeout: float | None = None,
        op_id: str | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> dict[str, int]:
        """:meth:`keyserial.Client.transfer`, blocking."""
        return self._hosted.run(
            lambda: self._client.transfer(
                source, target, amount, timeout=timeout, op_id=op_id, delay=delay, at=at
            )
        )

    def result(self, op_id: str, *, key: str | Sequence[str], op: Call[Any] | None = None) -> Any:
        """:meth:`keyserial.Client.result`, blocking."""
        return self._hosted.run(lambda: self._client.result(op_id, key=key, op=op))

    def read(self, key: str) -> Any:
        """:meth:`keyserial.Client.read`, blocking."""
        return self._hosted.run(lambda: self._client.read(key))

    def close(self) -> None:
        """Close the connection and stop the background thread (idempotent)."""
        self._hosted.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def connect_sync(
    url: str | None = None,
    *,
    shards: int | None = None,
    namespace: str | None = None,
    **settings: Any,
) -> SyncClient:
    """Connect from synchronous code: ``with keyserial.connect_sync(url, shards=16) as ks:
    ks.submit(...)``. Arguments as :func:`keyserial.connect` (``url`` defaults to
    ``$KEYSERIAL_REDIS_URL``); it returns once connected.

    Share one client between all threads of a process. It does not survive a fork: in a forked
    child every call raises :class:`KeyserialError`; create it after the fork (lazily on first
    use, or in the server's post-fork hook).

    :raises ConfigError: on a shard-count mismatch or a bad setting.
    :raises BackendUnavailable: if Redis cannot be reached.
    """
    if url is not None and not isinstance(url, str):
        raise TypeError(f"url must be a Redis URL string, not {url!r}")
    hosted = HostedClient(lambda: connect_asyncio(url, shards, namespace, settings))
    hosted.opened.result()  # raises what connecting raised
    return SyncClient(hosted)
