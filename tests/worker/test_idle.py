"""What an idle worker costs. Once a shard has been idle for two polls (nothing running or to
commit, two steps that fetched nothing), its owner takes no step for it: the worker's poll
reads, in one pipeline for all such shards, whether their streams have new entries, and wakes
only those. A lease is renewed every quarter of its TTL, not at every lease round, and a
standby tries a held shard when the lease it saw would run out, or at once when it is
released. What this saves is measured by ``python -m benchmarks.idle`` (benchmarks/README.md)."""

from __future__ import annotations

import signal
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial._scripts.calls import Script
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests.entries import append_entry, envelope, stored
from tests.helpers import Starter, eventually, keys_on_shard, monitored
from tests.ownership import holder_pid, inspector

SHARDS = 8


async def test_idle_shards_take_no_step_and_are_looked_at_in_one_read_per_poll(
    redis_url: str, namespace: str
) -> None:
    """Every shard idle: over a window of several polls the server runs no step script of the
    namespace, one XRANGE per shard per poll, and at most one renewal per lease (TTL 8 s:
    renewed every 1.5 s, where every lease round, each 0.5 s, used to renew it)."""
    step_sha, renew_sha = Script.load("step").sha, Script.load("renew").sha
    async with (
        running_worker(
            redis_url, namespace, shard_count=SHARDS, idle_poll=0.1, lease_ttl=8
        ) as worker,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        for shard in range(SHARDS):
            await ks.submit(keys_on_shard(shard, SHARDS, 1, "acct")[0], deposit(1))
        await eventually(
            lambda: (
                len(worker.owned_shards) == SHARDS
                and all(worker._owned[shard].runner.dormant for shard in range(SHARDS))
            ),
            message="every shard dormant",
        )
        async with monitored(redis_url) as commands:

            def looked_at_each_shard(times: int) -> bool:
                xranges = [c for c in commands if c.startswith("XRANGE") and namespace in c]
                return len(xranges) >= times * SHARDS

            await eventually(lambda: looked_at_each_shard(8), message="8 polls of every shard")
    mine = [command for command in commands if namespace in command]
    assert [c for c in mine if step_sha in c] == []
    renewals = [c for c in mine if renew_sha in c]
    assert len(renewals) <= 2 * SHARDS  # (a window of about one second)


async def test_an_entry_appended_with_no_wake_up_to_a_dormant_shard_is_found_by_the_poll(
    redis_url: str, namespace: str
) -> None:
    """A plain XADD with no PUBLISH (a wake-up lost, or a foreign appender that sends none)
    into a dormant shard still runs within about a poll."""
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=1, shards="0", idle_poll=0.1) as w,
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        ):
            assert await ks.submit("k", deposit(1)) == 1
            await eventually(lambda: w._owned[0].runner.dormant, message="the shard dormant")
            await append_entry(
                client, namespace, 0, [envelope("plain", "k", "deposit", 10)], fresh=False
            )
            assert await eventually(lambda: stored(client, namespace, 0, "plain"), timeout=5) == {
                "ok": 11
            }
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_a_standby_tries_a_held_shard_once_its_lease_may_end_and_at_once_on_release(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """A standby learns how long each held lease lives and tries the shard again only then
    (lease TTL 8 s: once in the window below, where it tried at every 0.5 s round), unless a
    wake-up on the shard's channel says something happened: when the owner stops and releases
    its shards, the standby owns them well within the lease TTL it last saw."""
    acquire_sha = Script.load("acquire").sha
    shards = f"0-{SHARDS - 1}"
    owner = start(redis_url, namespace, shards=shards, shard_count=SHARDS, lease_ttl=8)
    async with (
        inspector(redis_url) as client,
        keyserial.connect(redis_url, shards=SHARDS, namespace=namespace) as ks,
    ):
        assert await ks.submit("k", deposit(1), timeout=30) == 1
        await eventually(lambda: _all_held_by(client, namespace, owner.pid), timeout=30)
        async with monitored(redis_url) as commands:
            standby = start(redis_url, namespace, shards=shards, shard_count=SHARDS, lease_ttl=8)
            await eventually(
                lambda: _tried(commands, acquire_sha, namespace) >= SHARDS,
                timeout=30,
                message="the standby's first round",
            )
            await anyio.sleep(3)  # (six rounds)
        assert _tried(commands, acquire_sha, namespace) <= 2 * SHARDS
        owner.signal(signal.SIGTERM)
        # (The leases it last saw live 5 s more at least: without the release's wake-up it
        # would not try them before.)
        await eventually(lambda: _all_held_by(client, namespace, standby.pid), timeout=3)


async def _all_held_by(client: Any, namespace: str, pid: int) -> bool:
    return all([await holder_pid(client, namespace, shard) == pid for shard in range(SHARDS)])


def _tried(commands: list[str], acquire_sha: str, namespace: str) -> int:
    return sum(acquire_sha in c and namespace in c for c in commands)
