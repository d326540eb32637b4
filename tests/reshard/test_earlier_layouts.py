"""What an owner looks up in the layouts before a reshard (``_worker.draining.EarlierLayouts``)
before it runs the ops of a batch."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio

from keyserial._backend.backend import Backend
from keyserial._scripts.commit import StepReply
from keyserial._wire.layout import Layout
from keyserial._wire.routing import home_shard
from keyserial._worker.draining import EarlierLayouts

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


def _entry(op_id: str, key: str) -> dict[bytes, bytes]:
    ops = [{"id": op_id, "key": key, "op": "append", "args": [1]}]
    return {b"v": b"1", b"ops": json.dumps(ops).encode()}


async def _once(attempt: Callable[[], Awaitable[Any]]) -> Any:
    return await attempt()


async def test_an_op_id_appended_again_with_other_keys_is_answered_from_an_earlier_layout(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A client user may append an op's id again with keys of its choosing, fetched in one
    batch with a genuine copy (a stale client's, forwarded after the reshard): each copy is
    looked up at its own keys' home in the layouts before. Looked up by the last copy's keys
    alone, the op's outcome was missed, the genuine copy ran again, the step refused its
    outcome as a replay, and the owner started again with the same batch, for ever."""
    old = Layout(namespace, 9)
    genuine = "lst:6"
    other = next(
        f"acct:{n}" for n in range(100) if home_shard([f"acct:{n}"], 9) != home_shard([genuine], 9)
    )
    await client.hset(old.keys(home_shard([genuine], 9)).results, "x", '{"ok":[1]}')
    earlier = EarlierLayouts(
        [(old, int(time.time() * 1000))], backend, retrying=_once, result_ttl_ms=3_600_000
    )
    for order in ([genuine, other], [other, genuine]):
        fetched = StepReply([(f"1-{n}", _entry("x", key)) for n, key in enumerate(order)], {}, {})
        await earlier.answer(fetched, replaying=True)
        assert fetched.done == {"x": '{"ok":[1]}'}, order
