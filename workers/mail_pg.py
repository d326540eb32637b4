"""The "order shipped" e-mail, recorded once in PostgreSQL and guarded by the key's fencing token.

Seed 004 sends it from background jobs that take the order row with
``SELECT … FOR UPDATE SKIP LOCKED``. Here the op ``send_shipped_email_pg`` runs on the order's
shard, one op after another per order, and records the send in PostgreSQL in one transaction:

1. it takes the order's fence: ``keyserial_fences.fence`` moves up to ``ctx.fence`` only if it is
   lower (``… DO UPDATE SET fence = $2 WHERE keyserial_fences.fence < $2``). A worker that was
   frozen past its lease (GC, swap, SIGSTOP) and wakes up holds an older fence than the owner
   that took the shard over, so its write is refused: it cannot send;
2. it inserts the send into ``shipped_emails`` unless the order already has one (the order is
   the primary key): the second op on an order finds it and sends nothing.

``shipped_emails`` is an outbox: a relay delivers each row to the mail provider once, with the
row's ``op_id`` as the provider's idempotency key. The decision to send commits in PostgreSQL,
atomically with the fence check, so no interleaving of workers can record two sends.

Once it starts, the PostgreSQL transaction is finished even if the worker loses the shard
meanwhile: the fence, not the timing of a cancellation, decides whether a write lands.

The database is ``$MAIL_PG_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``);
:func:`create_schema` creates the two tables. Serve with
``keyserial worker --app workers.mail_pg`` (needs ``asyncpg``, in the ``dev`` extra).
"""

from __future__ import annotations

import logging
import os
from typing import Any, NotRequired, TypedDict

import anyio
import asyncpg

import keyserial

log = logging.getLogger(__name__)

#: Environment variable naming the database (not ``KEYSERIAL_*``: those are keyserial settings).
DSN_ENV = "MAIL_PG_DSN"

SCHEMA = """
CREATE TABLE IF NOT EXISTS keyserial_fences (
    key   text PRIMARY KEY,
    fence bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS shipped_emails (
    order_key   text PRIMARY KEY,
    recipient   text NOT NULL,
    op_id       text NOT NULL,
    fence       bigint NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
"""

#: Moves the key's fence up to $2; no row comes back when it already is at $2 or above.
_TAKE_FENCE = """
INSERT INTO keyserial_fences (key, fence) VALUES ($1, $2)
ON CONFLICT (key) DO UPDATE SET fence = EXCLUDED.fence WHERE keyserial_fences.fence < $2
RETURNING fence
"""

_RECORD_SEND = """
INSERT INTO shipped_emails (order_key, recipient, op_id, fence) VALUES ($1, $2, $3, $4)
ON CONFLICT (order_key) DO NOTHING
RETURNING op_id
"""


class Sent(TypedDict):
    """What ``send_shipped_email_pg`` returns."""

    sent: bool
    fence: int
    #: Why nothing was sent (only when not ``sent``).
    reason: NotRequired[str]


class StaleFence(keyserial.OperationFailed):
    """A newer owner of the order's shard has written already: this worker is a zombie."""

    wire_type = "mail_pg.StaleFence"

    def __init__(self, order: str, fence: int, current: int) -> None:
        super().__init__(
            f"fence {fence} of order {order!r} is stale: PostgreSQL holds {current}",
            key=order,
            data={"fence": fence, "current": current},
        )


def dsn() -> str:
    return os.environ.get(DSN_ENV, "postgresql://postgres@127.0.0.1:5432/postgres")


async def create_schema(database: str | None = None) -> None:
    connection = await asyncpg.connect(database or dsn())
    try:
        await connection.execute(SCHEMA)
    finally:
        await connection.close()


async def record_send(connection: Any, order: str, recipient: str, op_id: str, fence: int) -> Sent:
    """Record the send of ``order``'s e-mail under ``fence``, in one transaction.

    :raises StaleFence: if PostgreSQL has seen this order's fence at ``fence`` or above.
    """
    async with connection.transaction():
        if await connection.fetchval(_TAKE_FENCE, order, fence) is None:
            current = await connection.fetchval(
                "SELECT fence FROM keyserial_fences WHERE key = $1", order
            )
            log.warning(
                "order %s: refused the write of stale fence %d (PostgreSQL holds %d)",
                order,
                fence,
                current,
            )
            raise StaleFence(order, fence, current)
        if await connection.fetchval(_RECORD_SEND, order, recipient, op_id, fence) is None:
            return {"sent": False, "fence": fence, "reason": "already sent"}
    return {"sent": True, "fence": fence}


@keyserial.op
async def send_shipped_email_pg(
    ctx: keyserial.Context, recipient: str, compose_seconds: float = 0.0
) -> Sent:
    """Send ``order``'s "shipped" e-mail once: ``{"sent": true, "fence": …}`` for the op that
    recorded it, ``{"sent": false, "reason": "already sent", …}`` for every later one.

    ``compose_seconds`` stands for rendering the e-mail (a template service), before anything
    is written.

    :raises StaleFence: if this worker lost the shard to a newer owner that wrote already.
    """
    log.info("order %s: composing the e-mail (op %s, fence %d)", ctx.key, ctx.op_id, ctx.fence)
    await anyio.sleep(compose_seconds)
    with anyio.CancelScope(shield=True):  # bounded: asyncpg's own timeouts
        connection = await asyncpg.connect(dsn(), timeout=10, command_timeout=10)
        try:
            return await record_send(connection, ctx.key, recipient, ctx.op_id, ctx.fence)
        finally:
            await connection.close()
