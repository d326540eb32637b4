"""How a worker's cross-shard waits end: by the message they wait for, a wake-up, or their
deadline, on one timer that all of the worker's waits share (pure asyncio: the messages' Redis
side is in test_cross_shard.py)."""

from __future__ import annotations

import asyncio

from keyserial._wire.messages import Decision, DecisionNotice
from keyserial._worker.crossshard.mailbox import Mailbox


def mailbox() -> Mailbox:
    return Mailbox("ks:test:worker:waits", lambda shard: None)


def notice(op_id: str = "op-1", attempt: int = 3) -> DecisionNotice:
    return DecisionNotice(op_id, attempt, Decision({}), 0)


async def test_a_wait_ends_with_the_message_handed_over_during_it() -> None:
    box = mailbox()
    loop = asyncio.get_running_loop()
    with box.expect_decision("op-1", 0, 3) as waiter:
        loop.call_later(0.05, box.deliver, notice())
        started = loop.time()
        message = await waiter.within(30)
    assert message == notice()
    assert loop.time() - started < 5  # (not at its deadline)


async def test_a_message_handed_over_before_the_wait_is_returned_at_once() -> None:
    box = mailbox()
    with box.expect_decision("op-1", 0, 3) as waiter:
        box.deliver(notice())
        box.deliver(notice("op-2"))  # (another op's: not this waiter's)
        assert await asyncio.wait_for(waiter.within(30), 5) == notice()


async def test_a_wake_up_without_a_message_ends_the_wait_once() -> None:
    box = mailbox()
    loop = asyncio.get_running_loop()
    with box.expect_decision("op-1", 0, 3) as waiter:
        waiter.wake()  # (before the wait: the first wait ends at once)
        assert await asyncio.wait_for(waiter.within(30), 5) is None
        started = loop.time()
        assert await waiter.within(0.2) is None  # (spent: this one runs to its deadline)
        assert loop.time() - started >= 0.19


async def test_a_wait_ends_at_its_deadline_even_behind_a_later_one() -> None:
    """A wait with an earlier deadline than every wait before it sets the shared timer again:
    it is not left to wait for theirs."""
    box = mailbox()
    loop = asyncio.get_running_loop()
    with box.expect_decision("slow", 0, 1) as slow, box.expect_decision("quick", 0, 1) as quick:
        slow_wait = asyncio.ensure_future(slow.within(30))
        await asyncio.sleep(0)
        started = loop.time()
        assert await asyncio.wait_for(quick.within(0.05), 5) is None
        assert loop.time() - started < 5
        assert not slow_wait.done()
        box.deliver(notice("slow", 1))
        assert await asyncio.wait_for(slow_wait, 5) == notice("slow", 1)


async def test_timed_calls_run_in_deadline_order_and_one_that_raises_stops_no_other() -> None:
    box = mailbox()
    called: list[str] = []
    everything_called = asyncio.get_running_loop().create_future()

    def fails() -> None:
        called.append("fails")
        raise RuntimeError("a timed call that fails")

    def last() -> None:
        called.append("last")
        everything_called.set_result(None)

    box.call_within(0.15, last)
    box.call_within(0.05, fails)
    box.call_within(0.1, lambda: called.append("second"))
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
    await asyncio.wait_for(everything_called, 5)
    assert called == ["fails", "second", "last"]


async def test_a_finished_wait_leaves_no_waiter_behind() -> None:
    box = mailbox()
    with box.expect_decision("op-1", 0, 3) as waiter:
        assert await waiter.within(0.01) is None
    box.deliver(notice())  # (nobody waits: dropped)
    with box.expect_decision("op-1", 0, 3) as again:
        assert again.message is None
