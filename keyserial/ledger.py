"""Built-in ledger ops, served by every worker with no ``--app``.

A key's state is its balance, an integer (no state: 0)::

    await ks.submit("account:5", deposit(100))
    await ks.submit("account:5", withdraw(30))   # raises InsufficientFunds, balance untouched
    await ks.submit("account:5", balance())
    await ks.transfer("account:5", "account:9", 25)  # both keys, atomically

Each is a few microseconds of arithmetic with no I/O, so each is declared ``inline``: it runs on
the worker's event loop, with no thread hop.
"""

from __future__ import annotations

from typing import Any

from ._ops import Context, MultiContext, Op, multi_op, op
from .errors import InsufficientFunds


def _amount(amount: Any) -> int:
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise ValueError(f"amount must be a positive integer, not {amount!r}")
    return amount


def _balance(ctx: Context) -> int:
    return _as_balance(ctx.key, ctx.state)


def _as_balance(key: str, value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"key {key!r} holds {value!r}, not a ledger balance")
    return value


@op(inline=True)
def deposit(ctx: Context, amount: int) -> int:
    """Add ``amount`` (a positive integer) to the balance; return the new balance."""
    new_balance = _balance(ctx) + _amount(amount)
    ctx.state = new_balance
    return new_balance


@op(inline=True)
def withdraw(ctx: Context, amount: int) -> int:
    """Take ``amount`` from the balance; return the new balance.

    :raises InsufficientFunds: if the balance is smaller (it is left untouched).
    """
    current, amount = _balance(ctx), _amount(amount)
    if current < amount:
        raise InsufficientFunds(balance=current, amount=amount, key=ctx.key, op_id=ctx.op_id)
    ctx.state = current - amount
    return current - amount


@op(inline=True)
def balance(ctx: Context) -> int:
    """The current balance (0 for a key never written)."""
    return _balance(ctx)


@multi_op(inline=True)
def transfer(ctx: MultiContext, amount: int) -> dict[str, int]:
    """Move ``amount`` from the first key to the second; return both new balances by key.

    :raises InsufficientFunds: if the first key holds less (neither balance changes).
    """
    if len(ctx.keys) != 2:
        raise ValueError(f"transfer takes two keys (source, target), not {list(ctx.keys)!r}")
    source, target = ctx.keys
    amount = _amount(amount)
    states = ctx.states
    available = _as_balance(source, states[source])
    if available < amount:
        raise InsufficientFunds(balance=available, amount=amount, key=source, op_id=ctx.op_id)
    states[source] = available - amount
    states[target] = _as_balance(target, states[target]) + amount
    return {source: states[source], target: states[target]}


LEDGER_OPS: tuple[Op[..., Any], ...] = (deposit, withdraw, balance, transfer)
