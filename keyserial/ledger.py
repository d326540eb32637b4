"""Built-in ledger ops, served by every worker with no ``--app``.

A key's state is its balance, an integer (no state: 0)::

    await ks.submit("account:5", deposit(100))
    await ks.submit("account:5", withdraw(30))   # raises InsufficientFunds, balance untouched
    await ks.submit("account:5", balance())
"""

from __future__ import annotations

from typing import Any

from ._ops import Context, Op, op
from .errors import InsufficientFunds


def _amount(amount: Any) -> int:
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise ValueError(f"amount must be a positive integer, not {amount!r}")
    return amount


def _balance(ctx: Context) -> int:
    value = ctx.state
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"key {ctx.key!r} holds {value!r}, not a ledger balance")
    return value


@op
def deposit(ctx: Context, amount: int) -> int:
    """Add ``amount`` (a positive integer) to the balance; return the new balance."""
    ctx.state = _balance(ctx) + _amount(amount)
    return int(ctx.state)


@op
def withdraw(ctx: Context, amount: int) -> int:
    """Take ``amount`` from the balance; return the new balance.

    :raises InsufficientFunds: if the balance is smaller (it is left untouched).
    """
    current, amount = _balance(ctx), _amount(amount)
    if current < amount:
        raise InsufficientFunds(balance=current, amount=amount, key=ctx.key, op_id=ctx.op_id)
    ctx.state = current - amount
    return current - amount


@op
def balance(ctx: Context) -> int:
    """The current balance (0 for a key never written)."""
    return _balance(ctx)


LEDGER_OPS: tuple[Op[..., Any], ...] = (deposit, withdraw, balance)
