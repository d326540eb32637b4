"""The "order shipped" e-mail goes out exactly once, however many jobs try to send it at once.

Seed article 004 (a Russian translation of "Double-checked locking with Django ORM"): background
jobs on several servers send the e-mail and set ``shipped_email_sent``; without care two of them
send it twice, and the article's fix is double-checked locking with
``select_for_update(skip_locked=True)``.
Here ``send_shipped_email`` (``workers/mail.py``) runs on the order's shard, one op after another:
the first op sends and sets the flag, the others see it. Submitting one op id many times runs the
op once and returns the stored outcome to every submitter. The op passes ``ctx.op_id`` to the mail
provider as idempotency key and ``ctx.fence`` as fencing token, for the replay after a crash.

The fake provider appends to ``$MAIL_OUTBOX`` (default: ``keyserial-outbox.jsonl`` in the
temporary directory); the worker and this script must see the same value.

Run: ``keyserial dev --app workers.shop --app workers.presence --app workers.mail`` in one
terminal, then ``python -m examples.04_send_once``.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import keyserial
from workers.mail import (
    NotShipped,
    Sent,
    mark_shipped,
    outbox_path,
    send_shipped_email,
    sent_emails,
)

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0
#: Submits of the e-mail op per server, all in flight at once.
ATTEMPTS = 10


async def server(order: str, op_id: str | None) -> list[Sent]:
    """One server's background job, trying ATTEMPTS times at once (``None``: a new op id each)."""
    async with keyserial.connect(URL, shards=16) as ks:
        return await asyncio.gather(
            *(
                ks.submit(order, send_shipped_email(), timeout=TIMEOUT, op_id=op_id)
                for _ in range(ATTEMPTS)
            )
        )


async def two_servers(order: str, op_id: str | None) -> list[Sent]:
    first, second = await asyncio.gather(server(order, op_id), server(order, op_id))
    return first + second


async def main() -> None:
    run = uuid.uuid4().hex[:12]
    one_id, fresh_ids = f"order:{run}-1", f"order:{run}-2"
    async with keyserial.connect(URL, shards=16) as ks:
        try:
            await ks.submit(one_id, send_shipped_email(), timeout=TIMEOUT)
        except keyserial.OperationFailed as exc:
            assert exc.error_type == NotShipped.wire_type, exc
            print(f"{one_id}: before shipping: {exc.error_type}: {exc.message}")
        for order in (one_id, fresh_ids):
            await ks.submit(
                order, mark_shipped("ada@example.com", "2024-05-01T10:00:00Z"), timeout=TIMEOUT
            )

        # 1. Two servers submit the op 2 x ATTEMPTS times with one op id (the order's own).
        outcomes = await two_servers(one_id, f"shipped-email:{one_id}")
        emails = sent_emails(one_id)
        print(
            f"{one_id}: {len(outcomes)} submits of one op id -> {len(emails)} e-mail sent;"
            f" every submitter got {outcomes[0]}"
        )
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
        assert outcomes[0]["sent"] is True
        assert len(emails) == 1, emails
        assert emails[0]["idempotency_key"] == f"shipped-email:{one_id}"
        assert emails[0]["fence"] == outcomes[0]["fence"]

        # 2. Two servers submit 2 x ATTEMPTS ops with an op id each: the state flag decides.
        outcomes = await two_servers(fresh_ids, None)
        emails = sent_emails(fresh_ids)
        senders = [outcome for outcome in outcomes if outcome["sent"]]
        print(
            f"{fresh_ids}: {len(outcomes)} ops with distinct ids -> {len(emails)} e-mail sent;"
            f" {len(senders)} op sent it, {len(outcomes) - len(senders)} found it sent already"
        )
        assert len(senders) == 1 and len(emails) == 1, (outcomes, emails)
        state = await ks.read(fresh_ids)
        assert state["shipped_email_sent"] is True, state
    print(f"OK: each order's e-mail was sent exactly once (outbox: {outbox_path()})")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
