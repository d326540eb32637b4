"""The test cluster itself: a replica told to take over is followed by every other node.

The takeover fault tests rely on it. A cluster whose nodes were left to settle colliding config
epochs could keep a replica at its master's epoch; its TAKEOVER was then refused by the others
and the slots stayed with the dead master until it came back.
"""

from __future__ import annotations

import time

import pytest

from keyserial.testing import LocalCluster

# A 3-master / 3-replica cluster per test, and a failover.
pytestmark = pytest.mark.slow


def _masters(cluster: LocalCluster) -> list[list[str]]:
    """CLUSTER NODES rows of the nodes serving slots (as the first node sees them)."""
    nodes = cluster.cluster_command(cluster.nodes[0], "NODES")
    return [row for row in map(str.split, nodes.splitlines()) if len(row) > 8]


def test_every_node_starts_with_its_own_config_epoch() -> None:
    with LocalCluster() as cluster:
        for node in cluster.nodes:
            info = cluster.cluster_command(node, "INFO")
            assert f"cluster_current_epoch:{len(cluster.nodes)}" in info, info
        master_epochs = [int(row[6]) for row in _masters(cluster)]
        assert len(set(master_epochs)) == cluster.master_count, master_epochs


def test_a_replica_of_the_newest_master_takes_over_and_is_followed() -> None:
    with LocalCluster() as cluster:
        epoch, port, slots = max(
            (int(row[6]), int(row[1].split("@")[0].rsplit(":")[1]), row[8])
            for row in _masters(cluster)
        )
        victim = cluster.node_at(port)
        assert victim is not None
        first = int(slots.split("-")[0])
        replica = cluster.cut_off_replicas(victim)[0]
        victim.kill()
        cluster.resume(replica)
        cluster.take_over(replica, 10)
        others = [node for node in cluster.nodes if node is not victim]
        deadline = time.monotonic() + 10
        while (seen := cluster.master_of(first, asking=others)) is not replica:
            assert time.monotonic() < deadline, (
                f"slot {first} still served by {seen and seen.port}, not {replica.port}"
                f" (the victim's epoch was {epoch})"
            )
            time.sleep(0.05)
