"""The wallet's ops, run by keyserial workers: `python -m keyserial worker --app wallet.ops`.

Each op runs alone on its wallet (every op on one key runs serially), so the read-check-write
below needs no lock: this replaces the `cache.add("lock:wallet:<user>")` spin lock the view used
to take around the same three lines.
"""

import keyserial


@keyserial.op
def top_up(ctx: keyserial.Context, amount: int) -> int:
    """Add ``amount`` cents; return the new balance."""
    if not isinstance(amount, int) or amount <= 0:
        raise ValueError(f"amount must be a positive integer, not {amount!r}")
    ctx.state = (ctx.state or 0) + amount
    return int(ctx.state)


@keyserial.op
def charge(ctx: keyserial.Context, amount: int) -> int:
    """Take ``amount`` cents; return the new balance.

    :raises InsufficientFunds: if the wallet holds less (it is left untouched).
    """
    if not isinstance(amount, int) or amount <= 0:
        raise ValueError(f"amount must be a positive integer, not {amount!r}")
    balance = ctx.state or 0
    if balance < amount:
        raise keyserial.InsufficientFunds(balance=balance, amount=amount)
    ctx.state = balance - amount
    return int(ctx.state)
