"""The namespace an operator names, which must be one that something has used.

``Backend.layout_record`` answers None for a namespace nothing has used; an operator's command
on one would show or change nothing, most likely for a mistyped ``--namespace`` or ``--redis``,
so these raise instead.
"""

from __future__ import annotations

from .._backend.backend import Backend
from .._wire.layout import Layout
from .._wire.resharding import LayoutRecord
from ..errors import ConfigError


async def layout_in_use(backend: Backend, namespace: str) -> Layout:
    """The namespace's live layout (its shard count).

    :raises ConfigError: if nothing has used the namespace yet (nothing is recorded).
    """
    return (await record_in_use(backend, namespace)).live


async def record_in_use(backend: Backend, namespace: str) -> LayoutRecord:
    """The namespace's layout record (its layout, and the reshard under way if any).

    :raises ConfigError: if nothing has used the namespace yet (nothing is recorded).
    """
    recorded = await backend.layout_record(namespace)
    if recorded is None:
        raise ConfigError(
            f"namespace {namespace!r} has no shard count recorded in Redis: no worker or client"
            " has used it (check --namespace and --redis)"
        )
    return recorded
