"""A zombie's cross-shard writes reach Redis and are refused by the fence (G5.3).

The zombie tests of test_cross_shard_faults.py check that nothing changes, but a zombie's late
write would often carry the very values its successor wrote. These tests prove the write was
sent: they hold Redis's writes for a moment (CLIENT PAUSE WRITE) while the frozen worker
resumes, so its pending script leaves before it can notice that it lost the lease, record what
arrives with MONITOR, and check that each script sent under the stale epoch was refused with
FENCED (Redis's error counter) and that the op still ended applied exactly once.

The zombie is frozen by its own op, which blocks the worker's event loop until a gate file
exists (``apps.hold_then_freeze``, ``apps.pay_frozen``), not by SIGSTOP: after SIGCONT, a
wake-up that arrived meanwhile (a pushed entry that does not follow on) could send a step
ahead of the one carrying the op's write, and that step's refusal ends the runner first.
Resumed from inside the op, the op's write is in the runner's first step.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from keyserial.testing import ShardKeys
from tests import apps
from tests.cross_shard_bank import (
    SHARDS,
    B,
    Bank,
    bank,
    check_after_fault,
    lost_its_shard,
    standby_took,
)
from tests.helpers import Starter, WorkerProcess, eventually, keys_on_shard, noted, wait_for_log
from tests.ownership import fenced_errors, stale_calls

# Workers frozen past their leases.
pytestmark = pytest.mark.slow


async def _resume_under_paused_writes(
    b: Bank, zombie: WorkerProcess, gate: Path, shard: int, epoch: str, script_marker: str
) -> list[list[str]]:
    """Resume ``zombie`` (open its op's ``gate``) while Redis holds writes; once a stale call
    naming ``script_marker`` has reached Redis and the zombie has given the shard up, return
    every call it sent to ``shard`` under its old epoch (each one a fenced script that must be
    refused)."""
    epoch_key = ShardKeys(b.namespace, shard).epoch
    commands: list[str] = []
    monitor = b.redis.__class__.from_url(b.url)
    try:
        async with anyio.create_task_group() as group:
            started = anyio.Event()

            async def feed() -> None:
                async with monitor.monitor() as lines:
                    started.set()
                    while True:
                        commands.append((await lines.next_command())["command"])

            group.start_soon(feed)
            await started.wait()
            await b.redis.execute_command("CLIENT", "PAUSE", 500, "WRITE")
            gate.touch()  # noqa: ASYNC240
            await eventually(
                lambda: [
                    call
                    for call in stale_calls(commands, epoch_key, epoch)
                    if any(script_marker in word for word in call)
                ],
                timeout=10,
                message=f"the zombie's stale {script_marker} reaching Redis",
            )
            await lost_its_shard(zombie, shard)
            group.cancel_scope.cancel()
    finally:
        await monitor.aclose()
    return stale_calls(commands, epoch_key, epoch)


async def _meet(b: Bank) -> None:
    """A transfer between two other accounts of shards 0 and 1: B's owner meets the signer of
    the coordinator's worker, and then takes its grant requests as they come (one from a worker
    not met yet is dropped until asked again, a poll later)."""
    first, second = (keys_on_shard(shard, SHARDS, 2, "acct")[1] for shard in (0, 1))
    await b.ks.submit_many([first, second], apps.slow_move(0), op_id="meet", timeout=10)


async def _epoch(b: Bank, shard: int) -> str:
    value: Any = await b.redis.get(ShardKeys(b.namespace, shard).epoch)
    return str(value.decode())


async def test_a_zombie_coordinator_s_decision_reaches_redis_and_is_refused(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """Frozen while the op holds every key, the coordinator's successor finishes the op; the
    resumed zombie sends its decision under its old epoch, and Redis refuses it."""
    gate = tmp_path / "gate"
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        stale_epoch = await _epoch(b, 0)
        group.start_soon(b.submit_payment, apps.pay_frozen(10, str(gate), str(b.note)))
        await eventually(lambda: noted(b.note), message="the op running with every key held")
        fault_at = b.fault(group)  # (its worker is frozen from now on)
        await standby_took(b, 0)
        await eventually(
            lambda: b.recorded(0, "victim"),
            message="the standby finished the op",
            timeout=15,
            interval=0.005,
        )
        fenced_before = await fenced_errors(b.redis)
        # The decision names the op's attempt field, "victim#<epoch>#d" is not in the call,
        # but the op id is: the zombie's decide is the stale call carrying "victim".
        stale = await _resume_under_paused_writes(b, b.w0, gate, 0, stale_epoch, "victim")
        # Every one of them was refused, the decision (or grant) included.
        assert await fenced_errors(b.redis) - fenced_before >= len(stale) >= 1
        await check_after_fault(b, fault_at)


async def test_a_zombie_participant_s_commit_reaches_redis_and_is_refused(
    redis_url: str, namespace: str, start: Starter, tmp_path: Path
) -> None:
    """B's owner has the payment's grant request waiting behind an earlier op on B when it
    freezes; its successor grants and the op completes. Resumed, the zombie finishes the
    earlier op and commits its outcome under its old epoch (its grant of B, if it gets that far,
    rides the same step or the next): Redis refuses every such step, and the zombie gives the
    shard up."""
    held, freeze, gate = tmp_path / "held", tmp_path / "freeze", tmp_path / "gate"
    async with bank(redis_url, namespace, start, tmp_path) as b, anyio.create_task_group() as group:
        stale_epoch = await _epoch(b, 1)
        await _meet(b)
        busy = apps.hold_then_freeze(str(freeze), str(gate), str(held))
        group.start_soon(partial(b.ks.submit, B, busy, op_id="busy-on-b"))
        await eventually(held.exists, message="B busy on its owner")
        group.start_soon(b.pay, 0)
        await wait_for_log(  # (its request sent to B's owner, and no grant yet)
            b.w0, "no grant of shard 1 for victim#1 yet; asking its owner again", timeout=15
        )
        assert not await b.holds(1, "victim#0.1"), "B is still busy: no grant yet"
        freeze.touch()  # (B's owner blocks in the op; the standby's replay of it ends at once)
        fault_at = b.fault(group)
        await standby_took(b, 1)
        await eventually(
            lambda: b.applied(B),
            message="the standby granted and applied B's part",
            timeout=15,
            interval=0.005,
        )
        fenced_before = await fenced_errors(b.redis)
        stale = await _resume_under_paused_writes(b, b.w1, gate, 1, stale_epoch, "busy-on-b")
        # Every one of them was refused, the step carrying the grant (if it left) included.
        assert await fenced_errors(b.redis) - fenced_before >= len(stale) >= 1
        await check_after_fault(b, fault_at)
