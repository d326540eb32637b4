"""Lease rounds (``_leases``) against a real server: one runner per acquired shard, even when
a failover moves a shard's lease key to another node while the old node's round is in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from keyserial import Settings
from keyserial._backend import Backend
from keyserial._lease_scripts import LeaseGrant
from keyserial._leases import Held, Leases
from keyserial._metrics import Metrics

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


class _Started:
    """The worker's side of ``Leases``: what a worker does on ``start`` (hold the shard),
    and a record of every start."""

    def __init__(self) -> None:
        self.held: dict[int, Held] = {}
        self.grants: list[tuple[int, LeaseGrant]] = []

    def __call__(self, shard: int, grant: LeaseGrant, renewed_at: float) -> None:
        self.grants.append((shard, grant))
        self.held[shard] = Held(runner=None, renewed_at=renewed_at)  # type: ignore[arg-type]


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[Backend]:
    backend = await Backend.connect(redis_url)
    try:
        yield backend
    finally:
        await backend.aclose()


def _leases(backend: Backend, namespace: str, started: _Started) -> Leases:
    settings = Settings(namespace=namespace, shard_count=2, lease_ttl=5.0)
    metrics = Metrics(namespace, [], dict, port=None)
    return Leases(backend, settings, "worker-a", metrics, started.held, started)


async def test_an_attempt_answered_twice_starts_one_runner(
    backend: Backend, namespace: str
) -> None:
    """Across a failover, the stuck old node's round and the new node's round can both send
    a shard's acquire: the same attempt, both answered with its grant. One runner starts; a
    second would share its epoch, and fencing could not tell the two apart."""
    started = _Started()
    leases = _leases(backend, namespace, started)
    async with anyio.create_task_group() as group:
        group.start_soon(leases._node_round, "old-master", [], [0])
        group.start_soon(leases._node_round, "new-master", [], [0])
    assert len(started.grants) == 1
    assert list(started.held) == [0]


async def test_a_shard_with_an_acquire_in_flight_is_not_tried_again(
    backend: Backend, namespace: str
) -> None:
    started = _Started()
    leases = _leases(backend, namespace, started)
    async with anyio.create_task_group() as group:
        leases._round([0, 1], False, group)
        assert not leases._may_acquire(0, anyio.current_time(), stopping=False)
    assert [shard for shard, _ in started.grants] == [0, 1]
    assert leases._may_acquire(0, anyio.current_time(), stopping=False) is False  # held now
