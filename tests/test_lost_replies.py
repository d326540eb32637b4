"""G6.2: a reply that never reaches the client (its subscription dropped while the reply was
published) is fetched by the client's sweep for overdue replies; the caller does not resubmit.

Redis drops a subscriber whose pending output passes the pub/sub buffer limit: with a small
limit, a large reply is published into a subscription that is closed at that moment, and the
message is gone. (The client resubscribes; the sweep alone can still find the outcome.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import redis.asyncio

import keyserial
from keyserial.testing import ShardKeys, running_worker
from tests import apps

LARGE = "x" * 200_000


@asynccontextmanager
async def pubsub_limit(client: Any, limit: str) -> AsyncIterator[None]:
    """The server's pub/sub output limit set to ``limit`` bytes for the block."""
    before = (await client.config_get("client-output-buffer-limit"))["client-output-buffer-limit"]
    await client.config_set("client-output-buffer-limit", f"pubsub {limit} {limit} 0")
    try:
        yield
    finally:
        await client.config_set("client-output-buffer-limit", before)


async def _subscribers(client: Any) -> set[str]:
    """The ids of the server's pub/sub connections."""
    listed = await client.execute_command("CLIENT", "LIST", "TYPE", "pubsub")
    text = listed.decode() if isinstance(listed, bytes) else str(listed)
    return {line.split()[0] for line in text.splitlines() if line.startswith("id=")}


async def _until(check: Callable[[], Awaitable[Any]], message: str) -> None:
    with anyio.move_on_after(10):
        while not await check():
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"{message}: not within 10 s")


async def test_a_lost_reply_is_fetched_by_the_client_s_sweep(
    redis_url: str, namespace: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    results = ShardKeys(namespace, 0).results
    try:
        async with running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]), \
                keyserial.connect(redis_url, shards=1, namespace=namespace,
                                  idle_poll=0.2) as ks:
            assert await ks.submit("k", apps.append("small")) == ["small"]
            subscribed = await _subscribers(client)
            replies: list[Any] = []
            with anyio.fail_after(30):
                async with pubsub_limit(client, "65536"), anyio.create_task_group() as group:

                    async def submit() -> None:
                        replies.append(await ks.submit(
                            "k", apps.append(LARGE), op_id="large", timeout=20))

                    group.start_soon(submit)
                    await _until(lambda: client.hexists(results, "large"), "the op committed")

                    async def dropped() -> bool:
                        return bool(subscribed - await _subscribers(client))

                    # The reply went into the client's subscription, which Redis then closed.
                    await _until(dropped, "the client's subscription dropped")
                # (The limit is back: replies flow again, but the lost one is never resent.)
            assert replies == [["small", LARGE]]
    finally:
        await client.aclose()
