"""Who owns which shard, and what a former owner's fenced scripts did, read from Redis: for the
tests that kill, freeze and restart workers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio

from keyserial.testing import ShardKeys
from tests.helpers import eventually

#: The shard count of the fault tests' namespaces.
SHARDS = 4


@asynccontextmanager
async def inspector(url: str) -> AsyncIterator[Any]:
    """A plain async Redis client for looking at a namespace's keys (lease, state, dead letters)."""
    client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
    try:
        yield client
    finally:
        await client.aclose()


async def holder_pid(client: Any, namespace: str, shard: int) -> int | None:
    """Pid of the worker holding the shard's lease; None if nobody does (or Redis is down)."""
    try:
        value = await client.get(ShardKeys(namespace, shard).lease)
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return None
    return int(value.decode().split(":")[1]) if value else None


async def holders(client: Any, namespace: str) -> list[int | None]:
    return [await holder_pid(client, namespace, shard) for shard in range(SHARDS)]


async def wait_for_holder(
    client: Any,
    namespace: str,
    pid: int,
    *,
    shards: range | list[int] = range(SHARDS),
    timeout: float = 10,
) -> float:
    """Wait until ``pid`` holds every one of ``shards``; return the time it took."""
    started = time.monotonic()

    async def held() -> bool:
        return [await holder_pid(client, namespace, s) for s in shards] == [pid] * len(shards)

    await eventually(
        held, timeout=timeout, interval=0.01, message=f"worker {pid} holding shards {shards}"
    )
    return time.monotonic() - started


async def all_held(client: Any, namespace: str) -> list[int]:
    """Wait until every shard has a lease holder; return their pids."""

    async def every_shard_held() -> list[int] | None:
        current = await holders(client, namespace)
        return None if None in current else [pid for pid in current if pid is not None]

    pids: list[int] = await eventually(every_shard_held, timeout=15, message="every shard held")
    return pids


def stale_calls(commands: list[str], epoch_key: str, epoch: str) -> list[list[str]]:
    """The script calls among MONITOR lines made with ``epoch`` on the shard of ``epoch_key``
    (the fenced scripts take the epoch key first and the caller's epoch as first argument)."""
    calls = []
    for command in commands:
        words = command.split(" ")
        if len(words) > 3 and words[0].upper() in ("EVALSHA", "EVAL") and words[3] == epoch_key:
            count = int(words[2])
            if len(words) > 3 + count and words[3 + count] == epoch:
                calls.append(words)
    return calls


async def fenced_errors(client: Any) -> int:
    """How many scripts Redis has refused with FENCED since it started."""
    stats = await client.info("errorstats")
    return int(stats.get("errorstat_FENCED", {}).get("count", 0))


async def stream_empty(client: Any, shard: ShardKeys) -> bool:
    """Every entry of the shard trimmed: a new owner's replay fetches none."""
    return bool(await client.xlen(shard.stream) == 0)


async def takes_pushes(client: Any, shard: ShardKeys) -> bool:
    """The shard's owner has recorded that it takes pushed entries (its epoch is the one the
    pushes record names): its next fresh entries come in their wake-ups, not in a fetch."""
    epoch, pushes = await client.mget(shard.epoch, shard.pushes)
    return epoch is not None and epoch == pushes
