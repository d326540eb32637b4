"""Where each system keeps an account's balance, and what the harness does with it on the server.

* lock systems, no-lock and Lua: the string ``<prefix>:acct:<n>`` (an integer; absent: 0); the
  redis-py locks are ``<prefix>:lock:<n>``, the notification lock ``lock:<prefix>:acct:<n>`` and
  ``lock-signal:<prefix>:acct:<n>`` (python-redis-lock's names);
* keyserial: the key ``acct:<n>`` in the run's namespace, read through ``Client.read``.

Every run gets a fresh prefix or namespace; :func:`clean_up` deletes it afterwards, so runs never
see each other's keys and a user-given server is left as it was found.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio

import keyserial
from keyserial.ledger import deposit

from .config import RunSpec, is_keyserial
from .server import BenchServer
from .workloads import account_key

_CHUNK = 1000


def value_key(prefix: str, account: int) -> str:
    return f"{prefix}:acct:{account}"


def lock_key(prefix: str, account: int) -> str:
    """The redis-py Lock's key for an account."""
    return f"{prefix}:lock:{account}"


def _chunks(items: Sequence[int]) -> Iterable[Sequence[int]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


async def seed(bench: BenchServer, spec: RunSpec, balance: int) -> None:
    """Give every account of the run ``balance`` before it starts (the transfer workload)."""
    accounts = list(range(spec.keys))
    if is_keyserial(spec.system):
        async with keyserial.connect(spec.url, shards=spec.shards, namespace=spec.prefix) as ks:
            limiter = anyio.Semaphore(256)

            async def one(account: int) -> None:
                async with limiter:
                    await ks.submit(account_key(account), deposit(balance))

            async with anyio.create_task_group() as group:
                for account in accounts:
                    group.start_soon(one, account)
        return
    for chunk in _chunks(accounts):
        await bench.set_many({value_key(spec.prefix, n): balance for n in chunk})


async def read_balances(
    bench: BenchServer, spec: RunSpec, accounts: Sequence[int]
) -> dict[int, int]:
    """The committed balance of each account (0 for one never written)."""
    if is_keyserial(spec.system):
        return await _read_keyserial(spec, accounts)
    balances: dict[int, int] = {}
    for chunk in _chunks(accounts):
        values = await bench.get_many([value_key(spec.prefix, n) for n in chunk])
        for account, value in zip(chunk, values, strict=True):
            balances[account] = int(value) if value is not None else 0
    return balances


async def _read_keyserial(spec: RunSpec, accounts: Sequence[int]) -> dict[int, int]:
    balances: dict[int, int] = {}
    async with keyserial.connect(spec.url, shards=spec.shards, namespace=spec.prefix) as ks:
        limiter = anyio.Semaphore(256)

        async def one(account: int) -> None:
            async with limiter:
                balances[account] = int(await ks.read(account_key(account)) or 0)

        async with anyio.create_task_group() as group:
            for account in accounts:
                group.start_soon(one, account)
    return balances


async def settle_keyserial(spec: RunSpec, accounts: Sequence[int], timeout: float) -> None:
    """Queue a ``balance()`` behind every op already appended for ``accounts`` and await it.

    Used when a client gave up on ops (they may still run): afterwards the final state is final.
    """
    connect = keyserial.connect(spec.url, shards=spec.shards, namespace=spec.prefix)
    with anyio.move_on_after(timeout):
        async with connect as ks, anyio.create_task_group() as group:
            for account in accounts:
                group.start_soon(ks.submit, account_key(account), keyserial.call("balance"))


async def probe_keyserial_transfer(spec: RunSpec, timeout: float = 10.0) -> str | None:
    """``None`` if this keyserial runs a transfer across two shards; otherwise why not (an
    older keyserial, or a broken one): the row then says so instead of a number."""
    if not callable(getattr(keyserial.Client, "transfer", None)):
        return "not available: keyserial has no transfer op in this version"
    source, target = account_key(-1), account_key(-2)
    n = 2
    while keyserial.shard_for(target, spec.shards) == keyserial.shard_for(source, spec.shards):
        n += 1
        target = account_key(-n)
    connect = keyserial.connect(spec.url, shards=spec.shards, namespace=spec.prefix)
    try:
        with anyio.fail_after(timeout):
            async with connect as ks:
                await ks.transfer(source, target, 1)
    except keyserial.OperationFailed:
        return None  # it ran (and refused: the probe accounts hold nothing)
    except NotImplementedError as exc:
        return f"not available: {exc}"
    except TimeoutError:
        return f"not available: a cross-shard transfer did not complete in {timeout:g} s"
    except Exception as exc:
        return f"not available: {type(exc).__name__}: {exc}"
    return None


def patterns(spec: RunSpec) -> list[str]:
    """``SCAN MATCH`` patterns covering every key the run may have written."""
    if is_keyserial(spec.system):
        return [f"ks:{{{spec.prefix}:*", f"ks:{{{spec.prefix}}}:*"]
    return [f"{spec.prefix}:*", f"lock:{spec.prefix}:*", f"lock-signal:{spec.prefix}:*"]


async def clean_up(bench: BenchServer, spec: RunSpec) -> int:
    """Delete the run's keys; return how many."""
    return sum([await bench.delete_matching(pattern) for pattern in patterns(spec)])
