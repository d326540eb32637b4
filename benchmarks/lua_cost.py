"""What the two scripts on every op's path cost Redis per call: ``python -m benchmarks.lua_cost``.

Throughput and CPU per op move by 10% and more between runs on a shared machine; the time Redis
spends in one script call does not move as much, and it is what a change to ``submit.lua`` or
``step.lua`` changes first. So this calls each script, in the shapes a uniform load and a hot key
send, ``--calls`` times on a private server with nothing else running, and prints one JSON row
per shape: the server's microseconds per call (``INFO commandstats``, the script's own commands
included) and, apart, those of the commands it ran, and how many of each it ran per call.

The shapes, in the order run (one namespace, one shard, so the results hash grows as in a run):

- ``submit``: an entry of ``--ops`` fresh ops pushed to the shard's inbox and in its wake-up
  (``1`` and ``32``);
- ``step, idle``: a step that commits and fetches nothing;
- ``step, commit``: a step committing ``--ops`` ops (states, outcomes, progress), no push;
- ``step, confirm``: a step confirming one pushed entry of ``--ops`` ops at the head of the
  inbox, taking it out and committing its ops (done with that step, it is appended nowhere), as
  an owner fed by pushes sends (the entries pushed beforehand, one step each);
- the same after a reshard: the shard in the next layout generation, each committed op also
  looked up in its shard of the layout before (whose results the steps above filled).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import redis

from keyserial._scripts.calls import ScriptCall, decoded
from keyserial._scripts.commit import StepArgs, StepCommit, step
from keyserial._scripts.submit import Pushed, SubmitArgs, submit
from keyserial._wire.codec import WIRE_VERSION, encode_envelope, inbox_item, pack_entry
from keyserial._wire.json_text import dumps
from keyserial._wire.layout import ShardKeys
from keyserial.ledger import deposit
from keyserial.testing import LocalServer

EPOCH = 1
#: Sent by the pipeline per round trip: the client's overhead stays off the server's figures.
CHUNK = 500


def envelope(op_id: str, key: str) -> str:
    """A deposit's envelope, as the client encodes it."""
    return encode_envelope(op_id, key, deposit(1), "ks:bench:reply:0")


def op_id(n: int) -> str:
    """An id in the form keyserial's clients generate."""
    return f"svc.{'0' * 32}-{n:017x}"


def submit_call(shard: ShardKeys, ops: Sequence[str]) -> ScriptCall[Pushed]:
    args = SubmitArgs(
        max_backlog=0,
        wire_version=WIRE_VERSION,
        ops=pack_entry(ops),
        wake_channel=shard.wake(False),
        fresh=True,
    )
    return submit(shard, args)


#: The steps' cursor: past every entry they move in (an owner's cursor stands at the last
#: entry it moved in or fetched, and a step refuses pushed items that would overtake one after it).
CURSOR = "9999999999999-0"


def step_call(
    shard: ShardKeys,
    *,
    commit: StepCommit | None = None,
    progress: str = "",
    pushed: tuple[str, bytes] | None = None,
    earlier: Sequence[tuple[ShardKeys, Sequence[str]]] = (),
) -> ScriptCall[Any]:
    """A step of owner ``EPOCH`` that fetches nothing; ``pushed``: (``<place> <keep>``, the
    item as pushed) of one pushed entry it confirms and takes out of the inbox; ``earlier``:
    shards of the layout before a reshard, each with the committed op ids to look up there."""
    args = StepArgs(
        epoch=EPOCH,
        progress=progress,
        rotate=False,
        cursor=CURSOR,
        fetch=0,
        replaying=False,
        result_ttl_ms=3_600_000,
        trim_to="",
        trim_now=False,
        states_held=True,
    )
    items: list[bytes] = []
    if pushed is not None:
        args.pushed, item = pushed
        items = [item]
    return step(shard, args, earlier=earlier, pushed=items, commit=commit)


def commit_of(first: int, ops: int) -> StepCommit:
    """A step's commit of ``ops`` deposits: each key's new state and each op's outcome."""
    ids = range(first, first + ops)
    states = [(f"acct:{n % 10_000}", str(n)) for n in ids]
    outcomes = [(op_id(n), dumps({"ok": n})) for n in ids]
    return StepCommit.of(states, outcomes)


class Server:
    """The private server, with the scripts' time read apart for each shape."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._loaded: set[str] = set()

    def run(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        for call in calls[:1]:
            if call.script.sha not in self._loaded:
                self.client.script_load(call.script.text)
                self._loaded.add(call.script.sha)
        replies: list[Any] = []
        for start in range(0, len(calls), CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for call in calls[start : start + CHUNK]:
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
            replies += pipe.execute(raise_on_error=True)
        return replies

    def measured(self, shape: str, calls: Sequence[ScriptCall[Any]]) -> dict[str, Any]:
        self.run(calls[:1])  # (loads the script: its load stays out of the figures)
        self.client.config_resetstat()
        self.run(calls[1:])
        stats: dict[str, dict[str, float]] = self.client.info("commandstats")  # type: ignore[assignment]
        script = stats.pop("cmdstat_evalsha")
        stats.pop("cmdstat_config|resetstat", None)
        ran = {name.removeprefix("cmdstat_"): stat for name, stat in stats.items()}
        per_call = {name: stat["usec"] / script["calls"] for name, stat in ran.items()}
        return {
            "shape": shape,
            "calls": int(script["calls"]),
            "us_per_call": round(script["usec_per_call"], 2),
            "commands_us_per_call": {
                name: round(us, 2) for name, us in sorted(per_call.items(), key=lambda kv: -kv[1])
            },
            "commands_per_call": {
                name: round(stat["calls"] / script["calls"], 2)
                for name, stat in sorted(ran.items())
            },
        }


def shapes(server: Server, shard: ShardKeys, calls: int, ops: int) -> list[dict[str, Any]]:
    rows = []
    numbered = iter(range(10**9))

    def entries(count: int) -> list[list[str]]:
        return [
            [envelope(op_id(n := next(numbered)), f"acct:{n % 10_000}") for _ in range(ops)]
            for _ in range(count)
        ]

    rows.append(
        server.measured(f"submit, {ops} ops", [submit_call(shard, e) for e in entries(calls)])
    )
    rows.append(server.measured("step, idle", [step_call(shard) for _ in range(calls)]))
    first = 10**8
    committing = [step_call(shard, commit=commit_of(first + i * ops, ops)) for i in range(calls)]
    rows.append(server.measured(f"step, commit {ops} ops", committing))
    confirm = f"step, confirm 1 pushed entry of {ops} ops"
    steps = confirming(server, shard, entries(calls), 2 * first, ops)
    rows.append(server.measured(confirm, steps))
    # After a reshard: the same shard in the next layout generation, and each committed op
    # looked up in its old shard's results (which hold as many outcomes as the first steps
    # stored), as the step does for twice result_ttl after the move.
    moved = ShardKeys(shard.namespace, shard.shard, shard.generation + 1)
    server.client.set(moved.epoch, EPOCH)
    steps = confirming(server, moved, entries(calls), 3 * first, ops, earlier=shard)
    rows.append(server.measured(f"{confirm}, after a reshard", steps))
    return rows


def confirming(
    server: Server,
    shard: ShardKeys,
    appended: list[list[str]],
    first: int,
    ops: int,
    earlier: ShardKeys | None = None,
) -> list[ScriptCall[Any]]:
    """One step per entry of ``appended``, each confirming its pushed entry (the next item of
    the inbox), taking it out of the inbox and committing its ops (done: it goes nowhere). The
    entries are pushed here, unmeasured."""
    server.client.delete(shard.stream, shard.inbox, shard.inbox_taken)
    pushes = [submit_call(shard, e) for e in appended]
    places = [pushed.place for pushed in decoded(pushes, server.run(pushes))]
    steps = []
    for i, (place, ops_of) in enumerate(zip(places, appended, strict=True)):
        item = inbox_item(pack_entry(ops_of), fresh=True).encode()
        committed = [op_id(first + i * ops + n) for n in range(ops)]
        steps.append(
            step_call(
                shard,
                commit=commit_of(first + i * ops, ops),
                pushed=(f"{place} 0", item),
                earlier=[] if earlier is None else [(earlier, committed)],
            )
        )
    return steps


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lua_cost", description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000, help="script calls per shape")
    parser.add_argument("--ops", default="1,32", help="ops per entry and per step, comma-separated")
    options = parser.parse_args(argv)
    with LocalServer() as local:
        client = redis.Redis.from_url(local.url)
        server = Server(client)
        for ops in (int(n) for n in options.ops.split(",")):
            client.flushall()
            shard = ShardKeys(f"luacost{ops}", 0)
            client.set(shard.epoch, EPOCH)
            for row in shapes(server, shard, options.calls, ops):
                out(json.dumps(row))
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
