"""One seeded run: start the system, load it while the faults fire, heal, check.

After the load: every fault is healed, each shard must take and commit a new op within the
profile's liveness bound, the stream tap catches up with every entry appended, unknown outcomes
are polled by op id (never resubmitted), the keys' final states are read through ops (ordered
after everything appended), and the checkers run.
"""

from __future__ import annotations

import json
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio as aredis
from redis.crc import key_slot

import keyserial
from keyserial import BackendUnavailable, KeyserialError, OperationFailed, shard_for
from keyserial._backend.backend import Backend
from keyserial._wire.codec import parse_id
from keyserial._wire.layout import Layout
from keyserial._wire.resharding import Seal, sealed_key
from keyserial.testing import ShardKeys
from tests import apps
from tests.helpers import keys_on_shard
from tests.nemesis.checkers import (
    Observed,
    Resolved,
    Violation,
    check_all,
    check_epochs,
    lost_by_a_failover,
    op_ids_of,
)
from tests.nemesis.cluster_system import ClusterSystem
from tests.nemesis.faults import Faults, GarbageSent
from tests.nemesis.schedule import Plan, Profile, make_plan
from tests.nemesis.system import BaseSystem, System
from tests.nemesis.tap import StreamTap
from tests.nemesis.timers import SETTLE_GRACE, TimerLoad, TimerObserved, is_cancelled
from tests.nemesis.workloads import APPLIED, OPENING_BALANCE, UNKNOWN, Keys, Load


@dataclass
class RunReport:
    seed: int
    profile: str
    schedule: str
    injected: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    workdir: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations

    def describe(self, *, verbose: bool = False) -> str:
        lines = [
            f"seed {self.seed} ({self.profile}): "
            f"{'ok' if self.ok else f'{len(self.violations)} VIOLATION(S)'} {self.stats}"
        ]
        if verbose or not self.ok:
            lines += ["schedule:", self.schedule, "injected:"]
            lines += [f"  {line}" for line in self.injected]
        if not self.ok:
            lines += ["violations:"] + [f"  {v.describe()}"[:1500] for v in self.violations]
            lines.append(f"logs: {self.workdir}")
            lines.append(
                f"reproduce: python -m tests.nemesis --seeds 1 --seed-start {self.seed}"
                f" --profile {self.profile}"
            )
        return "\n".join(lines)


async def run_seed(seed: int, profile: Profile, workdir: Path) -> RunReport:
    plan = make_plan(seed, profile)
    report = RunReport(seed, profile.name, plan.describe(), workdir=str(workdir))
    began = time.monotonic()
    deadline = profile.load_seconds + profile.submit_timeout + profile.resolve_seconds + 90
    if profile.timer_callers:  # (timers are given until they are all due, and then some)
        deadline += profile.resolve_seconds + SETTLE_GRACE + 10
    with anyio.move_on_after(deadline) as run:
        async with make_system(plan, workdir) as system:
            if not await system.wait_all_held(30):
                report.violations.append(
                    Violation(
                        "setup",
                        "workers did not take every shard",
                        {"holders": await system.holders()},
                    )
                )
                return report
            await _run(plan, system, report)
    if run.cancelled_caught:  # (reported, so that a campaign goes on to the next seed)
        report.violations.append(
            Violation("harness", f"the run did not end within {deadline:g} s", {})
        )
    report.stats["seconds"] = round(time.monotonic() - began, 1)
    return report


def make_system(plan: Plan, workdir: Path) -> BaseSystem:
    return (ClusterSystem if plan.profile.topology == "cluster" else System)(plan, workdir)


async def _run(plan: Plan, system: BaseSystem, report: RunReport) -> None:
    profile = plan.profile
    tap = system.tap()
    async with anyio.create_task_group() as background, AsyncExitStack() as stack:
        background.start_soon(tap.run)
        clients = [
            await stack.enter_async_context(
                keyserial.connect(
                    url,
                    shards=profile.shard_count,
                    namespace=system.namespace,
                    durable_replicas=profile.durable_replicas,
                    health_interval=profile.health_interval,
                )
            )
            for url in system.client_urls()
        ]
        keys = Keys.for_profile(profile)
        await _open_accounts(clients[0], keys)
        stale = None
        if profile.stale_appends:
            stale = aredis.Redis.from_url(system.client_urls()[0], socket_timeout=5)
            stack.push_async_callback(stale.aclose)
        load = Load(plan.seed, profile, keys, clients, stale)
        timer_load = TimerLoad(plan.seed, profile, clients) if profile.timer_callers else None
        faults = Faults(system, load)
        async with anyio.create_task_group() as running:
            running.start_soon(load.run)
            if timer_load is not None:
                running.start_soon(timer_load.run)
            with anyio.move_on_after(profile.load_seconds):
                await faults.run(plan.events)
                await anyio.sleep_forever()
            load.stop()
            if timer_load is not None:
                timer_load.stop()
            await system.heal()
            for note in system.heal_notes:
                faults.note(f"healing: {note}")
            if system.unfinished_move is not None:
                report.violations.append(
                    Violation(
                        "reshard",
                        "a move did not finish: its old shards committed nothing for 30 s"
                        " after healing",
                        {"last": system.unfinished_move, "holders": await system.holders()},
                    )
                )
            faults.note("load stopped, every fault healed")
            report.violations += await _liveness(system, clients[0], faults)
        faults.note("load drained")
        report.violations += await _held_keys(system, clients[0], faults)
        report.violations += await _holds_released(system, faults)
        report.violations += await _tap_caught_up(system, tap, faults)
        resolved = await _resolve(clients[0], load, tap, profile)
        finals = await _finals(clients[0], system, load, keys)
        timers = None
        if timer_load is not None:
            timers = await timer_load.observe(clients[0])
            faults.note(f"timer keys read: {len(timers.outcomes)} outcomes found")
        report.violations += await _garbage_answered(system, faults)
        observed = Observed(
            load.history,
            resolved,
            dict(tap.seen),
            finals,
            faults.started,
            gone=await _gone(tap, resolved),
            promotions=_promotions_by_shard(faults, system.namespace, profile.shard_count),
            timers=timers,
        )
        report.violations += check_all(observed)
        report.violations += check_epochs(
            {
                process.log_path.name: process.log()
                for process in system.every_process
                if process.log_path is not None
            }
        )
        if system.moves and system.unfinished_move is None:
            under_way = await system.move_under_way()
            if under_way is not None:
                report.violations.append(
                    Violation(
                        "reshard",
                        "a move is still under way at the end of the run",
                        {"to": under_way, "healing": system.heal_notes[-5:]},
                    )
                )
        report.violations += [
            Violation("worker-crashes", "a worker process exited by itself", crash)
            for crash in system.crashed()
        ]
        report.violations += [
            Violation(
                "subscription-health",
                "a silently dropped subscription was not replaced in time",
                stale,
            )
            for stale in faults.stale_subscriptions
        ]
        report.violations += [
            Violation(
                "acl",
                "the client ACL user wrote what it must not (a stream, or an inbox other than"
                " by RPUSH)",
                breach,
            )
            for breach in faults.acl_breaches
        ]
        report.violations += [
            Violation(
                "harness", "the byzantine client stopped on an error of its own", {"log": line}
            )
            for line in faults.log
            if " forge forger failed to inject: " in line
        ]
        report.injected = faults.log
        report.stats.update(_stats(observed), faults=faults.injected)
        background.cancel_scope.cancel()


async def _open_accounts(client: keyserial.Client, keys: Keys) -> None:
    for account in keys.accounts:
        await client.submit(
            account, apps.open_account(OPENING_BALANCE), op_id=f"open-{account}", timeout=30
        )


async def _liveness(
    system: BaseSystem, client: keyserial.Client, faults: Faults
) -> list[Violation]:
    """Each shard takes and commits a new op within the bound, counted from the heal."""
    profile = system.profile
    healed = time.monotonic()
    violations: list[Violation] = []

    async def probe(shard: int) -> None:
        key = keys_on_shard(shard, system.shard_count, 1, "live")[0]
        try:
            while True:
                left = healed + profile.liveness_bound - time.monotonic()
                try:
                    # Under one op id, as a caller told BackendUnavailable resubmits: right
                    # after a failover the client may still route to the dead master.
                    await client.submit(
                        key,
                        apps.append(f"live-{shard}"),
                        op_id=f"live-{shard}",
                        timeout=max(0.1, left),
                    )
                    return
                except BackendUnavailable:
                    if left <= 0.2:
                        raise
                    await anyio.sleep(0.2)
        except KeyserialError as error:
            violations.append(
                Violation(
                    "liveness",
                    f"shard {shard} committed no new op within "
                    f"{profile.liveness_bound}s of healing",
                    {
                        "shard": shard,
                        "error": str(error)[:200],
                        "holders": await system.holders(),
                        "live_pids": sorted(system.live_pids()),
                    },
                )
            )

    async with anyio.create_task_group() as group:
        for shard in range(system.shard_count):  # (after a reshard fault, the new count)
            group.start_soon(probe, shard)
    faults.note(f"liveness probed: {len(violations)} shard(s) stuck")
    return violations


async def _holds_released(system: BaseSystem, faults: Faults) -> list[Violation]:
    """Every hold a participant recorded is released once the load has drained: the held
    hashes of every layout's shards are empty within the liveness bound (Redis deletes a hash
    with its last field). A hold left behind would stand for keys held for an op that is
    over."""
    assert system.inspector is not None
    inspector = system.inspector
    deadline = time.monotonic() + system.profile.liveness_bound
    pattern = f"ks:{{{system.namespace}:*}}:held"
    while True:
        left: dict[str, list[str]] = {}
        async for key in inspector.scan_iter(match=pattern, count=1000):
            name = key.decode() if isinstance(key, bytes) else key
            left[name] = sorted(field.decode() for field in await inspector.hkeys(name))
        if not left or time.monotonic() >= deadline:
            break
        await anyio.sleep(0.2)
    faults.note(f"held hashes left once the load drained: {len(left)}")
    if not left:
        return []
    return [
        Violation(
            "held-record",
            f"holds left {system.profile.liveness_bound}s after the load drained",
            {"held": {key: fields[:5] for key, fields in sorted(left.items())[:5]}},
        )
    ]


async def _held_keys(
    system: BaseSystem, client: keyserial.Client, faults: Faults
) -> list[Violation]:
    """Every key the byzantine client named (in the grant requests and ops it appended) answers
    a fresh op within the liveness bound, counted from when the load has drained (every fault
    healed, no caller waiting): a forged grant request that a worker took would hold its keys
    until the home shard changed owner, which nothing does any more."""
    profile = system.profile
    began = time.monotonic()
    violations: list[Violation] = []

    async def probe(key: str) -> None:
        try:
            while True:
                left = began + profile.liveness_bound - time.monotonic()
                try:
                    # (One op id, as a caller told BackendUnavailable resubmits.)
                    await client.submit(
                        key, apps.peek(), op_id=f"held-{key}", timeout=max(0.1, left)
                    )
                    return
                except BackendUnavailable:
                    if left <= 0.2:
                        raise
                    await anyio.sleep(0.2)
        except KeyserialError as error:
            violations.append(
                Violation(
                    "held-key",
                    f"key {key!r}, named by the byzantine client, answered no op within"
                    f" {profile.liveness_bound}s of the load draining",
                    {
                        "key": key,
                        "shard": client.shard_of(key),
                        "error": str(error)[:200],
                        "holders": await system.holders(),
                    },
                )
            )

    async with anyio.create_task_group() as group:
        for key in sorted(system.forged_keys):
            group.start_soon(probe, key)
    if system.forged_keys:
        faults.note(
            f"keys the forger named probed: {len(violations)} of {len(system.forged_keys)} held"
        )
    return violations


async def _tap_caught_up(system: BaseSystem, tap: StreamTap, faults: Faults) -> list[Violation]:
    """Wait, up to the liveness bound, until the tap has read every entry in the streams, and
    the inboxes are empty (every item pushed moved into a stream, and read there): the
    ops to poll are those it names, so an op appended just before the load ended must be among
    them. (Short seed 102, four runs on two cores: the load shifted a Redis restart to just
    before the load ended, the tap's read was still backing off when outcomes were polled, and
    an op that had applied was reported without one.) The load has drained: no op of it is
    appended any more."""
    bound = system.profile.liveness_bound
    began = time.monotonic()
    behind = await tap.catch_up(system.inspector, bound)
    if behind:
        return [
            Violation(
                "harness",
                f"the stream tap had not read every entry {bound}s after the load drained (or"
                " an inbox still held items its owner had not moved in)",
                {"behind": behind, "read": {name: tap.read.get(name, "") for name in behind}},
            )
        ]
    faults.note(f"stream tap caught up after {time.monotonic() - began:.2f}s")
    return []


#: Seconds an op the tap never saw appended is looked up for. The tap has read every entry by
#: then (:func:`_tap_caught_up`): such an op was never appended, or it was trimmed before the
#: tap read it, which a worker does only once it committed: its outcome was stored, and found
#: by then.
_UNSEEN_GRACE = 2.0


async def _resolve(
    client: keyserial.Client, load: Load, tap: StreamTap, profile: Profile
) -> dict[str, Resolved]:
    """Poll the stored outcome of every op whose caller did not learn it, and of every op the
    tap saw appended, until found or until ``resolve_seconds`` pass with none found (slow ops
    queued on one key resolve one after another; for an op the tap never saw, a grace): never
    resubmitting."""
    wanted = _unresolved(load, tap)
    resolved: dict[str, Resolved] = {}
    began = found_at = time.monotonic()
    while wanted and time.monotonic() < found_at + profile.resolve_seconds:
        for op_id, (key, call) in list(wanted.items()):
            outcome = await _stored(client, op_id, key, call)
            if outcome is not None:
                resolved[op_id] = outcome
                del wanted[op_id]
                found_at = time.monotonic()
        if time.monotonic() > began + _UNSEEN_GRACE:
            wanted = {op_id: key for op_id, key in wanted.items() if op_id in tap.seen}
        if wanted:
            await anyio.sleep(0.25)
    return resolved


def _unresolved(
    load: Load, tap: StreamTap
) -> dict[str, tuple[str | list[str], keyserial.Call[Any] | None]]:
    """Op id -> the key (or keys) to look it up by, and the op it names (None: an op the tap
    saw that the load did not submit)."""
    observed = Observed(load.history, {}, dict(tap.seen), {})
    wanted: dict[str, tuple[str | list[str], keyserial.Call[Any] | None]] = {}
    for record in load.history.records:
        if record.outcome == UNKNOWN:
            key = record.keys[0] if len(record.keys) == 1 else list(record.keys)
            for op_id in op_ids_of(record, observed):
                wanted[op_id] = (key, record.call)
    for op_id, seen in tap.seen.items():
        wanted.setdefault(op_id, (seen.keys[0] if len(seen.keys) == 1 else list(seen.keys), None))
    return wanted


async def _stored(
    client: keyserial.Client, op_id: str, key: str | list[str], op: keyserial.Call[Any] | None
) -> Resolved | None:
    """The outcome stored for ``op_id``, if it is ``op``'s (another op's, taken ahead under its
    id, gives the refusal its submit would get)."""
    try:
        return ("ok", await client.result(op_id, key=key, op=op))
    except OperationFailed as error:
        return ("error", f"{type(error).__name__}: {error}"[:200])
    except KeyserialError:  # ResultNotFound: not yet; BackendUnavailable: ask again later
        return None


async def _finals(
    client: keyserial.Client, system: BaseSystem, load: Load, keys: Keys
) -> dict[str, Any]:
    """Every key's state, read by an op (after every op appended on it) where the shard
    answers, else straight from the state hash."""
    names = {key for record in load.history.records for key in record.keys}
    names |= set(keys.accounts)
    finals: dict[str, Any] = {}

    async def read(key: str) -> None:
        try:
            finals[key] = await client.submit(
                key, apps.peek(), timeout=system.profile.liveness_bound
            )
        except KeyserialError:
            assert system.inspector is not None
            layout = client.layout  # (the layout new ops go to: a reshard fault may have moved it)
            raw = await system.inspector.execute_command(
                "HGET", layout.keys(shard_for(key, layout.shards)).state, key
            )
            finals[key] = None if raw is None else json.loads(raw)

    async with anyio.create_task_group() as group:
        for key in sorted(names):
            group.start_soon(read, key)
    return finals


async def _garbage_answered(system: BaseSystem, faults: Faults) -> list[Violation]:
    """Every garbage envelope the wire format promises an outcome got one stored, except an
    op no worker knows: that refusal is replied but never stored (a newer worker could run
    the same op id); and except one appended past its shard's seal (a reshard under way),
    whose refusal is replied, never stored (see ``ShardRunner._past_seal``)."""
    assert system.inspector is not None
    violations = []
    shards = await _every_shard(system)
    for sent in faults.garbage:
        if await _past_seal(system, sent):
            continue
        for op_id in sent.answer_expected:
            # (Looked for on every shard of every layout: appended to a shard a reshard had
            # sealed, an op is forwarded to its home in the new layout, and runs there.)
            found = [
                await system.inspector.execute_command("HGET", name, op_id)
                for keys in shards
                for name in (keys.results, keys.results_old)
            ]
            evidence = {"kind": sent.kind, "shard": sent.shard, "op_id": op_id, "entry": sent.entry}
            if sent.kind == "unknown_op" and any(found):
                violations.append(
                    Violation("garbage", "an unknown op's refusal was stored", evidence)
                )
            elif sent.kind != "unknown_op" and not any(found):
                violations.append(
                    Violation(
                        "garbage", "a foreign envelope with an id got no stored outcome", evidence
                    )
                )
    return violations


async def _past_seal(system: BaseSystem, sent: GarbageSent) -> bool:
    """Whether ``sent`` was appended after a reshard sealed its shard."""
    assert system.inspector is not None
    keys = ShardKeys(system.namespace, sent.shard, sent.generation)
    raw = await system.inspector.execute_command("GET", sealed_key(keys))
    if raw is None:
        return False
    last = Seal.decode(system.namespace, raw).last
    return parse_id(sent.entry) > parse_id(last)


async def _every_shard(system: BaseSystem) -> list[ShardKeys]:
    """Every shard of the namespace's live layout, of a move under way and of the layouts
    before (after reshard faults)."""
    if not system.moves:
        return Layout(system.namespace, system.profile.shard_count).all_keys()
    backend = await Backend.connect(system.direct_url())
    try:
        record = await backend.layout_record(system.namespace)
    finally:
        await backend.aclose()
    assert record is not None
    layouts = [record.live, *(layout for layout, _ in record.history)]
    layouts += [record.move.target] if record.move else []
    return [keys for layout in layouts for keys in layout.all_keys()]


def _stats(observed: Observed) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for record in observed.history.records:
        name = f"{record.outcome}:{record.via}"
        counts[name] = counts.get(name, 0) + 1
    stats = {
        "ops": len(observed.history.records),
        "appended_seen": len(observed.appended),
        "resolved": len(observed.resolved),
        **dict(sorted(counts.items())),
        **lost_by_failovers(observed),
    }
    if observed.timers is not None:
        stats["timers"] = _timer_stats(observed.timers)
    return stats


def _timer_stats(observed: TimerObserved) -> dict[str, int]:
    """The timer workload's ops by kind and what their callers learned, and how its timers
    ended: fired (ran), cancelled (answered ``TimerCancelled``), or neither."""
    counts: dict[str, int] = {}

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    for record in observed.history.records:
        count(f"{record.kind}:{'acked' if record.acked else record.via or 'unknown'}")
        if record.kind == "set" and record.outcome == APPLIED and not record.fails:
            stored = observed.outcomes.get(record.timer_id or "")
            count(
                "timer:cancelled"
                if is_cancelled(stored)
                else "timer:ran"
                if stored and stored[0] == "ok"
                else "timer:neither"
            )
    return dict(sorted(counts.items()))


def lost_by_failovers(observed: Observed) -> dict[str, Any]:
    """The ops :func:`lost_by_a_failover` let off, each with what let it off (to audit)."""
    records = observed.history.by_tag()
    lost = []
    for op_id, seen in sorted(observed.appended.items()):
        record = records.get(seen.tag)
        if op_id in observed.resolved or record is None:
            continue
        if lost_by_a_failover(record, seen, observed):
            promoted = [at - observed.t0 for at in observed.promotions[seen.shard]]
            lost.append(
                f"{op_id} (shard {seen.shard}, {record.via} at"
                f" t={record.ended - observed.t0:.2f}s, submitted at"
                f" t={record.started - observed.t0:.2f}s, master replaced at"
                f" {', '.join(f't={at:.2f}s' for at in promoted)})"
            )
    return {"lost-by-a-failover-after-the-caller-gave-up": lost} if lost else {}


async def _gone(tap: StreamTap, resolved: dict[str, Resolved]) -> frozenset[str]:
    """The op ids the tap saw appended, with no outcome, of which no entry is left in their
    shard's stream (a worker trims only entries whose ops committed)."""
    client = tap.connect()
    try:
        gone = set()
        for op_id, seen in tap.seen.items():
            if op_id in resolved:
                continue
            present = [await client.xrange(seen.stream, entry, entry) for entry in seen.entries]
            if not any(present):
                gone.add(op_id)
        return frozenset(gone)
    finally:
        await client.aclose()


def _promotions_by_shard(
    faults: Faults, namespace: str, shard_count: int
) -> dict[int, list[float]]:
    """Shard -> when its slot's master was replaced by a replica."""
    by_shard: dict[int, list[float]] = {}
    for shard in range(shard_count):
        slot = key_slot(ShardKeys(namespace, shard).stream.encode())
        by_shard[shard] = [at for at, first, last in faults.promotions if first <= slot <= last]
    return by_shard
