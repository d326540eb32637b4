"""A wallet of 100 and two concurrent debits of 25: exactly 50 is left, never 75.

Seed article 000 (a Turkish post on distributed locks in Python): without serialization, both
debits read 100 and both write 75. Here the built-in ledger ops run one after another on the
wallet's shard, so no lock is needed. An overdraft raises ``InsufficientFunds`` and leaves the
balance untouched.

Run: ``keyserial dev --app workers.shop --app workers.presence --app workers.mail`` in one
terminal, then ``python -m examples.01_wallet``.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import keyserial
from keyserial.ledger import balance, deposit, withdraw

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0


async def main() -> None:
    wallet = f"wallet:{uuid.uuid4().hex[:12]}"
    async with keyserial.connect(URL, shards=16) as ks:
        await ks.submit(wallet, deposit(100), timeout=TIMEOUT)
        print(f"{wallet}: deposited 100")

        # Two payments at the same moment, as from two web servers.
        first, second = await asyncio.gather(
            ks.submit(wallet, withdraw(25), timeout=TIMEOUT),
            ks.submit(wallet, withdraw(25), timeout=TIMEOUT),
        )
        print(f"two concurrent debits of 25 returned balances {sorted([first, second])}")
        assert sorted([first, second]) == [50, 75], (first, second)
        final = await ks.submit(wallet, balance(), timeout=TIMEOUT)
        print(f"balance after both debits: {final}")
        assert final == 50, final

        try:
            await ks.submit(wallet, withdraw(80), timeout=TIMEOUT)
        except keyserial.InsufficientFunds as exc:
            print(f"debit of 80 refused: {exc.error_type}, balance {exc.balance} < {exc.amount}")
        else:
            raise AssertionError("a debit of 80 from 50 went through")
        final = await ks.submit(wallet, balance(), timeout=TIMEOUT)
        assert final == 50, final
        assert await ks.read(wallet) == 50
    print(f"OK: final balance {final}; no lost update, no overdraft")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
