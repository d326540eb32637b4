"""Two servers sell the same item at once: no oversell, and the final stock is exact.

Seed article 001 (a Turkish post, "Distributed Locking Nedir?"): servers A and B both read a
stock of 10, both write 9, and two units are sold for one. Here two client connections (two
"servers") reserve units of one item concurrently; ``reserve`` (``workers/shop.py``) checks and
decrements the stock with no lock, because every op on the item runs on its shard, one after
another.

Run: ``keyserial dev --app workers.shop --app workers.presence --app workers.mail`` in one
terminal, then ``python -m examples.02_stock_counter``.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import keyserial
from workers.shop import OutOfStock, reserve, restock, stock

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0
IN_STOCK = 50
#: Orders of one unit each server takes: together they ask for more than is in stock.
ORDERS_PER_SERVER = 40


async def server(name: str, item: str) -> tuple[int, int]:
    """One web server taking orders concurrently; returns (units sold, orders refused)."""
    async with keyserial.connect(URL, shards=16) as ks:

        async def order() -> bool:
            try:
                await ks.submit(item, reserve(1), timeout=TIMEOUT)
            except keyserial.OperationFailed as exc:
                if exc.error_type != OutOfStock.wire_type:
                    raise
                return False
            return True

        outcomes = await asyncio.gather(*(order() for _ in range(ORDERS_PER_SERVER)))
    sold = sum(outcomes)
    print(f"server {name}: sold {sold}, refused {ORDERS_PER_SERVER - sold} as out of stock")
    return sold, ORDERS_PER_SERVER - sold


async def main() -> None:
    item = f"item:{uuid.uuid4().hex[:12]}"
    async with keyserial.connect(URL, shards=16) as ks:
        in_stock = await ks.submit(item, restock(IN_STOCK), timeout=TIMEOUT)
        print(f"{item}: restocked to {in_stock}")

        (sold_a, refused_a), (sold_b, refused_b) = await asyncio.gather(
            server("A", item), server("B", item)
        )
        left = await ks.submit(item, stock(), timeout=TIMEOUT)
        print(f"sold {sold_a + sold_b} of {IN_STOCK}; {left} left in stock")
        assert sold_a + sold_b == IN_STOCK, "oversold or undersold"
        assert refused_a + refused_b == 2 * ORDERS_PER_SERVER - IN_STOCK
        assert left == 0, left

        try:
            await ks.submit(item, reserve(1), timeout=TIMEOUT)
        except keyserial.OperationFailed as exc:
            print(f"one more order: {exc.error_type}: {exc.message} (data: {exc.data})")
            assert exc.error_type == "shop.OutOfStock" and exc.data["available"] == 0
        else:
            raise AssertionError("sold a unit that was not in stock")
        await ks.submit(item, restock(5), timeout=TIMEOUT)
        assert await ks.submit(item, reserve(2), timeout=TIMEOUT) == 3
    print(f"OK: sold exactly {IN_STOCK}, no oversell; restock 5 then reserve 2 left 3")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
