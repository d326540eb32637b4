"""``keyserial.reshard``: the Python side of ``keyserial reshard``."""

from __future__ import annotations

from collections.abc import Callable

from .._backend.backend import AnyRedis, Backend
from .._settings import Settings, default_url
from .mover import Resharded, move_namespace


async def reshard(
    redis: str | AnyRedis | None = None,
    *,
    to: int,
    namespace: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Resharded | None:
    """Move a live namespace to ``to`` shards, or finish the move to ``to`` shards under way
    (after an interruption); None if it has ``to`` shards already. Running clients and workers
    follow the move by themselves (see docs/operations.md, "Resharding").

    Needs the worker's Redis user (a client's may not write the records). ``progress`` is
    told each step in a line.

    :raises ReshardRefused: if another move of the namespace is under way.
    :raises ConfigError: for a namespace nothing has used, or ``to`` below 1.
    """
    settings = Settings.resolve(namespace=namespace)
    backend = await Backend.connect(default_url() if redis is None else redis)
    try:
        if progress is None:
            return await move_namespace(backend, settings, to)
        return await move_namespace(backend, settings, to, progress)
    finally:
        await backend.aclose()
