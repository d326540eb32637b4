"""An asyncio port of python-redis-lock 4.0.1 (``redis_lock.Lock``): a notification lock.

The algorithm, unchanged: acquire checks that this instance does not hold the lock (``GET``),
then tries ``SET lock:<name> <id> NX [EX expire]``; while that fails, the waiter blocks in
``BLPOP lock-signal:<name>`` (timeout: the acquire timeout, else ``expire``, else forever) and
tries again when woken. Release runs the library's unlock script, verbatim: if the lock is still
ours, delete the signal list, ``LPUSH`` one wake-up, ``PEXPIRE`` the signal list (1 s by
default), delete the lock. Key names, ids and scripts match the library, so this port and the
library interoperate on one lock (``tests/project/test_bench.py`` checks both directions, and
the two together against overlap).

Why a port: the library is synchronous. The benchmark's callers are asyncio tasks, like every
other system's, sharing one client process and one connection pool; a sync lock would need a
thread per caller, and the figure would measure thread switching under the GIL as much as the
lock. Not ported: ``auto_renewal`` (a thread that extends the TTL; off by default), ``extend``,
``reset`` and ``reset_all``, which the benchmark does not use.
"""

from __future__ import annotations

import hashlib
from base64 import b64encode
from os import urandom
from types import TracebackType
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

#: Verbatim from redis_lock 4.0.1.
UNLOCK_SCRIPT = b"""
    if redis.call("get", KEYS[1]) ~= ARGV[1] then
        return 1
    else
        redis.call("del", KEYS[2])
        redis.call("lpush", KEYS[2], 1)
        redis.call("pexpire", KEYS[2], ARGV[2])
        redis.call("del", KEYS[1])
        return 0
    end
"""
_UNLOCK_SHA = hashlib.sha1(UNLOCK_SCRIPT).hexdigest()


class AlreadyAcquired(RuntimeError):
    pass


class NotAcquired(RuntimeError):
    pass


class NotifyLock:
    """``redis_lock.Lock(redis_client, name, expire=None, id=None, signal_expire=1000)``.

    (``id`` is spelled ``lock_id`` here.)
    """

    def __init__(
        self,
        redis_client: Redis,
        name: str,
        expire: int | None = None,
        lock_id: str | None = None,
        signal_expire: int = 1000,
    ) -> None:
        self._client = redis_client
        if expire:
            expire = int(expire)
            if expire < 0:
                raise ValueError("A negative expire is not acceptable.")
        else:
            expire = None
        self._expire = expire
        self._signal_expire = signal_expire
        self._id = b64encode(urandom(18)).decode("ascii") if lock_id is None else lock_id
        self._name = "lock:" + name
        self._signal = "lock-signal:" + name

    @property
    def id(self) -> str:
        return self._id

    async def get_owner_id(self) -> str | None:
        owner = await self._client.get(self._name)
        if isinstance(owner, bytes):
            return owner.decode("ascii", "replace")
        return owner  # type: ignore[no-any-return]

    async def acquire(self, blocking: bool = True, timeout: int | None = None) -> bool:
        if await self.get_owner_id() == self._id:
            raise AlreadyAcquired("Already acquired from this Lock instance.")
        if not blocking and timeout is not None:
            raise ValueError("Timeout cannot be used if blocking=False")
        if timeout:
            timeout = int(timeout)
        busy = True
        blpop_timeout = timeout or self._expire or 0
        timed_out: Any = False
        while busy:
            busy = not await self._client.set(self._name, self._id, nx=True, ex=self._expire)
            if busy:
                if timed_out:
                    return False
                if not blocking:
                    return False
                woken = await self._client.blpop([self._signal], blpop_timeout)  # type: ignore[misc]
                timed_out = not woken and timeout
        return True

    async def release(self) -> None:
        # What the library's registered script does: EVALSHA, loading the script if missing.
        args = (self._name, self._signal, self._id, self._signal_expire)
        try:
            error = await self._client.evalsha(_UNLOCK_SHA, 2, *args)  # type: ignore[misc]
        except NoScriptError:
            await self._client.script_load(UNLOCK_SCRIPT)
            error = await self._client.evalsha(_UNLOCK_SHA, 2, *args)  # type: ignore[misc]
        if error == 1:
            raise NotAcquired(f"Lock({self._name}) is not acquired or it already expired.")
        if error:
            raise RuntimeError(f"Unsupported error code {error} from the unlock script.")

    async def __aenter__(self) -> NotifyLock:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
