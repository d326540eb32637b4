"""The systems under test, client side: each as its users run it, one op at a time per caller.

Every system offers the same three ops, each returning once the op is acknowledged:

* ``deposit(account)`` — balance + 1;
* ``slow_deposit(account)`` — read, wait ``slow_io`` seconds on I/O holding the key, write;
* ``transfer(source, target)`` — move 1 from one account to another, both held.

A client process opens one system for its C callers: keyserial shares one client (it coalesces
submits); the Redis-based systems share one ``redis.asyncio`` client whose pool has C
connections (as many as the callers, so no caller waits for a connection).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, Protocol

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

import keyserial
from keyserial.ledger import deposit

from .config import THREAD, RunSpec, is_keyserial
from .notifylock import NotifyLock
from .ops import deposit_in_thread, slow_deposit, transfer_in_thread
from .state import lock_key, value_key
from .workloads import account_key

#: The Lua systems' scripts: the same read-modify-write, run inside Redis.
LUA_DEPOSIT = """
local balance = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(ARGV[1])
redis.call('SET', KEYS[1], balance)
return balance
"""
LUA_TRANSFER = """
local source = tonumber(redis.call('GET', KEYS[1]) or '0') - tonumber(ARGV[1])
local target = tonumber(redis.call('GET', KEYS[2]) or '0') + tonumber(ARGV[1])
redis.call('SET', KEYS[1], source)
redis.call('SET', KEYS[2], target)
return source
"""


class Unavailable(Exception):
    """The system cannot run this op (Lua cannot wait on I/O; keyserial has no transfer yet)."""


class System(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def deposit(self, account: int) -> None: ...

    async def slow_deposit(self, account: int) -> None: ...

    async def transfer(self, source: int, target: int) -> None: ...


def unavailable_reason(system: str, op: str, *, cluster: bool = False) -> str | None:
    """Why ``system`` cannot run ``op`` (``None``: it can); such a cell gets no number.

    keyserial's transfer is probed at run time instead (:func:`state.probe_keyserial_transfer`).
    """
    if system == "lua" and op == "slow":
        return "n/a: a Lua script cannot wait on I/O while it holds the key"
    if cluster and system == "lua" and op == "transfer":
        return "n/a on a cluster: one script cannot touch two accounts in different hash slots"
    if cluster and system == "lock-notify":
        return (
            "n/a on a cluster: python-redis-lock's release script touches its lock and signal"
            " keys, which hash to different slots"
        )
    return None


class KeyserialSystem:
    """``keyserial.connect`` once per client process; ``submit`` per op (``keyserial-durable``:
    with ``durable_replicas=1``, so a stored result counts only once a replica has it;
    ``keyserial-thread``: the same deposit and transfer as plain sync ops of ``benchmarks.ops``,
    run in a worker thread, instead of the ledger's, declared inline)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self._stack = AsyncExitStack()
        self._ks: keyserial.Client | None = None

    async def open(self) -> None:
        self._ks = await self._stack.enter_async_context(
            keyserial.connect(
                self.spec.url,
                shards=self.spec.shards,
                namespace=self.spec.prefix,
                durable_replicas=self.spec.durable_replicas,
            )
        )

    async def close(self) -> None:
        await self._stack.aclose()

    @property
    def ks(self) -> keyserial.Client:
        assert self._ks is not None, "open() first"
        return self._ks

    async def deposit(self, account: int) -> None:
        if self.spec.system == THREAD:
            await self.ks.submit(account_key(account), deposit_in_thread(1))
            return
        await self.ks.submit(account_key(account), deposit(1))

    async def slow_deposit(self, account: int) -> None:
        await self.ks.submit(account_key(account), slow_deposit(1, self.spec.slow_io))

    async def transfer(self, source: int, target: int) -> None:
        if self.spec.system == THREAD:
            keys = [account_key(source), account_key(target)]
            await self.ks.submit_many(keys, transfer_in_thread(1))
            return
        transfer: Any = getattr(self.ks, "transfer", None)
        if transfer is None:
            raise Unavailable("keyserial has no transfer op yet")
        await transfer(account_key(source), account_key(target), 1)


class _RedisSystem:
    """A ``redis.asyncio`` client with one pooled connection per caller."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        #: On a cluster, a cluster client (its pool: as many connections per node).
        self.redis: Redis | RedisCluster = (RedisCluster if spec.cluster else Redis).from_url(
            spec.url, max_connections=spec.callers
        )

    async def open(self) -> None:
        await self.redis.ping()  # type: ignore[misc]

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, account: int) -> str:
        return value_key(self.spec.prefix, account)

    async def _read_modify_write(self, account: int, amount: int, io: float = 0.0) -> None:
        key = self.key(account)
        balance = int(await self.redis.get(key) or 0)
        if io:
            await anyio.sleep(io)
        await self.redis.set(key, balance + amount)

    async def _move(self, source: int, target: int) -> None:
        keys = [self.key(source), self.key(target)]
        if isinstance(self.redis, RedisCluster):  # (slots differ: a command per node)
            first, second = await self.redis.mget_nonatomic(keys)
            moved = {keys[0]: int(first or 0) - 1, keys[1]: int(second or 0) + 1}
            await self.redis.mset_nonatomic(moved)
            return
        first, second = await self.redis.mget(keys)
        await self.redis.mset({keys[0]: int(first or 0) - 1, keys[1]: int(second or 0) + 1})


class NoLockSystem(_RedisSystem):
    """Read, modify, write with nothing in between: it loses updates, which is the point."""

    async def deposit(self, account: int) -> None:
        await self._read_modify_write(account, 1)

    async def slow_deposit(self, account: int) -> None:
        await self._read_modify_write(account, 1, self.spec.slow_io)

    async def transfer(self, source: int, target: int) -> None:
        await self._move(source, target)


class RedisLockSystem(_RedisSystem):
    """redis-py's ``Lock``: a fresh one per op (its token lives in a thread-local, so a Lock
    shared by asyncio tasks would hand one task's token to another); ``timeout`` and ``sleep``
    are the library's defaults (``None``, 0.1 s) unless the spec tunes them."""

    def _lock(self, account: int) -> Any:
        return self.redis.lock(
            lock_key(self.spec.prefix, account),
            timeout=self.spec.lock_timeout,
            sleep=self.spec.lock_sleep,
        )

    async def deposit(self, account: int) -> None:
        async with self._lock(account):
            await self._read_modify_write(account, 1)

    async def slow_deposit(self, account: int) -> None:
        async with self._lock(account):
            await self._read_modify_write(account, 1, self.spec.slow_io)

    async def transfer(self, source: int, target: int) -> None:
        low, high = sorted((source, target), key=lambda n: lock_key(self.spec.prefix, n))
        async with self._lock(low), self._lock(high):
            await self._move(source, target)


class NotifyLockSystem(_RedisSystem):
    """The python-redis-lock algorithm with the library's defaults (no expiry, signal 1 s)."""

    def _lock(self, account: int) -> NotifyLock:
        assert isinstance(self.redis, Redis), "not run on a cluster (unavailable_reason)"
        return NotifyLock(self.redis, self.key(account))

    async def deposit(self, account: int) -> None:
        async with self._lock(account):
            await self._read_modify_write(account, 1)

    async def slow_deposit(self, account: int) -> None:
        async with self._lock(account):
            await self._read_modify_write(account, 1, self.spec.slow_io)

    async def transfer(self, source: int, target: int) -> None:
        low, high = sorted((source, target), key=self.key)
        async with self._lock(low), self._lock(high):
            await self._move(source, target)


class LuaSystem(_RedisSystem):
    """The update as one script inside Redis: the ceiling for an op Lua can express."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec)
        # (redis-py's stubs type register_script for Redis; a cluster client routes it by key.)
        self._deposit = self.redis.register_script(LUA_DEPOSIT)  # type: ignore[misc]
        self._transfer = self.redis.register_script(LUA_TRANSFER)  # type: ignore[misc]

    async def deposit(self, account: int) -> None:
        await self._deposit(keys=[self.key(account)], args=[1])

    async def slow_deposit(self, account: int) -> None:
        raise Unavailable("a Lua script cannot wait on I/O")

    async def transfer(self, source: int, target: int) -> None:
        await self._transfer(keys=[self.key(source), self.key(target)], args=[1])


def make_system(spec: RunSpec) -> System:
    if is_keyserial(spec.system):
        return KeyserialSystem(spec)
    if spec.system in ("lock-default", "lock-tuned"):
        return RedisLockSystem(spec)
    if spec.system == "lock-notify":
        return NotifyLockSystem(spec)
    if spec.system == "no-lock":
        return NoLockSystem(spec)
    if spec.system == "lua":
        return LuaSystem(spec)
    raise ValueError(f"unknown system {spec.system!r}")
