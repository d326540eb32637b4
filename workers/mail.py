"""The "your order has shipped" e-mail, sent once per order, with no row lock.

The key is the order (``"order:1001"``); its state mirrors the seed article's model::

    {"email": "ada@example.com", "shipped_at": "2024-05-01T10:00:00Z", "shipped_email_sent": false}

Any number of background jobs, on any number of servers, may submit ``send_shipped_email`` for
the same order at the same moment: the ops run one after another on the order's shard, so the
first one sends and sets ``shipped_email_sent``, and the others see the flag and send nothing.
Resubmitting one op id (``op_id=f"shipped-email:{order}"``) does not even run the op again: the
stored outcome is returned.

If sending raises, the op fails and the flag stays unset; the failure is stored under the op's
id like any outcome, so a retry must use a new op id (a resubmitted id returns the stored
failure). If the worker dies after the e-mail went out but before the op committed, the next
owner of the shard runs the op again. So the op hands ``ctx.op_id`` to the mail provider as its
idempotency key (it is the same on every run of the op), and ``ctx.fence`` as a fencing token (it
only grows, across owners, so the provider can refuse a write from a stale owner).

The "provider" here is a file: each delivery appends one JSON line to ``$MAIL_OUTBOX`` (default:
``keyserial-outbox.jsonl`` in the temporary directory), so a demo can count what was sent.

Serve with ``keyserial worker --app workers.mail``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import anyio

import keyserial

#: Environment variable naming the outbox file (not ``KEYSERIAL_*``: those are keyserial settings).
OUTBOX_ENV = "MAIL_OUTBOX"
#: How long the fake provider takes to accept a message, in seconds.
SEND_DELAY = 0.05


class Order(TypedDict):
    """An order's state."""

    email: str
    shipped_at: str
    shipped_email_sent: bool


class Sent(TypedDict):
    """What ``send_shipped_email`` returns."""

    sent: bool
    #: The fencing token the e-mail was sent with (only when ``sent``).
    fence: NotRequired[int]
    #: Why nothing was sent (only when not ``sent``).
    reason: NotRequired[str]


class NotShipped(keyserial.OperationFailed):
    """The order is unknown or not shipped yet: there is nothing to announce."""

    wire_type = "mail.NotShipped"

    def __init__(self, order: str) -> None:
        super().__init__(f"order {order!r} has not shipped", key=order)


def outbox_path() -> Path:
    """The file the fake provider appends to, read from the environment at every call."""
    configured = os.environ.get(OUTBOX_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir(), "keyserial-outbox.jsonl")


def sent_emails(order: str) -> list[dict[str, Any]]:
    """Every message the fake provider accepted for ``order``, oldest first."""
    try:
        lines = outbox_path().read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    messages = [json.loads(line) for line in lines if line.strip()]
    return [message for message in messages if message.get("order") == order]


def _append(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as outbox:
        outbox.write(line)


async def deliver(message: dict[str, Any]) -> None:
    """The fake mail provider: slow like a network call, then one line in the outbox.

    A real provider would deduplicate on ``message["idempotency_key"]`` and refuse a
    ``message["fence"]`` lower than the highest it has seen for the order.
    """
    await anyio.sleep(SEND_DELAY)
    line = json.dumps(message, separators=(",", ":")) + "\n"
    await anyio.to_thread.run_sync(_append, outbox_path(), line)


@keyserial.op
def mark_shipped(ctx: keyserial.Context, email: str, shipped_at: str) -> Order:
    """Record that the order shipped (``shipped_at``: an ISO 8601 time); return the order."""
    sent = bool((ctx.state or {}).get("shipped_email_sent", False))
    order = Order(email=email, shipped_at=shipped_at, shipped_email_sent=sent)
    ctx.state = order
    return order


@keyserial.op
async def send_shipped_email(ctx: keyserial.Context) -> Sent:
    """Send the "order shipped" e-mail unless it was sent already.

    Returns ``{"sent": true, "fence": …}`` for the op that sent it and
    ``{"sent": false, "reason": "already sent"}`` for every later one.

    :raises NotShipped: if the order has no ``shipped_at`` yet.
    """
    order = ctx.state
    if not isinstance(order, dict) or not order.get("shipped_at"):
        raise NotShipped(ctx.key)
    if order.get("shipped_email_sent"):
        return {"sent": False, "reason": "already sent"}
    await deliver(
        {
            "order": ctx.key,
            "to": order["email"],
            "subject": "Your order has shipped",
            "idempotency_key": ctx.op_id,
            "fence": ctx.fence,
        }
    )
    # Ops on this key wait while this one awaits, so nothing changed the order meanwhile.
    ctx.state = {**order, "shipped_email_sent": True}
    return {"sent": True, "fence": ctx.fence}
