"""The seeded plan of a run: topology, fault events and their parameters.

Everything a run does at random is drawn from ``random.Random`` instances derived from the
seed, so a seed replays the same faults at the same offsets and every caller draws the same ops
(only the interleaving, set by the machine's timing, differs between runs of one seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

#: Fault kinds a plan draws from, with their weights. A new kind needs an entry here, a
#: parameter drawer in ``_PARAMS`` and an injector registered in ``faults.INJECTORS``.
FAULT_WEIGHTS: dict[str, int] = {
    "kill9": 3,
    "sigstop": 3,
    "sigterm_slow": 3,
    "redis_restart": 2,
    "net_reset": 2,
    "net_blackhole": 2,
    "net_delay": 2,
    "garbage": 2,
}

#: Faults at the edges of what Redis and the network do besides answering or failing a
#: connection: error replies (a script keeping Redis BUSY, a restart LOADING its dataset) and a
#: subscription dropped without a word. A plan draws them from a stream of their own, after the
#: others, so adding them left every seed's earlier faults as they were.
EDGE_FAULT_WEIGHTS: dict[str, int] = {
    "redis_busy": 2,
    "redis_loading": 1,
    "sub_drop": 2,
}

#: A byzantine client (``hostile.forge``): forged pushes, grants and decision notices, published
#: as the documented client ACL user, garbage and copies pushed to inboxes, and writes the ACL
#: must refuse. Drawn from a stream of its own, after the others, so that
#: adding it left every seed's earlier faults as they were.
HOSTILE_FAULT_WEIGHTS: dict[str, int] = {
    "forge": 1,
}

#: A live reshard (``keyserial reshard``) to another shard count, sometimes interrupted and run
#: again. Drawn from a stream of its own, after the others (the reshard profile only).
RESHARD_FAULT_WEIGHTS: dict[str, int] = {
    "reshard": 1,
}

#: A worker killed -9 mid-commit: the one holding the most shards, as payments between those
#: shards commit (``faults.kill9_mid_commit``). Drawn from a stream of its own, after the
#: others, so adding it left every seed's earlier faults as they were.
COMMIT_KILL_FAULT_WEIGHTS: dict[str, int] = {
    "kill9_mid_commit": 1,
}

#: The shard counts a reshard moves to (from the profile's 6, or from the last move's).
RESHARD_COUNTS = (2, 3, 4, 5, 8, 9, 12, 16)

#: The cluster profile's kinds: worker faults, and faults of the cluster's nodes and clocks in
#: place of the proxy and single-server ones (a proxy cannot stand between a cluster client and
#: the nodes its redirections name).
CLUSTER_FAULT_WEIGHTS: dict[str, int] = {
    "kill9": 2,
    "sigstop": 2,
    "sigterm_slow": 2,
    "garbage": 1,
    "master_kill9": 3,
    "master_pause": 4,
    "clock_skew": 2,
}

#: The takeover profile's kinds: a master lost ahead of its replica, which takes over at once,
#: within a lease (the cluster profile's failovers all outlast its lease), with a few worker and
#: node faults around it.
TAKEOVER_FAULT_WEIGHTS: dict[str, int] = {
    "kill9": 1,
    "sigterm_slow": 1,
    "master_lost_ahead": 4,
    "master_pause": 1,
}

#: Foreign or broken stream entries the ``garbage`` fault appends (see ``faults.garbage_entry``).
GARBAGE_KINDS = (
    "deep_nesting",
    "invalid_json",
    "non_list",
    "lone_surrogate",
    "bad_version",
    "bad_element",
    "misrouted",
    "unknown_op",
)


@dataclass(frozen=True)
class Profile:
    """How long a run loads the system, how hard, and how many faults it injects."""

    name: str
    load_seconds: float
    faults: tuple[int, int]  # fewest, most
    callers: int = 24
    clients: int = 2
    workers: int = 3
    shard_count: int = 6
    lease_ttl: float = 1.0
    submit_timeout: float = 8.0
    #: After healing, every shard must commit a new op within this many seconds.
    liveness_bound: float = 5.0
    #: After healing, outcomes of unknown ops are polled for this long (never resubmitted).
    resolve_seconds: float = 15.0
    #: "standalone" (one durable server behind fault proxies) or "cluster" (3 masters with a
    #: replica each, see ``cluster_system``).
    topology: str = "standalone"
    #: The fault kinds drawn, with weights (empty: ``FAULT_WEIGHTS``).
    fault_weights: tuple[tuple[str, int], ...] = ()
    #: The ``durable_replicas`` setting of workers and clients (the cluster's masters have one
    #: replica each: with 1, a failover must lose no acknowledged op).
    durable_replicas: int = 0
    #: How many faults of ``EDGE_FAULT_WEIGHTS`` a run adds: fewest, most.
    edge_faults: tuple[int, int] = (0, 0)
    #: How many faults of ``HOSTILE_FAULT_WEIGHTS`` a run adds: fewest, most (standalone only:
    #: the forger's ACL user is set on the one server).
    hostile_faults: tuple[int, int] = (0, 0)
    #: Workers' and clients' ``health_interval``: a dropped subscription must be replaced
    #: within three times this, plus a second, while the load runs.
    health_interval: float = 1.0
    #: The share of counter and list ops a caller appends as a stale client would: a plain
    #: RPUSH to the inbox of the op's shard by the count the run started with, whatever moved
    #: since (a sealed or retired shard's too: no script checks the seal).
    stale_appends: float = 0.0
    #: How many faults of ``RESHARD_FAULT_WEIGHTS`` a run adds: fewest, most.
    reshard_faults: tuple[int, int] = (0, 0)
    #: How many faults of ``COMMIT_KILL_FAULT_WEIGHTS`` a run adds: fewest, most.
    commit_kills: tuple[int, int] = (0, 0)
    #: Shard counts a run reshards to, one after another, evenly spread over the load (besides
    #: any drawn ``reshard`` faults).
    reshard_path: tuple[int, ...] = ()
    #: Whether a tenth of the submits are cancelled by their callers. An op whose append a
    #: failover lost is appended again only while its submit waits: where faults lose appends
    #: by design (the takeover profile), every caller waits, so that every loss is a defect.
    callers_cancel: bool = True
    #: Callers of the timer workload (``timers.TimerLoad``: delayed ops, timers ops set, and
    #: cancels, on keys of their own), besides ``callers``; each draws from a stream of its
    #: own, so turning them on left every other draw of a seed as it was.
    timer_callers: int = 0
    #: The longest pause, in seconds, of a timer caller between two of its ops.
    timer_pause: float = 0.3


LONG = Profile(
    "long",
    load_seconds=18.0,
    faults=(5, 9),
    edge_faults=(1, 3),
    hostile_faults=(1, 2),
    commit_kills=(0, 1),
    timer_callers=2,
)

PROFILES = {
    "short": Profile("short", load_seconds=7.0, faults=(2, 4), edge_faults=(0, 2)),
    # The short profile with a byzantine client in every run (see ``hostile.forge``).
    "hostile": Profile(
        "hostile", load_seconds=7.0, faults=(2, 4), edge_faults=(0, 2), hostile_faults=(1, 1)
    ),
    "long": LONG,
    # The long profile with one or two live reshards in every run.
    # (No kill mid-commit: it finds the busiest worker by the first layout's leases.)
    # (Neither it nor resize runs the timer workload: each runs as it did before it came.)
    "reshard": replace(
        LONG,
        name="reshard",
        reshard_faults=(1, 2),
        stale_appends=0.1,
        commit_kills=(0, 0),
        timer_callers=0,
    ),
    # 4 -> 16 -> 64 -> 8 shards under the long profile's load and faults.
    "resize": replace(
        LONG,
        name="resize",
        load_seconds=24.0,
        shard_count=4,
        reshard_path=(16, 64, 8),
        stale_appends=0.1,
        commit_kills=(0, 0),
        timer_callers=0,
    ),
    # The long profile's load and faults, with eight timer callers: delayed ops, timers ops
    # set and cancels (``timers.TimerLoad``, judged by ``checkers.check_timers``).
    "timers": replace(LONG, name="timers", timer_callers=8, timer_pause=0.1),
    "cluster": Profile(
        "cluster",
        load_seconds=20.0,
        faults=(2, 4),
        callers=12,
        topology="cluster",
        fault_weights=tuple(CLUSTER_FAULT_WEIGHTS.items()),
        durable_replicas=1,
        # Every payment takes the grant protocol on a cluster, within one worker too.
        commit_kills=(1, 1),
    ),
    # Leases of 6 s outlive a TAKEOVER: owners keep their shards across the failover.
    "takeover": Profile(
        "takeover",
        load_seconds=20.0,
        faults=(2, 4),
        callers=12,
        topology="cluster",
        fault_weights=tuple(TAKEOVER_FAULT_WEIGHTS.items()),
        durable_replicas=1,
        lease_ttl=6.0,
        submit_timeout=30.0,
        liveness_bound=12.0,
        callers_cancel=False,
    ),
}
# The cluster profile's failovers (with ``durable_replicas``) and faults, with four timer callers.
PROFILES["cluster-timers"] = replace(PROFILES["cluster"], name="cluster-timers", timer_callers=4)


@dataclass(frozen=True)
class FaultEvent:
    """One fault: ``kind`` at ``at`` seconds into the load, against ``target``."""

    at: float
    kind: str
    #: "worker:<slot>", "worker:most-shards", "client:<n>", "redis", "shard:<n>", "cluster",
    #: "forger", "layout"
    target: str
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        args = ", ".join(f"{name}={_short(value)}" for name, value in sorted(self.params.items()))
        return f"t={self.at:6.2f}s {self.kind:<14} {self.target:<10} {args}"


@dataclass(frozen=True)
class Plan:
    seed: int
    profile: Profile
    #: Shards each worker slot serves (a replacement in a slot serves the same ones).
    layouts: tuple[tuple[int, ...], ...]
    events: tuple[FaultEvent, ...]

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}, profile {self.profile.name}: "
            f"{self.profile.workers} workers over {self.profile.shard_count} shards, "
            f"lease {self.profile.lease_ttl}s, load {self.profile.load_seconds}s"
        ]
        lines += [
            f"  worker:{slot} serves shards {list(shards)}"
            for slot, shards in enumerate(self.layouts)
        ]
        lines += [f"  {event.describe()}" for event in self.events]
        return "\n".join(lines)


def rng_for(seed: int, stream: str) -> random.Random:
    """An independent generator per purpose (plan, caller n), so adding a caller or a fault kind
    does not shift every other draw of the seed."""
    return random.Random(f"{seed}:{stream}")


def make_plan(seed: int, profile: Profile) -> Plan:
    rng = rng_for(seed, "plan")
    layouts = _layouts(rng, profile)
    count = rng.randint(*profile.faults)
    table = dict(profile.fault_weights) or FAULT_WEIGHTS
    events = _draw(rng, profile, count, table)
    edges = rng_for(seed, "plan:edges")
    events += _draw(edges, profile, edges.randint(*profile.edge_faults), EDGE_FAULT_WEIGHTS)
    hostile = rng_for(seed, "plan:hostile")
    events += _draw(
        hostile, profile, hostile.randint(*profile.hostile_faults), HOSTILE_FAULT_WEIGHTS
    )
    moves = rng_for(seed, "plan:reshard")
    events += _draw(moves, profile, moves.randint(*profile.reshard_faults), RESHARD_FAULT_WEIGHTS)
    kills = rng_for(seed, "plan:commit-kill")
    events += _draw(kills, profile, kills.randint(*profile.commit_kills), COMMIT_KILL_FAULT_WEIGHTS)
    events += _path(profile)
    events.sort(key=lambda event: event.at)
    return Plan(seed, profile, layouts, tuple(events))


def _draw(
    rng: random.Random, profile: Profile, count: int, table: dict[str, int]
) -> list[FaultEvent]:
    kinds = list(table)
    weights = [table[kind] for kind in kinds]
    events = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        at = round(rng.uniform(0.1, 0.8) * profile.load_seconds, 2)
        target, params = _PARAMS[kind](rng, profile)
        events.append(FaultEvent(at, kind, target, params))
    return events


def _path(profile: Profile) -> list[FaultEvent]:
    """The profile's fixed reshards, evenly spread over the middle of the load."""
    steps = len(profile.reshard_path)
    return [
        FaultEvent(
            round(profile.load_seconds * (0.15 + 0.6 * n / steps), 2),
            "reshard",
            "layout",
            {"to": to, "interrupt_after": None, "resume_after": 0.0},
        )
        for n, to in enumerate(profile.reshard_path)
    ]


def _layouts(rng: random.Random, profile: Profile) -> tuple[tuple[int, ...], ...]:
    """Overlapping shard lists: every shard served by at least one slot, most by two or more."""
    shards = range(profile.shard_count)
    layouts = [
        set(rng.sample(shards, rng.randint(2, profile.shard_count))) for _ in range(profile.workers)
    ]
    for shard in shards:
        holders = [slot for slot, layout in enumerate(layouts) if shard in layout]
        if len(holders) < 2:
            others = [slot for slot in range(profile.workers) if slot not in holders]
            for slot in rng.sample(others, min(len(others), 2 - len(holders))):
                layouts[slot].add(shard)
    return tuple(tuple(sorted(layout)) for layout in layouts)


def _worker(rng: random.Random, profile: Profile) -> str:
    return f"worker:{rng.randrange(profile.workers)}"


def _link(rng: random.Random, profile: Profile) -> str:
    if rng.random() < 0.6:
        return _worker(rng, profile)
    return f"client:{rng.randrange(profile.clients)}"


def _kill9(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return _worker(rng, profile), {"restart_after": round(rng.uniform(0.0, 2.0), 2)}


def _kill9_mid_commit(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """``pairs`` pairs of fresh accounts, each across two shards of the worker holding the most
    shards when it fires, paying back and forth ``rounds`` times; that worker killed -9 as the
    ``kill_after``-th payment is acknowledged, and replaced ``restart_after`` seconds later."""
    return "worker:most-shards", {
        "pairs": rng.randint(12, 20),
        "rounds": 6,
        "kill_after": rng.randint(8, 40),
        "restart_after": round(rng.uniform(0.0, 2.0), 2),
    }


def _sigstop(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    paused = round(profile.lease_ttl * rng.uniform(1.5, 3.5), 2)
    return _worker(rng, profile), {"paused": paused}


def _sigterm(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return _worker(rng, profile), {
        "slow_ops": rng.randint(4, 16),
        "slow_delay": round(rng.uniform(0.3, 2.5), 2),
        "restart_after": round(rng.uniform(0.0, 1.5), 2),
    }


def _redis(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return "redis", {"down_for": round(rng.uniform(0.1, 2.0), 2)}


def _reset(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return _link(rng, profile), {"times": rng.randint(1, 3)}


def _blackhole(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return _link(rng, profile), {
        "held": round(rng.uniform(0.3, 3.0), 2),
        "then_reset": rng.random() < 0.5,
    }


def _delay(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return _link(rng, profile), {
        "delay": round(rng.uniform(0.005, 0.3), 3),
        "lasting": round(rng.uniform(1.0, 4.0), 2),
    }


def _garbage(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    return f"shard:{rng.randrange(profile.shard_count)}", {"entry": rng.choice(GARBAGE_KINDS)}


def _busy(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A Lua script that keeps Redis busy past its (lowered) busy threshold: -BUSY meanwhile."""
    return "redis", {"busy_for": round(rng.uniform(0.3, 1.5), 2)}


def _loading(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A restart that loads ``filler`` keys ``per_key_us`` µs each: -LOADING meanwhile."""
    return "redis", {"filler": 1500, "per_key_us": rng.randrange(300, 1000, 100)}


def _sub_drop(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """The subscriptions on a link go quiet for good (a NAT forgot them): no FIN, no RST."""
    return _link(rng, profile), {}


def _master(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A master (the one serving a slot range when it fires), restarted after its failover."""
    return "cluster", {
        "slot_range": rng.randrange(3),
        "restart_after": round(rng.uniform(0.0, 3.0), 2),
    }


def _master_pause(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A master stopped until its replica is promoted, and ``past_failover`` seconds more."""
    return "cluster", {
        "slot_range": rng.randrange(3),
        "past_failover": round(rng.uniform(0.0, 3.0), 2),
    }


def _master_lost_ahead(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A master that commits ``lag`` seconds with its replica cut off, then dies; the replica
    takes over at once, and the old master is restarted ``restart_after`` seconds later."""
    return "cluster", {
        "slot_range": rng.randrange(3),
        "lag": round(rng.uniform(1.2, 3.0), 2),
        "restart_after": round(rng.uniform(0.5, 3.0), 2),
    }


def _clock_skew(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A worker replaced by one whose wall clock is off by minutes, either way."""
    minutes = rng.choice((-1, 1)) * rng.randint(2, 30)
    return _worker(rng, profile), {"skew_minutes": minutes}


def _forge(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A byzantine client forging messages every ``every`` seconds for ``lasting`` seconds."""
    return "forger", {
        "lasting": round(rng.uniform(1.0, 3.0), 2),
        "every": round(rng.uniform(0.02, 0.1), 3),
    }


def _reshard(rng: random.Random, profile: Profile) -> tuple[str, dict[str, Any]]:
    """A move to ``to`` shards (one more if the namespace has that many then); interrupted
    (cancelled: a Ctrl-C) ``interrupt_after`` seconds in, if not None, and run again
    ``resume_after`` seconds later."""
    interrupted = rng.random() < 0.5
    return "layout", {
        "to": rng.choice(RESHARD_COUNTS),
        "interrupt_after": round(rng.uniform(0.0, 0.6), 2) if interrupted else None,
        "resume_after": round(rng.uniform(0.0, 1.5), 2),
    }


_PARAMS = {
    "kill9": _kill9,
    "kill9_mid_commit": _kill9_mid_commit,
    "sigstop": _sigstop,
    "sigterm_slow": _sigterm,
    "redis_restart": _redis,
    "net_reset": _reset,
    "net_blackhole": _blackhole,
    "net_delay": _delay,
    "garbage": _garbage,
    "redis_busy": _busy,
    "redis_loading": _loading,
    "sub_drop": _sub_drop,
    "master_kill9": _master,
    "master_pause": _master_pause,
    "master_lost_ahead": _master_lost_ahead,
    "clock_skew": _clock_skew,
    "forge": _forge,
    "reshard": _reshard,
}


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
