"""The nemesis's short and cluster profiles on fixed seeds: randomized faults, then every
checker.

Each seed starts its own durable Redis, three worker processes and two clients behind fault
proxies (see ``tests/nemesis``); a cluster seed, its own 3-master / 3-replica cluster instead.
Seeds known to fail are listed in ``tests/nemesis/seeds.py`` with their cause and stay out of
these lists until fixed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.exceptions

import keyserial
from keyserial.testing import LocalServer, ShardKeys, free_port, running_worker
from tests import apps
from tests.nemesis.checkers import (
    Observed,
    check_appended_were_applied,
    check_epochs,
    check_refusals,
    check_timers,
)
from tests.nemesis.runner import _stored, lost_by_failovers, run_seed
from tests.nemesis.schedule import PROFILES, make_plan
from tests.nemesis.seeds import (
    CI_HOSTILE_REGRESSIONS,
    CI_REGRESSIONS,
    CLUSTER_SEEDS,
    DEFAULT_SEEDS,
    KNOWN_FAILING,
    REGRESSIONS,
    TAKEOVER_SEEDS,
)
from tests.nemesis.tap import Appended, StreamTap, direct_client
from tests.nemesis.timers import TimerHistory, TimerObserved, TimerRecord
from tests.nemesis.workloads import History, OpRecord


@pytest.mark.slow
@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
async def test_a_short_nemesis_run_finds_no_violation(seed: int, tmp_path: Path) -> None:
    report = await run_seed(seed, PROFILES["short"], tmp_path)
    assert report.stats["faults"] >= 1, (
        f"no fault was injected in full: {report.injected}; checks: {report.describe()}"
    )
    assert report.ok, report.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed", CLUSTER_SEEDS)
async def test_a_cluster_nemesis_run_finds_no_violation(seed: int, tmp_path: Path) -> None:
    """The cluster profile: 3 masters with a replica each, masters killed or paused past their
    failover, workers whose clock is off by minutes (about 25 s a seed)."""
    report = await run_seed(seed, PROFILES["cluster"], tmp_path)
    assert report.stats["faults"] >= 1, (
        f"no fault was injected in full: {report.injected}; checks: {report.describe()}"
    )
    assert report.ok, report.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed", TAKEOVER_SEEDS)
async def test_a_takeover_nemesis_run_finds_no_violation(seed: int, tmp_path: Path) -> None:
    """The takeover profile: masters lost ahead of their replica, which takes over within the
    owners' 6 s leases (about 25 s a seed)."""
    report = await run_seed(seed, PROFILES["takeover"], tmp_path)
    assert report.stats["faults"] >= 1, (
        f"no fault was injected in full: {report.injected}; checks: {report.describe()}"
    )
    assert report.ok, report.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed", CI_REGRESSIONS)
async def test_a_seed_that_once_found_a_defect_finds_none(seed: int, tmp_path: Path) -> None:
    """Each of these seeds once broke a guarantee (see ``REGRESSIONS`` for which)."""
    report = await run_seed(seed, PROFILES["short"], tmp_path)
    assert report.ok, report.describe()


@pytest.mark.slow
@pytest.mark.parametrize("seed", CI_HOSTILE_REGRESSIONS)
async def test_a_byzantine_client_run_that_once_found_a_defect_finds_none(
    seed: int, tmp_path: Path
) -> None:
    """The short profile with a client forging pushes, grants and decision notices as the
    documented client ACL user (``tests/nemesis/hostile.py``)."""
    report = await run_seed(seed, PROFILES["hostile"], tmp_path)
    assert any("forged messages published" in line for line in report.injected), (
        f"the forger published nothing: {report.injected}"
    )
    assert report.ok, report.describe()


def test_a_seed_always_draws_the_same_schedule() -> None:
    known = (*KNOWN_FAILING, *REGRESSIONS)
    assert set(CI_REGRESSIONS) <= {each.seed for each in REGRESSIONS if each.profile == "short"}
    assert set(CI_HOSTILE_REGRESSIONS) <= {
        each.seed for each in REGRESSIONS if each.profile == "hostile"
    }
    for seed in (*DEFAULT_SEEDS, *(each.seed for each in known)):
        for profile in PROFILES.values():
            plan = make_plan(seed, profile)
            assert plan == make_plan(seed, profile)
            fewest, most = (
                sum(bounds)
                for bounds in zip(
                    profile.faults,
                    profile.edge_faults,
                    profile.hostile_faults,
                    profile.reshard_faults,
                    profile.commit_kills,
                    strict=True,
                )
            )
            fixed = len(profile.reshard_path)
            assert fewest + fixed <= len(plan.events) <= most + fixed
            served = {shard for layout in plan.layouts for shard in layout}
            assert served == set(range(profile.shard_count)), "a shard no worker serves"


def test_the_epochs_checker_flags_one_epoch_handed_to_two_owners() -> None:
    """Read off the workers' own log lines: an epoch acquired once per shard passes; the same
    shard and epoch acquired again, by another worker or the same one, is flagged."""
    line = "2026-11-24 21:06:0{} INFO keyserial.worker: shard {}: acquired (epoch {})\n"
    logs = {
        "worker-0.log": line.format(0, 2, 1) + line.format(4, 2, 2) + line.format(5, 3, 2),
        "worker-1.log": line.format(1, 3, 1) + line.format(6, 3, 3),
    }
    assert check_epochs(logs) == []
    logs["worker-1.log"] += line.format(8, 2, 2)
    (violation,) = check_epochs(logs)
    assert violation.evidence == {
        "shard": "2",
        "epoch": 2,
        "owners": ["worker-0.log at 2026-11-24 21:06:04", "worker-1.log at 2026-11-24 21:06:08"],
    }
    # After a reshard, shard 2 of layout generation 1 counts its epochs from 1 again.
    logs["worker-1.log"] += line.format(9, "2@1", 1) + line.format(9, "2@1", 2)
    assert len(check_epochs(logs)) == 1


def test_an_append_a_failover_lost_after_its_caller_gave_up_is_not_a_dropped_op() -> None:
    """Seed 4159 (cluster): an entry appended to a master just before it was stopped, never
    replicated, lost at the promotion 3 s later, 0.2 s before its caller's timeout. The client
    appends a lost entry again only while its submit waits (docs/guarantees.md, Durability):
    that op is not flagged. The same loss with the caller still waiting well past it, an entry
    still in the stream, or no failover of that shard, is."""
    record = OpRecord("t1", "list", ("lst:1",), True, "t1", via="timeout", started=100.0)
    record.ended = 108.0
    seen = Appended("t1", "t1", ("lst:1",), 2, "ks:{ns:2}:stream", ["1795815242300-0"])

    def flagged(**changes: Any) -> bool:
        observed = Observed(
            History([record]),
            {},
            {"t1": seen},
            {},
            gone=changes.get("gone", frozenset({"t1"})),
            promotions=changes.get("promotions", {2: [107.8]}),
        )
        return bool(check_appended_were_applied(observed))

    assert not flagged()
    (let_off,) = lost_by_failovers(
        Observed(
            History([record]), {}, {"t1": seen}, {}, gone=frozenset({"t1"}), promotions={2: [107.8]}
        )
    )["lost-by-a-failover-after-the-caller-gave-up"]
    assert let_off.startswith("t1 (shard 2, timeout at t=108.00s"), let_off
    assert not flagged(promotions={2: [109.0]})  # (lost after the caller gave up)
    assert flagged(promotions={2: [101.0]})  # the client had 7 s to append it again
    assert flagged(promotions={1: [107.8]})  # another shard's master
    assert flagged(promotions={2: [99.0]})  # before the op was submitted
    assert flagged(gone=frozenset())  # an entry is still there: a worker skipped it
    record.via = "reply"
    assert not flagged()  # (answered: other checkers judge it)


def test_the_refusals_checker_flags_an_op_answered_as_misrouted() -> None:
    """The load submits no malformed or misrouted op: an op of it answered with
    ``MalformedOperation`` (by its caller's reply, or by its stored outcome) took the refusal
    of an op the byzantine client appended under its id. Other failures pass."""
    refused = OpRecord("t1", "list", ("lst:1",), True, "t1", outcome="not-applied", via="reply")
    refused.error = "MalformedOperation: key 'lst:9' routes to shard 2 of 6, not to shard 4"
    broke = OpRecord("t2", "bank", ("acct:1", "acct:2"), True, "t2", outcome="not-applied")
    broke.via, broke.error = "reply", "InsufficientFunds: balance 3 is less than 9"
    polled = OpRecord("t3", "list", ("lst:2",), True, "t3", via="timeout")
    observed = Observed(
        History([refused, broke, polled]),
        {"t3": ("error", "MalformedOperation: a grant request's id must be '<op id>#<attempt>'")},
        {},
        {},
    )
    flagged = [violation.evidence["tag"] for violation in check_refusals(observed)]
    assert flagged == ["t1", "t3"]
    observed.resolved["t3"] = ("error", "InsufficientFunds: balance 3 is less than 9")
    assert [violation.evidence["tag"] for violation in check_refusals(observed)] == ["t1"]


async def test_outcomes_are_polled_once_the_tap_has_read_every_entry(
    standalone_server: LocalServer, namespace: str
) -> None:
    """The runner polls the outcomes of the ops the tap names once the tap has caught up with
    the streams (``runner._tap_caught_up``). A tap that cannot read (here its server's port
    moved; in short seed 102, its read still backing off after a Redis restart) is behind on a
    stream holding an entry it has not read, until it has read it; an entry trimmed unread (a
    worker trims only committed ops) needs no reading."""
    direct = redis.asyncio.Redis.from_url(standalone_server.url)
    port = free_port()  # (nothing listens there)
    tap = StreamTap(lambda: direct_client(port), namespace, 2)
    streams = [ShardKeys(namespace, shard).stream for shard in (0, 1)]

    def entry(op_id: str) -> dict[str, str]:
        envelope = {"id": op_id, "key": "lst:1", "op": "append", "args": [f"tag-{op_id}"]}
        return {"v": "1", "ops": json.dumps([envelope])}

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(tap.run)
            assert await tap.catch_up(direct, 5) == []  # (empty streams: nothing to read)
            await direct.xadd(streams[0], entry("op-1"))  # type: ignore[arg-type]
            read_first = (await direct.xadd(streams[1], entry("op-2"))).decode()  # type: ignore[arg-type]
            await direct.xtrim(streams[0], maxlen=0)
            assert await tap.catch_up(direct, 0.5) == [streams[1]]
            port = standalone_server.port
            assert await tap.catch_up(direct, 10) == []
            assert tap.seen["op-2"].entries == [read_first]
            assert "op-1" not in tap.seen
            group.cancel_scope.cancel()
    finally:
        await direct.aclose()


async def test_the_resolver_reads_an_id_taken_by_another_op_as_refused(
    redis_url: str, namespace: str
) -> None:
    """An op of the load whose caller learned nothing is resolved from the outcome stored under
    its id only if that outcome is its own: one another op stored there (an id taken ahead, as
    reshard seed 13401 most likely saw) reads as refused, never as the load op applied."""
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        await ks.submit("lst:1", apps.append("earlier"))
        await ks.submit("lst:1", apps.peek(), op_id="victim-1")  # (the other op, ahead)
        assert await _stored(ks, "victim-1", "lst:1", apps.peek()) == ("ok", ["earlier"])
        status, error = await _stored(ks, "victim-1", "lst:1", apps.append("victim-1")) or ("", "")
        assert status == "error" and "belongs to another op" in error


async def test_the_tap_gives_a_read_up_at_once_when_redis_does_not_answer() -> None:
    """The tap reconnects every 0.1 s by itself. Its client does not retry: redis-py's does (6
    and later: three more tries, sleeping up to 2, 4 and 8 s), and in short seed 102 the tap
    read again seconds after Redis was back."""
    client = direct_client(free_port())
    began = time.monotonic()
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await client.ping()
    finally:
        await client.aclose()
    assert time.monotonic() - began < 1.0


def test_the_timers_checker_flags_each_breach_of_the_delayed_ops_guarantees() -> None:
    """``check_timers`` on a made-up history of the timer workload: a clean one passes; a
    delayed op run twice or early, one acknowledged and never run, a cancelled timer that ran,
    an acknowledged timer that never fired, and two timers run against their due order are
    each flagged; an unacknowledged op that never ran is not."""

    def delayed(tag: str, sent: float, delay: float, **fields: Any) -> TimerRecord:
        record = TimerRecord(tag, "delayed", "timer:0", apps.stamp(tag), True, how="enqueue")
        record.sent, record.delay, record.answered, record.acked = sent, delay, sent + 0.01, True
        for name, value in fields.items():
            setattr(record, name, value)
        return record

    def setter(tag: str, sent: float, seconds: float) -> TimerRecord:
        record = TimerRecord(tag, "set", "timer:0", apps.stamp_later(seconds, tag), True)
        record.sent, record.delay, record.answered = sent, seconds, sent + 0.02
        record.acked, record.outcome, record.via = True, "applied", "reply"
        record.timer_id = record.value = f"{tag}#t1"
        return record

    def cancel(tag: str, target: str, sent: float) -> TimerRecord:
        record = TimerRecord(tag, "cancel", "timer:0", apps.cancel_timer(target), True)
        record.sent, record.answered, record.target = sent, sent + 0.02, target
        record.acked, record.outcome, record.via = True, "applied", "reply"
        return record

    records = [
        delayed("a", 100.0, 1.0),
        delayed("b", 100.1, 0.3),  # due 100.4: ran first
        delayed("lost", 100.2, 0.5, acked=False, answered=None, via="timeout"),
        setter("s", 100.3, 0.5),  # due 100.8: ran
        setter("c", 100.4, 1.5),  # cancelled at 101.0
        cancel("x", "c#t1", 101.0),
    ]
    cancelled = ("error", "keyserial.TimerCancelled: timer 'c#t1' was cancelled before it ran")
    outcomes = {"a": ("ok", 101.01), "b": ("ok", 100.41), "s": ("ok", "s#t1")}
    outcomes |= {"s#t1": ("ok", 100.83), "c": ("ok", "c#t1"), "c#t1": cancelled, "x": ("ok", None)}
    final = [["b", 100.41], ["s", 100.83], ["a", 101.01]]

    def flagged(final: list[Any], **changes: Any) -> list[str]:
        observed = TimerObserved(TimerHistory(records), {"timer:0": final}, {**outcomes, **changes})
        return sorted(f"{v.checker}: {v.what}" for v in check_timers(observed))

    assert flagged(final) == []
    assert flagged([*final, ["a", 101.2]]) == ["timers-once: a delayed op ran twice"]
    assert flagged([["b", 100.41], ["s", 100.83]], a=("ok", 101.01)) == [
        "timers-once: an acknowledged delayed op never ran"
    ]
    assert flagged([["b", 100.3], ["s", 100.83], ["a", 101.01]], b=("ok", 100.3)) == [
        "timers-early: an op ran before its due time"
    ]
    assert flagged([*final, ["c", 102.0]]) == ["timers-cancel: a timer answered as cancelled ran"]
    del outcomes["s#t1"]
    assert flagged(final[:1] + final[2:]) == ["timers-once: an acknowledged timer never fired"]
    outcomes["s#t1"] = ("ok", 100.83)
    assert (
        flagged([["s", 100.83], ["a", 101.01], ["b", 100.41]])
        == ["timers-order: an op due earlier ran after one due later on its key"] * 2
    )
