"""Submits' timeouts: one timer per slice of time (``keyserial._client.pending.Deadlines``),
never firing before a submit's timeout, and holding nothing of a submit settled first."""

from __future__ import annotations

import asyncio
import time

import pytest

import keyserial
from keyserial import SubmitTimeout
from keyserial._client.pending import DEADLINE_SLICE, Deadlines, Pending
from keyserial.ledger import deposit
from keyserial.testing import running_worker


class _Recorded:
    """Stands in for a pending submit: records when it was expired, by the loop's clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.expired_at: float | None = None

    def expire(self) -> None:
        assert self.expired_at is None, "expired twice"
        self.expired_at = self._loop.time()


async def test_a_deadline_never_fires_early_and_a_discarded_one_never_fires() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    started = loop.time()
    timeouts = (0.001, 0.03, 0.05, 0.051)
    kept = [_Recorded(loop) for _ in timeouts]
    dropped = _Recorded(loop)
    for pending, seconds in zip(kept, timeouts, strict=True):
        deadlines.add(pending, seconds)  # type: ignore[arg-type]
    deadlines.discard(dropped, deadlines.add(dropped, 0.03))  # type: ignore[arg-type]
    await asyncio.sleep(0.051 + 3 * DEADLINE_SLICE)
    for pending, seconds in zip(kept, timeouts, strict=True):
        assert pending.expired_at is not None
        assert pending.expired_at >= started + seconds
    assert dropped.expired_at is None
    assert len(deadlines) == 0


async def test_a_submit_times_out_after_its_timeout_and_settled_ones_leave_no_deadline(
    redis_url: str, namespace: str
) -> None:
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:
        began = time.monotonic()
        with pytest.raises(SubmitTimeout):  # (no worker yet)
            await ks.submit("account:1", deposit(1), timeout=0.3)
        assert 0.3 <= time.monotonic() - began < 0.3 + 2.0
        async with running_worker(redis_url, namespace, shard_count=2):
            for n in range(20):
                await ks.submit(f"account:{n}", deposit(1), timeout=30)
        deadlines = ks._deadlines  # type: ignore[attr-defined]
        assert isinstance(deadlines, Deadlines) and len(deadlines) == 0


def test_a_pending_submit_is_its_own_member_of_a_slice() -> None:
    """Deadlines keeps submits in sets: two submits of equal fields are two members."""
    assert Pending.__hash__ is object.__hash__
