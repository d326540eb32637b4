"""A stock counter per item: no oversell, however many servers sell the same item at once.

The key is the item (``"item:42"``); its state is the units in stock, an integer (no state: 0).
Every op on one item runs on the item's shard, one after another, so ``reserve`` can check and
decrement without a lock::

    await ks.submit("item:42", restock(10))   # -> 10
    await ks.submit("item:42", reserve(3))    # -> 7 left
    await ks.submit("item:42", reserve(9))    # OperationFailed, error_type "shop.OutOfStock"

``reserve_items`` reserves several items for one order in one multi-key op: its keys are the
items, then the order last, on any shards. It takes each item's quantity out of stock and adds
the units to the order's state (``{"sku:1": 2, "sku:2": 1}``), on every key at once or not at
all, with no lock::

    await ks.submit_many(["sku:1", "sku:2", "order:7"], reserve_items([2, 1]))
    # -> {"sku:1": 8, "sku:2": 0}, the units left; OutOfStock changes no key

Serve with ``keyserial worker --app workers.shop``.
"""

from __future__ import annotations

from typing import Any

import keyserial


class OutOfStock(keyserial.OperationFailed):
    """Fewer units in stock than the reservation asks for; the stock is left untouched.

    It subclasses :class:`keyserial.OperationFailed` so that ``data`` travels to the caller, and
    the worker does not log an expected business error at all (any other exception reaches the
    caller too, as ``OperationFailed`` with ``error_type`` ``"workers.shop.<ClassName>"``, and
    is logged on one INFO line).
    The caller receives an ``OperationFailed`` whose ``error_type`` is :attr:`wire_type`.
    """

    wire_type = "shop.OutOfStock"

    def __init__(self, *, item: str, available: int, wanted: int) -> None:
        super().__init__(
            f"{item!r} has {available} in stock, cannot reserve {wanted}",
            key=item,
            data={"available": available, "wanted": wanted},
        )


def _quantity(qty: Any) -> int:
    if not isinstance(qty, int) or isinstance(qty, bool) or qty <= 0:
        raise ValueError(f"qty must be a positive integer, not {qty!r}")
    return qty


def _units(ctx: keyserial.Context) -> int:
    return _stock_of(ctx.key, ctx.state)


def _stock_of(item: str, value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"key {item!r} holds {value!r}, not a stock count")
    return value


@keyserial.op
def restock(ctx: keyserial.Context, qty: int) -> int:
    """Add ``qty`` units; return the new stock."""
    ctx.state = _units(ctx) + _quantity(qty)
    return int(ctx.state)


@keyserial.op
def reserve(ctx: keyserial.Context, qty: int = 1) -> int:
    """Take ``qty`` units out of stock; return the units left.

    :raises OutOfStock: if fewer than ``qty`` are in stock (nothing is taken).
    """
    available, wanted = _units(ctx), _quantity(qty)
    if available < wanted:
        raise OutOfStock(item=ctx.key, available=available, wanted=wanted)
    ctx.state = available - wanted
    return available - wanted


@keyserial.op
def stock(ctx: keyserial.Context) -> int:
    """The units in stock, ordered after every op submitted before it."""
    return _units(ctx)


@keyserial.multi_op
def reserve_items(ctx: keyserial.MultiContext, quantities: list[int]) -> dict[str, int]:
    """Reserve ``quantities[i]`` units of the ``i``-th item for the order, the last key; add them
    to the order's record of reserved units (item -> units) and return the units left per item.

    :raises OutOfStock: if any item has fewer units than asked (no key is changed).
    """
    *items, order = ctx.keys
    if not items or not isinstance(quantities, list) or len(quantities) != len(items):
        raise ValueError(f"give one quantity per item {items!r}, not {quantities!r}")
    reserved = ctx.states[order] or {}
    if not isinstance(reserved, dict):
        raise TypeError(f"key {order!r} holds {reserved!r}, not an order's reserved units")
    left: dict[str, int] = {}
    for item, qty in zip(items, quantities, strict=True):
        available, wanted = _stock_of(item, ctx.states[item]), _quantity(qty)
        if available < wanted:
            raise OutOfStock(item=item, available=available, wanted=wanted)
        left[item] = available - wanted
    for item, qty in zip(items, quantities, strict=True):
        ctx.states[item] = left[item]
        reserved[item] = reserved.get(item, 0) + qty
    ctx.states[order] = reserved
    return left
