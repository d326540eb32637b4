"""Transfers between accounts on three shards, in both directions at once: no lock manager.

Seed article 002 (a Russian post on a lock manager in Erlang): to do something with accounts x,
y and z you call ``lock([x, y, z])``, or ``with([x, y, z], fun([X, Y, Z]) -> [NewX, NewY, NewZ]
end)``, and with several lock servers you must take the locks in the right order or deadlock.
Here x, y and z sit on three different shards and 300 concurrent ``ks.transfer`` calls move money
between them both ways, with no lock and no ordering to get right (keyserial takes the shards in
ascending order): money is conserved, no balance goes negative. Then ``reserve_items``
(``workers/shop.py``) reserves two items for an order, three keys on three shards, at once or not
at all.

Run: ``keyserial dev --app workers.shop --app workers.presence --app workers.mail`` in one
terminal, then ``python -m examples.05_no_lock_manager``.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid

import keyserial
from keyserial.ledger import balance, deposit
from workers.shop import OutOfStock, reserve_items, restock, stock

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0
OPENING, TRANSFERS = 100, 300


def keys_on_distinct_shards(ks: keyserial.Client, names: list[str]) -> list[str]:
    """A fresh key per name (a random suffix), drawn again until no two share a shard."""
    while True:
        keys = [f"{name}:{uuid.uuid4().hex[:8]}" for name in names]
        if len({ks.shard_of(key) for key in keys}) == len(keys):
            return keys


async def transfers(accounts: list[str], count: int) -> list[tuple[str, str, int] | None]:
    """One client's ``count`` random concurrent transfers; None for each one refused."""
    async with keyserial.connect(URL, shards=16) as ks:

        async def pay(source: str, target: str, amount: int) -> tuple[str, str, int] | None:
            try:
                await ks.transfer(source, target, amount, timeout=TIMEOUT)
            except keyserial.InsufficientFunds:
                return None
            return source, target, amount

        pairs = [random.sample(accounts, 2) for _ in range(count)]
        return await asyncio.gather(*(pay(a, b, random.randint(1, 60)) for a, b in pairs))


async def main() -> None:
    async with keyserial.connect(URL, shards=16) as ks:
        accounts = keys_on_distinct_shards(ks, ["account:x", "account:y", "account:z"])
        for account in accounts:
            await ks.submit(account, deposit(OPENING), timeout=TIMEOUT)
        print(f"x, y, z = {accounts}, {OPENING} each, on shards {list(map(ks.shard_of, accounts))}")

        halves = await asyncio.gather(*(transfers(accounts, TRANSFERS // 2) for _ in range(2)))
        done = [transfer for half in halves for transfer in half if transfer is not None]
        # submit, not read: a participant shard applies its part just after the reply.
        final = {a: await ks.submit(a, balance(), timeout=TIMEOUT) for a in accounts}
        print(
            f"{TRANSFERS} concurrent transfers both ways, 2 clients: {len(done)} made, "
            f"{TRANSFERS - len(done)} refused (InsufficientFunds); x, y, z = {[*final.values()]}"
        )
        expected = dict.fromkeys(accounts, OPENING)
        for source, target, amount in done:
            expected[source] -= amount
            expected[target] += amount
        assert final == expected, (final, expected)  # each transfer made applied once, no other
        assert sum(final.values()) == 3 * OPENING and min(final.values()) >= 0, final
        assert 0 < len(done) < TRANSFERS, len(done)

        *items, order = keys_on_distinct_shards(ks, ["sku:1", "sku:2", "order:7"])
        for item, units in zip(items, [5, 1], strict=True):
            await ks.submit(item, restock(units), timeout=TIMEOUT)
        left = await ks.submit_many([*items, order], reserve_items([2, 1]), timeout=TIMEOUT)
        print(
            f"stock [5, 1] of {items}; reserve_items([2, 1]) for {order} on shards "
            f"{list(map(ks.shard_of, [*items, order]))}: stock left {[*left.values()]}"
        )
        assert left == {items[0]: 3, items[1]: 0}, left
        try:
            await ks.submit_many([*items, order], reserve_items([1, 1]), timeout=TIMEOUT)
        except keyserial.OperationFailed as exc:
            assert exc.error_type == OutOfStock.wire_type, exc
            print(f"reserve_items([1, 1]) refused: {exc.message}")
        else:
            raise AssertionError(f"reserved a unit of {items[1]} that was not in stock")
        after = [await ks.submit(item, stock(), timeout=TIMEOUT) for item in items]
        reserved = await ks.read(order)  # applied: the refused op was granted the key after it
        print(f"after the refusal: stock {after}, order reserved {[*reserved.values()]}")
        assert after == [3, 0] and reserved == {items[0]: 2, items[1]: 1}, (after, reserved)
    print("OK: money conserved, none negative across 3 shards; a 3-key op commits all or nothing")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
