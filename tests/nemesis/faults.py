"""Fault injectors, one per kind of ``schedule.FAULT_WEIGHTS``, run at their planned offsets.

An injector gets the run's :class:`Faults` (the system, the load, the log) and its event. It may
be cancelled at any await when the load ends: ``System.heal`` then ends whatever it left
(a paused process, a held link, Redis down, a slot without a live worker), so an injector needs
no cleanup of its own. The cluster profile's kinds live in ``cluster_faults``.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aredis
from redis.exceptions import BusyLoadingError

from keyserial import KeyserialError
from keyserial._wire.layout import Layout
from tests import apps
from tests.helpers import keys_on_shard
from tests.nemesis import cluster_faults, hostile
from tests.nemesis.schedule import FaultEvent
from tests.nemesis.system import BaseSystem, System
from tests.nemesis.tap import GARBAGE_PREFIX
from tests.nemesis.workloads import OPENING_BALANCE, Load


@dataclass
class GarbageSent:
    """A foreign entry appended by the nemesis; ``answer_expected`` lists the op ids the wire
    format says get a stored outcome."""

    shard: int
    kind: str
    entry: str
    answer_expected: list[str]
    #: The layout generation of the shard it was appended to.
    generation: int = 0


@dataclass
class Faults:
    system: BaseSystem
    load: Load
    started: float = field(default_factory=time.monotonic)
    log: list[str] = field(default_factory=list)
    garbage: list[GarbageSent] = field(default_factory=list)
    #: Dropped subscriptions that were not replaced in time (each a violation).
    stale_subscriptions: list[dict[str, object]] = field(default_factory=list)
    #: Writes the byzantine client tried as the client ACL user that Redis did not refuse
    #: (each a violation: see ``hostile.Forger._refused_writes``).
    acl_breaches: list[dict[str, Any]] = field(default_factory=list)
    #: Faults injected in full (a fault still waiting for its target when the load ended, or
    #: cut short by it, does not count).
    injected: int = 0
    #: Each time a replica took a slot range over from its master: (monotonic time, first
    #: slot, last slot). The appends the old master took last may be lost with it.
    promotions: list[tuple[float, int, int]] = field(default_factory=list)
    _locks: dict[str, anyio.Lock] = field(default_factory=dict)

    def note(self, text: str) -> None:
        self.log.append(f"t={time.monotonic() - self.started:6.2f}s {text}")

    def lock(self, target: str) -> anyio.Lock:
        """One fault at a time per target (a slot is not killed while it is paused)."""
        return self._locks.setdefault(target, anyio.Lock())

    async def run(self, events: tuple[FaultEvent, ...]) -> None:
        async with anyio.create_task_group() as group:
            for number, event in enumerate(events):
                group.start_soon(self._inject_at, number, event)

    async def _inject_at(self, number: int, event: FaultEvent) -> None:
        await anyio.sleep(max(0.0, self.started + event.at - time.monotonic()))
        async with self.lock(event.target):
            try:
                await INJECTORS[event.kind](self, number, event)
                self.injected += 1
            except Exception as error:
                self.note(f"{event.kind} {event.target} failed to inject: {error!r}")


def _standalone(faults: Faults) -> System:
    """The system of a proxy or single-server fault (the standalone profiles' only)."""
    assert isinstance(faults.system, System), "a proxy or server fault in a standalone run only"
    return faults.system


def _slot(event: FaultEvent) -> int:
    return int(event.target.split(":")[1])


async def kill9(faults: Faults, number: int, event: FaultEvent) -> None:
    slot = _slot(event)
    victim = faults.system.worker(slot)
    faults.system.ended_by_nemesis.add(victim.pid)
    victim.kill()
    faults.note(f"kill -9 {event.target} (pid {victim.pid})")
    await anyio.sleep(event.params["restart_after"])
    faults.note(f"{event.target} replaced (pid {faults.system.start_worker(slot).pid})")


async def kill9_mid_commit(faults: Faults, number: int, event: FaultEvent) -> None:
    """kill -9 the worker holding the most shards while payments between them commit: fresh
    accounts in ``pairs`` pairs, each across two of its shards, pay back and forth, all pairs
    at once, and the kill goes out as the ``kill_after``-th payment is acknowledged. On a
    cluster each payment takes the grant protocol within the one worker too, so with many in
    flight the kill lands between a decision its home shard committed and the participant
    shard's applying it, where the participant's next owner must still apply it once (on a
    standalone server, among commits across shards in process). Replaced ``restart_after``
    seconds later."""
    system, load, params = faults.system, faults.load, event.params
    slot = await _most_shards(system)
    async with faults.lock(f"worker:{slot}"):  # (not while another fault has the slot)
        victim = system.worker(slot)
        held = (await _held_by(system))[slot]
        if len(held) < 2:
            raise RuntimeError(f"worker:{slot} (pid {victim.pid}) holds shards {held} only")
        pairs = await _open_pairs(faults, number, held, params["pairs"])
        answered = 0
        killed = anyio.Event()

        def one_answered() -> None:
            nonlocal answered
            answered += 1
            if answered == params["kill_after"]:  # at once: not a wake-up later
                system.ended_by_nemesis.add(victim.pid)
                with suppress(ProcessLookupError):
                    victim.process.kill()
                killed.set()

        load.spawn(load.transfers, pairs, params["rounds"], f"mc{number}", one_answered)
        faults.note(
            f"{len(pairs)} pairs of accounts paying across shards {list(held)} of worker:{slot}"
            f" (pid {victim.pid})"
        )
        await killed.wait()
        victim.kill()  # (reaped)
        faults.note(
            f"kill -9 worker:{slot} (pid {victim.pid}) as payment {params['kill_after']} of"
            " them was acknowledged"
        )
        await anyio.sleep(params["restart_after"])
        faults.note(f"worker:{slot} replaced (pid {system.start_worker(slot).pid})")


async def _held_by(system: BaseSystem) -> dict[int, tuple[int, ...]]:
    """Slot -> the shards its live process holds (asked again while Redis does not answer)."""
    while True:
        try:
            holders = await system.holders()
            break
        except (OSError, aredis.RedisError):
            await anyio.sleep(0.1)
    slots = {process.pid: slot for slot, process in enumerate(system.slots) if process}
    held: dict[int, tuple[int, ...]] = {slot: () for slot in range(len(system.slots))}
    for shard, pid in sorted(holders.items()):
        if pid in slots and pid in system.live_pids():
            held[slots[pid]] += (shard,)
    return held


async def _most_shards(system: BaseSystem) -> int:
    """The slot whose live process holds the most shards, once one holds two or more (after
    another kill, the dead worker's leases run out first)."""
    while True:
        held = await _held_by(system)
        slot = max(held, key=lambda slot: len(held[slot]))
        if len(held[slot]) >= 2:
            return slot
        await anyio.sleep(0.1)


async def _open_pairs(
    faults: Faults, number: int, shards: tuple[int, ...], count: int
) -> list[tuple[str, str]]:
    """``count`` pairs of fresh accounts, each opened with the load's opening balance and
    split across two of ``shards`` (every two of them in turn: the lower one is the home)."""
    system, client = faults.system, faults.load.clients[0]
    across = [(a, b) for a in shards for b in shards if a < b]
    uses = Counter(shard for n in range(count) for shard in across[n % len(across)])
    fresh = {
        shard: keys_on_shard(shard, system.shard_count, uses[shard], f"acct:m{number}")
        for shard in uses
    }
    pairs = [
        (fresh[a].pop(), fresh[b].pop()) for a, b in (across[n % len(across)] for n in range(count))
    ]

    async def open_one(account: str) -> None:
        with anyio.fail_after(20):
            while True:
                try:
                    await client.submit(
                        account,
                        apps.open_account(OPENING_BALANCE),
                        op_id=f"open-{account}",
                        timeout=5,
                    )
                    return
                except KeyserialError:  # (one op id: it opens the account once)
                    await anyio.sleep(0.1)

    async with anyio.create_task_group() as group:
        for pair in pairs:
            for account in pair:
                group.start_soon(open_one, account)
    return pairs


async def sigstop(faults: Faults, number: int, event: FaultEvent) -> None:
    victim = faults.system.worker(_slot(event))
    victim.signal(signal.SIGSTOP)
    faults.note(f"SIGSTOP {event.target} (pid {victim.pid})")
    await anyio.sleep(event.params["paused"])
    with suppress(ProcessLookupError):
        victim.signal(signal.SIGCONT)
    faults.note(f"SIGCONT {event.target} (pid {victim.pid})")


async def sigterm_slow(faults: Faults, number: int, event: FaultEvent) -> None:
    """SIGTERM while slow async ops run on the victim's shards, then a replacement."""
    slot = _slot(event)
    system = faults.system
    victim = system.worker(slot)
    params = event.params
    faults.load.spawn(
        faults.load.burst,
        system.plan.layouts[slot],
        params["slow_ops"],
        params["slow_delay"],
        f"burst{number}",
    )
    await anyio.sleep(min(0.3, params["slow_delay"] / 2))
    system.terminating.add(slot)
    system.ended_by_nemesis.add(victim.pid)
    with suppress(ProcessLookupError):
        victim.signal(signal.SIGTERM)
    faults.note(f"SIGTERM {event.target} (pid {victim.pid}) with {params['slow_ops']} slow ops")
    with anyio.move_on_after(system.profile.lease_ttl * 3 + 5):
        while victim.process.poll() is None:
            await anyio.sleep(0.05)
    faults.note(f"{event.target} pid {victim.pid} exited: {victim.process.poll()}")
    await anyio.sleep(params["restart_after"])
    faults.note(f"{event.target} replaced (pid {system.start_worker(slot).pid})")


async def redis_restart(faults: Faults, number: int, event: FaultEvent) -> None:
    server = _standalone(faults).server
    await anyio.to_thread.run_sync(server.kill)
    faults.note("kill -9 redis")
    await anyio.sleep(event.params["down_for"])
    await anyio.to_thread.run_sync(server.start)
    faults.note("redis restarted")


async def net_reset(faults: Faults, number: int, event: FaultEvent) -> None:
    proxy = _standalone(faults).proxy(event.target)
    for _ in range(event.params["times"]):
        proxy.reset()
        faults.note(f"reset the links of {event.target}")
        await anyio.sleep(0.3)


async def net_blackhole(faults: Faults, number: int, event: FaultEvent) -> None:
    proxy = _standalone(faults).proxy(event.target)
    held = event.params["held"]
    proxy.hold(held + 0.1)  # still held when the links are reset below
    faults.note(f"blackhole {event.target} for {held}s")
    await anyio.sleep(held)
    if event.params["then_reset"]:
        proxy.reset()
        faults.note(f"reset the held links of {event.target}")


async def net_delay(faults: Faults, number: int, event: FaultEvent) -> None:
    proxy = _standalone(faults).proxy(event.target)
    proxy.delay = event.params["delay"]
    faults.note(f"delay {event.target} by {proxy.delay}s")
    await anyio.sleep(event.params["lasting"])
    proxy.delay = 0.0
    faults.note(f"delay of {event.target} lifted")


#: A Lua script that spins for ARGV[1] µs (it writes nothing, so SCRIPT KILL could end it).
_SPIN = (
    "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') until"
    " (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])"
)


async def redis_busy(faults: Faults, number: int, event: FaultEvent) -> None:
    """Keep Redis in a script past its busy threshold (lowered to 100 ms): every other command
    is answered -BUSY until it ends (healing kills it, if the load ends first)."""
    system = _standalone(faults)
    seconds = event.params["busy_for"]
    client = aredis.Redis(port=system.server.port, socket_timeout=seconds + 10)
    try:
        await client.config_set("busy-reply-threshold", 100)
        faults.note(f"redis BUSY for {seconds}s (a script spinning)")
        await client.eval(_SPIN, 0, int(seconds * 1_000_000))  # type: ignore[misc]
        faults.note("redis BUSY ended")
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()


async def redis_loading(faults: Faults, number: int, event: FaultEvent) -> None:
    """kill -9 Redis and restart it with a dataset that loads slowly (filler keys in the AOF's
    RDB base, each loaded ``per_key_us`` late): commands are answered -LOADING meanwhile."""
    system = _standalone(faults)
    server, inspector = system.server, system.inspector
    filler, per_key = event.params["filler"], event.params["per_key_us"]
    await inspector.mset({f"nemesis-filler:{n}": "x" for n in range(filler)})
    await inspector.bgrewriteaof()
    with anyio.fail_after(10):
        while True:
            persistence = await inspector.info("persistence")
            if not any(
                int(persistence[flag])
                for flag in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
            ):
                break
            await anyio.sleep(0.02)
    await anyio.to_thread.run_sync(server.kill)
    faults.note(f"kill -9 redis, restarted loading {filler} keys {per_key} µs each")
    usual = server.extra_args
    server.extra_args = [
        *usual,
        "--key-load-delay",
        str(per_key),
        "--loading-process-events-interval-bytes",
        "1024",
    ]
    try:
        await anyio.to_thread.run_sync(server.start)  # it answers INFO while it loads
    finally:
        server.extra_args = usual
    began = time.monotonic()
    with anyio.move_on_after(30):
        while True:
            with suppress(OSError, aredis.RedisError):
                if not int((await inspector.info("persistence"))["loading"]):
                    break
            await anyio.sleep(0.05)
    faults.note(f"redis loaded after {time.monotonic() - began:.2f}s")


async def sub_drop(faults: Faults, number: int, event: FaultEvent) -> None:
    """Silence the subscriptions on a worker's or a client's link for good. Each must be
    replaced (its health check fails, it subscribes on a new connection) within about twice
    the health interval (the bound allows three, plus a second, for a loaded machine); one that
    is not is a violation."""
    proxy = _standalone(faults).proxy(event.target)
    before = proxy.subscribing_links
    dropped = proxy.silence_subscriptions()
    faults.note(f"silenced {dropped} subscription link(s) of {event.target}")
    if not dropped:
        return
    bound = 3 * faults.system.profile.health_interval + 1
    began = time.monotonic()
    while proxy.subscribing_links == before:
        if time.monotonic() - began > bound:
            faults.stale_subscriptions.append({"target": event.target, "bound": bound})
            faults.note(f"{event.target} did not subscribe again within {bound:g}s")
            return
        await anyio.sleep(0.05)
    faults.note(f"{event.target} subscribed again after {time.monotonic() - began:.2f}s")


async def garbage(faults: Faults, number: int, event: FaultEvent) -> None:
    """Append a foreign or broken entry with raw XADD (docs/wire-format.md), and wake the
    shard's owner."""
    system = faults.system
    assert system.inspector is not None
    inspector = system.inspector
    layout = await _live_layout(inspector, system.namespace)
    count = layout.shards
    shard = _slot(event) % count
    kind = event.params["entry"]
    op_id = f"{GARBAGE_PREFIX}{system.plan.seed}-{number}"
    key = keys_on_shard(shard, count, 1, "garbage")[0]
    elsewhere = keys_on_shard((shard + 1) % count, count, 1, "garbage")[0]
    version, ops, answered = garbage_entry(kind, op_id, key, elsewhere)
    keys = layout.keys(shard)
    entry = await _not_busy(lambda: inspector.xadd(keys.stream, {"v": version, "ops": ops}))
    # execute_command: a cluster client has no publish() (any node fans a message out).
    await _not_busy(lambda: inspector.execute_command("PUBLISH", keys.wake_channel, entry))
    answer = [op_id] if answered else []
    faults.garbage.append(GarbageSent(shard, kind, entry.decode(), answer, layout.generation))
    faults.note(f"garbage {kind} appended to shard {shard} ({entry.decode()})")


async def reshard(faults: Faults, number: int, event: FaultEvent) -> None:
    """``keyserial reshard`` under the load: to ``to`` shards (one more if the namespace has
    that many; the move under way, if one is), interrupted ``interrupt_after`` seconds in (a
    Ctrl-C: the move stays recorded), and run again ``resume_after`` seconds later to its end.
    Replacement workers started with the old count as the move flipped are started again."""
    system, params = faults.system, event.params
    to = await system.move_under_way() or params["to"]
    if to == system.shard_count:
        to += 1
    if params["interrupt_after"] is not None:
        with anyio.move_on_after(params["interrupt_after"]):
            await system.move(to, faults.note)
        faults.note(f"reshard to {to} interrupted after {params['interrupt_after']}s")
        await anyio.sleep(params["resume_after"])
    faults.note(f"reshard to {to} shards")
    await system.move(to, faults.note)
    faults.note(f"resharded to {to} shards")
    for _ in range(3):  # (a replacement started as the move flipped)
        system.restart_outdated()
        await anyio.sleep(1.0)


async def _live_layout(inspector: Any, namespace: str) -> Layout:
    """The namespace's live layout (a reshard fault may have changed it)."""
    shards, generation = await _not_busy(
        lambda: inspector.hmget(f"ks:{{{namespace}}}:meta", "shards", "generation")
    )
    return Layout(namespace, int(shards), int(generation or 0))


async def _not_busy(command: Callable[[], Awaitable[Any]]) -> Any:
    """``command()``'s reply, sent again while Redis refuses it for now (-BUSY, -LOADING: it did
    not run), as keyserial's own commands wait out the nemesis's error-reply faults."""
    while True:
        try:
            return await command()
        except BusyLoadingError:
            pass
        except aredis.ResponseError as error:
            if not str(error).startswith("BUSY"):
                raise
        await anyio.sleep(0.05)


def garbage_entry(kind: str, op_id: str, key: str, elsewhere: str) -> tuple[str, str, bool]:
    """``(v, ops, answered)``: the fields of a garbage entry, and whether the wire format
    promises its op id a stored outcome."""

    def envelope(**fields: object) -> str:
        return json.dumps({"id": op_id, "key": key, "op": "append", "args": ["g"], **fields})

    if kind == "deep_nesting":
        nested = "[" * 3000 + "]" * 3000
        return "1", f'[{{"id":"{op_id}","key":"{key}","op":"append","args":{nested}}}]', False
    if kind == "invalid_json":
        return "1", envelope()[:-7], False
    if kind == "non_list":
        return "1", envelope(), False
    if kind == "lone_surrogate":  # a JSON escape that decodes to a str UTF-8 cannot carry
        return "1", f'[{{"id":"{op_id}","key":"{key}","op":"append","args":["\\ud83d"]}}]', True
    if kind == "bad_version":
        return "2", f"[{envelope()}]", False
    if kind == "bad_element":
        return "1", f"[42, {envelope()}]", True
    if kind == "misrouted":
        return "1", f"[{envelope(key=elsewhere)}]", True
    if kind == "unknown_op":
        return "1", f"[{envelope(op='no_such_op')}]", True
    raise ValueError(f"unknown garbage kind {kind!r}")


Injector = Callable[[Faults, int, FaultEvent], Awaitable[None]]

INJECTORS: dict[str, Injector] = {
    "kill9": kill9,
    "kill9_mid_commit": kill9_mid_commit,
    "sigstop": sigstop,
    "sigterm_slow": sigterm_slow,
    "redis_restart": redis_restart,
    "net_reset": net_reset,
    "net_blackhole": net_blackhole,
    "net_delay": net_delay,
    "garbage": garbage,
    "redis_busy": redis_busy,
    "redis_loading": redis_loading,
    "sub_drop": sub_drop,
    "master_kill9": cluster_faults.master_kill9,
    "master_pause": cluster_faults.master_pause,
    "master_lost_ahead": cluster_faults.master_lost_ahead,
    "clock_skew": cluster_faults.clock_skew,
    "forge": hostile.forge,
    "reshard": reshard,
}
