"""G6.2: a reply that never reaches the client (its subscription dropped while the reply was
published) is fetched by the client's sweep for overdue replies; the caller does not resubmit.

Redis drops a subscriber whose pending output passes the pub/sub buffer limit: with a small
limit, a large reply is published into a subscription that is closed at that moment, and the
message is gone. (The client resubscribes; the sweep alone can still find the outcome.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import redis.asyncio

import keyserial
from keyserial import Settings
from keyserial._backend.backend import Backend
from keyserial._client.outcomes import StoredOutcomes
from keyserial._client.pending import Pending
from keyserial._client.sweep import Sweep
from keyserial._scripts.submit import Pushed, SubmitArgs
from keyserial.testing import ShardKeys, running_worker
from tests import apps
from tests.helpers import eventually

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


async def test_a_lost_reply_is_fetched_by_the_client_s_sweep(
    redis_url: str, namespace: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    results = ShardKeys(namespace, 0).results
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
            keyserial.connect(redis_url, shards=1, namespace=namespace, idle_poll=0.2) as ks,
        ):
            assert await ks.submit("k", apps.append("small")) == ["small"]
            subscribed = await _subscribers(client)
            replies: list[Any] = []
            with anyio.fail_after(30):
                async with pubsub_limit(client, "65536"), anyio.create_task_group() as group:

                    async def submit() -> None:
                        replies.append(
                            await ks.submit("k", apps.append(LARGE), op_id="large", timeout=10)
                        )

                    group.start_soon(submit)
                    await eventually(
                        lambda: client.hexists(results, "large"),
                        message="the op committed",
                        interval=0.01,
                    )

                    async def dropped() -> bool:
                        return bool(subscribed - await _subscribers(client))

                    # The reply went into the client's subscription, which Redis then closed.
                    await eventually(
                        dropped, message="the client's subscription dropped", interval=0.01
                    )
                # (The limit is back: replies flow again, but the lost one is never resent.)
            assert replies == [["small", LARGE]]
    finally:
        await client.aclose()


async def _push(backend: Backend, keys: ShardKeys) -> Pushed:
    """Push an entry of no ops to the shard's inbox, as a client does; where it went."""
    [pushed] = await backend.append([(keys, SubmitArgs(0, "1", "[]", ""))])
    assert isinstance(pushed, Pushed), pushed
    return pushed


class _CommitsDuringTheLook:
    """A real backend, except that the op commits (its outcome stored, its entry moved out of
    the inbox and trimmed from the stream) just before the sweep checks whether its entry is
    there: the race the second lookup closes."""

    def __init__(
        self, backend: Backend, client: redis.asyncio.Redis, keys: ShardKeys, op_id: str
    ) -> None:
        self._backend, self._client, self._keys, self._op_id = backend, client, keys, op_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def entries_present(self, keys: ShardKeys, entries: list[Pushed]) -> list[bool]:
        await self._client.hset(self._keys.results, self._op_id, '{"ok": 1}')
        # (Its owner took it out of the inbox, and its stream entry is trimmed: it committed.)
        await self._client.lpop(self._keys.inbox)
        await self._client.incr(self._keys.inbox_taken)
        present: list[bool] = await self._backend.entries_present(keys, entries)
        return present


def _never_called(op_id: str, outcome: object) -> None:
    raise AssertionError(f"op {op_id} settled with {outcome!r} without its record")


async def test_an_op_that_commits_between_the_sweep_s_lookups_is_never_appended_again(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The sweep finds no outcome, then the entry gone: the op may have committed in between
    (an entry leaves the inbox only for the stream, and the stream only once its outcome is
    stored). It looks again before it pushes the op again, and finds the outcome: the op is
    settled, never pushed twice."""
    keys = ShardKeys(namespace, 0)
    loop = asyncio.get_running_loop()
    pending = Pending("op", "k", keys, "{}", loop.create_future(), fresh=True)
    pending.entry = await _push(backend, keys)
    requeued: list[Pending] = []
    racing = _CommitsDuringTheLook(backend, client, keys, "op")
    settings, waiting = Settings(namespace=namespace), {"op": [pending]}
    sweep = Sweep(
        racing,
        settings,
        waiting,
        _never_called,  # type: ignore[arg-type]
        StoredOutcomes(racing, settings, waiting),  # type: ignore[arg-type]
        requeued.extend,
    )
    await sweep._sweep_shard(keys, ["op"])
    assert pending.outcome == {"ok": 1}
    assert requeued == []


async def test_an_op_gone_with_no_outcome_after_result_ttl_fails_and_is_not_appended_again(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Gone with no outcome means lost only while the op's outcome cannot have expired yet: an
    op that waited longer than result_ttl may have applied, and its outcome expired. Pushing
    it again could apply it twice, so its caller gets ``OutcomeUnknown`` instead."""
    keys = ShardKeys(namespace, 0)
    entry = await _push(backend, keys)
    await client.delete(keys.inbox)  # (lost: a failover to a replica that never had it)
    loop = asyncio.get_running_loop()
    young, old = (
        Pending(op_id, "k", keys, "{}", loop.create_future(), fresh=True)
        for op_id in ("young", "old")
    )
    for pending in (young, old):
        pending.entry = entry
    old.since -= 11
    settled: dict[str, Any] = {}
    requeued: list[Pending] = []
    settings = Settings(namespace=namespace, result_ttl=10)
    waiting = {"young": [young], "old": [old]}
    sweep = Sweep(
        backend,
        settings,
        waiting,
        settled.__setitem__,
        StoredOutcomes(backend, settings, waiting),
        requeued.extend,
    )
    await sweep._sweep_shard(keys, ["young", "old"])
    assert requeued == [young]
    assert list(settled) == ["old"]
    assert isinstance(settled["old"], keyserial.OutcomeUnknown)
    assert "may or may not have applied" in str(settled["old"])
