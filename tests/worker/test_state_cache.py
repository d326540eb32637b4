"""A shard owner keeps at most ``max_cached_states`` keys' states in memory: idle keys are
dropped and read again when an op needs them, with every op still applied exactly once, in
order, on the state the one before it committed; also across a takeover under load."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import Starter, eventually, keys_on_shard
from tests.ownership import inspector, wait_for_holder

OPENING = 100


def _ring(accounts: int) -> list[tuple[str, str]]:
    """Transfers of 1 from each account to the next, around a ring: applied exactly once each,
    every balance ends as it began; one lost or applied twice leaves two balances off by one."""
    names = [f"acct:{n}" for n in range(accounts)]
    return [(names[n], names[(n + 1) % accounts]) for n in range(accounts)]


async def _open(ks: keyserial.Client, ring: list[tuple[str, str]]) -> None:
    async with anyio.create_task_group() as group:
        for source, _ in ring:
            group.start_soon(ks.submit, source, deposit(OPENING))


async def _pay_around(
    ks: keyserial.Client, ring: list[tuple[str, str]], tag: str, paid: list[int] | None = None
) -> None:
    """Every transfer of the ring once, 16 at a time; one that fails (a takeover) is sent again
    under its op id until it answers, so each is applied once whatever happened to the first.
    ``paid`` collects the number of each transfer answered."""
    limiter = anyio.Semaphore(16)

    async def pay(n: int, source: str, target: str) -> None:
        async with limiter:
            while True:
                try:
                    await ks.transfer(source, target, 1, op_id=f"{tag}-{n}", timeout=5)
                    break
                except keyserial.KeyserialError:
                    await anyio.sleep(0.05)
        if paid is not None:
            paid.append(n)

    async with anyio.create_task_group() as group:
        for n, (source, target) in enumerate(ring):
            group.start_soon(pay, n, source, target)


@pytest.mark.slow
async def test_a_worker_keeps_at_most_max_cached_states_and_reads_dropped_ones_again(
    redis_url: str, namespace: str
) -> None:
    ring = _ring(300)
    async with (
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
        running_worker(
            redis_url, namespace, shard_count=4, max_cached_states=20, idle_poll=0.2
        ) as worker,
    ):
        await _open(ks, ring)
        for round_ in range(2):
            await _pay_around(ks, ring, f"round{round_}")
        balances = [await ks.read(source) for source, _ in ring]
        assert balances == [OPENING] * len(ring)
        runners = [worker._runner(shard) for shard in range(4)]
        # (Keys a cross-shard op held or wrote while it ran are dropped at the shard's next
        # step, its idle poll at the latest.)
        await eventually(lambda: all(len(r.states) <= 20 for r in runners if r), timeout=5)
        for runner in runners:
            assert runner is not None
            assert not runner.states.complete  # (it dropped some: a missing key is read again)


@pytest.mark.parametrize("queued", [False, True], ids=["at once", "queued"])
async def test_a_home_shard_keeps_no_state_of_another_shard_s_key(
    redis_url: str, namespace: str, queued: bool
) -> None:
    """The step that takes a cross-shard op in reads the states of all its keys; the home
    shard's owner keeps only its own (another shard's owner holds the rest), so the home's cache,
    and what ``keyserial_shard_cached_keys`` counts for it, is its own keys. ``queued``: the op
    is appended behind a slow async op on its home key (it queues), else it runs at once."""
    here, there = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    async with (
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
        running_worker(
            redis_url, namespace, shard_count=4, apps=["tests.apps"], preload_states=0
        ) as worker,
    ):
        await ks.submit(there, deposit(10))
        home = worker._runner(0)
        assert home is not None
        if queued:
            await ks.enqueue(here, apps.slow_increment(0.3))
        await ks.transfer(there, here, 3)
        assert await ks.read(here) == (4 if queued else 3)
        assert home.states.missing([here, there]) == [there]


@pytest.mark.slow
async def test_states_dropped_while_the_owner_is_killed_under_load_lose_no_op(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """Eviction racing a takeover: the owner (and the standby after it) keeps 8 states per
    shard while transfers over 200 accounts run; the owner is killed -9 mid-load, and every
    transfer is still applied exactly once."""
    ring = _ring(400)
    env = {"KEYSERIAL_MAX_CACHED_STATES": "8"}
    paid: list[int] = []
    with anyio.fail_after(90):
        async with (
            inspector(redis_url) as client,
            keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
        ):
            owner = start(redis_url, namespace, env=env)
            await wait_for_holder(client, namespace, owner.pid, timeout=15)
            standby = start(redis_url, namespace, env=env)
            await _open(ks, ring)
            async with anyio.create_task_group() as group:
                group.start_soon(_pay_around, ks, ring, "pay", paid)
                while len(paid) < len(ring) // 4:
                    await anyio.sleep(0.001)
                owner.signal(signal.SIGKILL)
                assert len(paid) < len(ring)  # killed mid-load
            await wait_for_holder(client, namespace, standby.pid, timeout=15)
            balances = [await ks.read(source) for source, _ in ring]
            assert balances == [OPENING] * len(ring)


async def test_a_key_an_op_still_needs_is_never_dropped(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """While an op runs on a key (and another waits behind it), ops on many other keys overflow
    the cache: the key stays, so the waiting op sees the running one's write, in order."""
    note, gate = tmp_path / "started", tmp_path / "gate"
    async with (
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        running_worker(
            redis_url, namespace, shard_count=1, apps=["tests.apps"], max_cached_states=10
        ) as worker,
    ):
        async with anyio.create_task_group() as group:
            group.start_soon(ks.submit, "held", apps.gated_append("first", str(note), str(gate)))
            await eventually(note.exists)
            second: list[object] = []

            async def append_second() -> None:
                second.append(await ks.submit("held", apps.append("second")))

            group.start_soon(append_second)
            for n in range(60):  # one at a time: a step, and an eviction, for each
                await ks.submit(f"other:{n}", deposit(1))
            runner = worker._runner(0)
            assert runner is not None and len(runner.states) <= 10
            gate.touch()
        assert second == [["first", "second"]]
        assert await ks.read("held") == ["first", "second"]


async def test_a_takeover_preloads_only_a_shard_within_the_cache_bound(
    redis_url: str, namespace: str
) -> None:
    """A new owner loads every state of a shard only if it holds at most ``preload_states``
    and at most ``max_cached_states`` of them: 40 keys, a cache of 8 states: none is loaded
    (they are read as ops need them), where 40 fit ``preload_states`` alone."""
    keys = [f"acct:{n}" for n in range(40)]
    async with (
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        for key in keys:
            await ks.submit(key, deposit(1))
    for cache, loaded in ((8, 0), (100, 41)):  # (41: the 40, and the first round's new key)
        async with (
            running_worker(
                redis_url, namespace, shard_count=1, preload_states=100, max_cached_states=cache
            ) as worker,
            keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
        ):
            await ks.submit(f"new:{cache}", deposit(1))  # (answered: the preload is over)
            assert len(worker._owned[0].runner.states) == loaded + 1
