"""The "order shipped" e-mail recorded once in PostgreSQL, fenced against frozen workers.

Seed article 004 (a Russian translation of "Double-checked locking with Django ORM"): jobs on
several servers take the order with ``select_for_update(skip_locked=True)``, check a flag, send.
Here ``send_shipped_email_pg`` (``workers/mail_pg.py``) runs on the order's shard, one op after
another, and records the send in PostgreSQL in one transaction that first moves the order's
fence up to the op's ``ctx.fence`` (``… WHERE fence < $2``) and then inserts the send unless the
order has one. A worker frozen past its lease that wakes up holds an older fence: PostgreSQL
refuses its write. This script shows that refusal by writing under an older fence itself
(``tests/project/test_postgres.py`` freezes a real worker with SIGSTOP).

The worker and this script use the database ``$MAIL_PG_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); the driver is ``asyncpg`` (``pip install -e
".[dev]"``).

Run: ``keyserial dev --app workers.mail_pg`` in one terminal, then
``python -m examples.06_send_once_postgres`` in another, both with ``MAIL_PG_DSN`` set.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import asyncpg

import keyserial
from workers.mail_pg import Sent, StaleFence, create_schema, dsn, record_send, send_shipped_email_pg

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0
#: Ops per server, each under its own op id, all in flight at once.
ATTEMPTS = 10


async def server(order: str) -> list[Sent]:
    """One server's background jobs: ATTEMPTS ops for the same order, at once."""
    async with keyserial.connect(URL, shards=16) as ks:
        return await asyncio.gather(
            *(
                ks.submit(order, send_shipped_email_pg("ada@example.com"), timeout=TIMEOUT)
                for _ in range(ATTEMPTS)
            )
        )


async def main() -> None:
    await create_schema()
    order = f"order:{uuid.uuid4().hex[:12]}"
    first, second = await asyncio.gather(server(order), server(order))
    outcomes = first + second
    senders = [outcome for outcome in outcomes if outcome["sent"]]
    connection = await asyncpg.connect(dsn())
    try:
        recorded = await connection.fetch(
            "SELECT op_id, fence FROM shipped_emails WHERE order_key = $1", order
        )
        print(
            f"{order}: {len(outcomes)} ops from two servers -> {len(recorded)} send recorded"
            f" in PostgreSQL; {len(senders)} op sent, {len(outcomes) - len(senders)} found it"
            " sent already"
        )
        assert len(senders) == 1 and len(recorded) == 1, (outcomes, recorded)
        assert recorded[0]["fence"] == senders[0]["fence"]

        # A worker frozen before it wrote wakes up with the fence it had then: an older one.
        stale = senders[0]["fence"] - 1
        try:
            await record_send(connection, order, "ada@example.com", "zombie-op", stale)
        except StaleFence as exc:
            print(f"{order}: a write under fence {stale}: {exc.message}")
        else:
            raise AssertionError("a stale fence was accepted")
        count = await connection.fetchval(
            "SELECT count(*) FROM shipped_emails WHERE order_key = $1", order
        )
        assert count == 1, count
    finally:
        await connection.close()
    print("OK: one send recorded in PostgreSQL; the stale fence was refused")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
    except (OSError, asyncpg.PostgresError) as exc:
        raise SystemExit(f"PostgreSQL at $MAIL_PG_DSN: {exc} (see the Run: line above)") from None
