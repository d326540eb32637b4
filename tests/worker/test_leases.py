"""Lease rounds (``_leases``) against a real server: one runner per acquired shard, even when
a failover moves a shard's lease key to another node while the old node's round is in flight."""

from __future__ import annotations

import anyio
import pytest

from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._scripts.lease import LeaseGrant
from keyserial._wire.layout import Layout
from keyserial._worker.leases import Held, Leases
from keyserial._worker.metrics import Metrics

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


def _leases(backend: Backend, namespace: str) -> tuple[Leases[None], list[int]]:
    """Leases whose ``start`` does what a worker's does (hold the shard), and the shards it
    started, in order."""
    settings = Settings(namespace=namespace, shard_count=2, lease_ttl=5.0)
    metrics = Metrics(namespace, [], dict, port=None)
    held: dict[int, Held[None]] = {}
    started: list[int] = []

    def start(shard: int, grant: LeaseGrant, renewed_at: float) -> None:
        started.append(shard)
        held[shard] = Held(runner=None, renewed_at=renewed_at)

    layout = Layout(namespace, 2)
    return Leases(backend, settings, layout, "worker-a", metrics, held, start), started


async def test_an_attempt_answered_twice_starts_one_runner(
    backend: Backend, namespace: str
) -> None:
    """Across a failover, the stuck old node's round and the new node's round can both send
    a shard's acquire: the same attempt, both answered with its grant. One runner starts; a
    second would share its epoch, and fencing could not tell the two apart."""
    leases, started = _leases(backend, namespace)
    async with anyio.create_task_group() as group:
        group.start_soon(leases._node_round, "old-master", [], [0])
        group.start_soon(leases._node_round, "new-master", [], [0])
    assert started == [0]


async def test_a_shard_with_an_acquire_in_flight_is_not_tried_again(
    backend: Backend, namespace: str
) -> None:
    leases, started = _leases(backend, namespace)
    async with anyio.create_task_group() as group:
        leases._round([0, 1], False, group)
        assert not leases._may_acquire(0, anyio.current_time(), stopping=False)
    assert started == [0, 1]
    assert leases._may_acquire(0, anyio.current_time(), stopping=False) is False  # held now
