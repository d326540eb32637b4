"""``keyserial reshard``: a live namespace moves to another shard count under load, with every
acknowledged op applied once, in order per key, and money conserved across the cut."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import Resharded, reshard
from keyserial._wire.layout import Layout
from tests import apps
from tests.helpers import Starter

#: Accounts of the bank load, each opened with this balance.
ACCOUNTS, OPENING = 12, 100
COUNTERS = 16


@dataclass
class Load:
    """Ops submitted while the namespace moves: each key's appends, awaited in turn (so the
    acknowledged ones are the key's exact list, in order), and transfers between accounts."""

    ks: keyserial.Client
    #: Names this load's counters apart from an earlier load's.
    round: int = 0
    appended: dict[str, list[int]] = field(default_factory=dict)
    transfers: int = 0
    stopped: bool = False

    async def counter(self, key: str) -> None:
        done = self.appended.setdefault(key, [])
        while not self.stopped:
            await self.ks.submit(key, apps.append(len(done)), timeout=60)
            done.append(len(done))

    async def bank(self, seed: int) -> None:
        pick = random.Random(seed)
        while not self.stopped:
            source, target = pick.sample(range(ACCOUNTS), 2)
            with contextlib.suppress(keyserial.InsufficientFunds):
                await self.ks.transfer(f"acct:{source}", f"acct:{target}", 1, timeout=60)
            self.transfers += 1

    async def run(self, during: Callable[[], Any]) -> Any:
        """Run the load, ``during()`` once it is under way, and the load a while after it."""
        result: list[Any] = []
        async with anyio.create_task_group() as group:
            for n in range(COUNTERS):
                group.start_soon(self.counter, f"counter:{self.round}:{n}")
            for seed in range(4):
                group.start_soon(self.bank, seed)
            await anyio.sleep(0.5)
            result.append(await during())
            await anyio.sleep(1.0)
            self.stopped = True
        return result[0]


async def _check(ks: keyserial.Client, load: Load) -> None:
    """Every acknowledged append applied once, in order; money conserved."""
    for key, done in load.appended.items():
        assert await ks.read(key) == done, key
    balances = [await ks.read(f"acct:{n}") for n in range(ACCOUNTS)]
    assert sum(balances) == ACCOUNTS * OPENING
    assert min(balances) >= 0
    assert load.transfers > 0


async def _open_accounts(ks: keyserial.Client) -> None:
    for n in range(ACCOUNTS):
        await ks.submit(f"acct:{n}", keyserial.ledger.deposit(OPENING))


async def _move(url: str, namespace: str, shards: int) -> Resharded | None:
    backend = await Backend.connect(url)
    try:
        return await reshard(backend, Settings(namespace=namespace), shards)
    finally:
        await backend.aclose()


async def test_a_namespace_grows_and_shrinks_under_load_losing_nothing(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """4 -> 16 -> 8 shards while clients append to counters and transfer money between
    accounts, with two workers each serving half the shards: every acknowledged op applied
    once and in order per key, money conserved, and the clients routing by the new layout."""
    start(redis_url, namespace, shards="0-1")
    start(redis_url, namespace, shards="2-3")
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await _open_accounts(ks)
        for shards, generation in ((16, 1), (8, 2)):
            load = Load(ks, generation)
            moved = await load.run(lambda shards=shards: _move(redis_url, namespace, shards))
            assert moved is not None and moved.target == Layout(namespace, shards, generation)
            await _check(ks, load)
            assert ks.layout == Layout(namespace, shards, generation)


async def test_a_reshard_resumes_the_same_move_and_refuses_another(
    redis_url: str, namespace: str, client: redis.asyncio.Redis, start: Starter
) -> None:
    """The move recorded, the mover gone (no worker drains the shards yet): asked for another
    count it refuses, naming the move under way; run again for the same count it finishes it."""
    async with keyserial.connect(redis_url, namespace=namespace, shards=4) as ks:
        await ks.enqueue("k", apps.append(1))
        with anyio.move_on_after(1.0):  # no worker: the shards never drain
            await _move(redis_url, namespace, 8)
        with pytest.raises(keyserial.KeyserialError, match="to 8 shards is under way"):
            await _move(redis_url, namespace, 16)
        start(redis_url, namespace, shards="0-3")
        assert await _move(redis_url, namespace, 8) is not None
        assert await ks.submit("k", apps.append(2), timeout=30) == [1, 2]
        assert await _move(redis_url, namespace, 8) is None  # (nothing to do)
