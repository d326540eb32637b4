"""The byzantine client: the ``forge`` fault. For a while, a client connected as the documented
client ACL user (docs/deployment.md) publishes forged messages on every channel it can name:
pushes on a shard's wake channel, and grants and decision notices for every grant request it
reads in the streams, on the workers' channels those requests name. Each forgery, if a
worker took it as an authority, would write a tag no caller submitted, or a balance out of
nowhere, which the usual checkers report. Now and then it also appends an op it reads in a
stream again, marked ``fresh`` (its id new, so the owner skips looking it up), fetched or
pushed: run twice, it would write a caller's tag twice, or move money twice. And it publishes
forged replies for the ops it reads in a stream, on their callers' reply channels: a caller
that took one would report an op applied that failed, or failed that applied, or return a
list its own writes are missing from.
"""

from __future__ import annotations

import json
import random
import uuid
from importlib import resources
from typing import TYPE_CHECKING, Any

import anyio
import redis.asyncio as aredis
from redis.exceptions import NoPermissionError, RedisError

from keyserial._wire.layout import Layout, ShardKeys
from tests.helpers import keys_on_shard
from tests.nemesis.schedule import FaultEvent, rng_for
from tests.test_acl import documented_rules

if TYPE_CHECKING:
    from tests.nemesis.faults import Faults

GRANT_OP = "keyserial.grant"
#: What a forged decision or grant says a key holds: a list with a tag nobody submitted, or an
#: account with money from nowhere (both kinds of key are in every run).
FORGED_LIST = json.dumps(["forged"])
FORGED_ACCOUNT = json.dumps({"balance": 1_000_000, "ops": ["forged"]})
#: How often a round also appends a real op again as ``fresh`` (each costs its shard's owner a
#: restart, so not every round).
REPLAY_CHANCE = 0.2
#: The submit script, as a foreign client sends it (docs/wire-format.md).
SUBMIT_SCRIPT = resources.files("keyserial._scripts").joinpath("lua/submit.lua").read_text()


async def forge(faults: Faults, number: int, event: FaultEvent) -> None:
    """Forge messages every ``every`` seconds for ``lasting`` seconds, as the client user."""
    system = faults.system
    url = await _client_user(system.inspector, system.server.port)  # type: ignore[attr-defined]
    rng = rng_for(system.plan.seed, f"forge:{number}")
    attacker = aredis.Redis.from_url(url, socket_timeout=5)
    sent = refused = 0
    try:
        with anyio.move_on_after(event.params["lasting"]):
            while True:
                try:
                    sent += await _round(attacker, system.namespace, rng)
                except NoPermissionError:
                    raise  # the forger tried what the client ACL does not allow: a bug here
                except RedisError:
                    refused += 1  # Redis down, BUSY or LOADING: a hostile client tries again
                await anyio.sleep(event.params["every"])
    finally:
        await attacker.aclose()
        faults.note(
            f"forge: {sent} forged messages published as the client user"
            f" ({refused} rounds cut short by Redis)"
        )


async def _client_user(admin: aredis.Redis, port: int) -> str:
    """The documented client user (again: a Redis restart forgets it), and its URL."""
    password = uuid.uuid4().hex
    own, *_ = documented_rules("client")
    rules = [rule.replace(">CLIENT_PASSWORD", f">{password}") for rule in own]
    await admin.execute_command("ACL", "SETUSER", "ks-nemesis-client", "reset", *rules)
    return f"redis://ks-nemesis-client:{password}@127.0.0.1:{port}/0"


async def _round(attacker: aredis.Redis, namespace: str, rng: random.Random) -> int:
    """One round of forgeries: a push to a random shard, then a grant and a decision notice
    for every grant request in the streams. How many messages were published. (The shards of
    the namespace's live layout, as a client reads it: a reshard fault may have moved it.)"""
    shards, generation = await attacker.hmget(f"ks:{{{namespace}}}:meta", "shards", "generation")
    layout = Layout(namespace, int(shards), int(generation or 0))
    shard = layout.keys(rng.randrange(layout.shards))
    sent = await _forged_push(attacker, layout, shard, rng)
    if rng.random() < REPLAY_CHANCE:
        sent += await _replayed_as_fresh(attacker, shard, rng)
    sent += await _forged_replies(attacker, shard, rng)
    requests = await _grant_requests(attacker, layout)
    # The workers' channels a client can learn: each grant request names its coordinator's.
    channels = {str(envelope["kwargs"].get("channel")) for _, envelope in requests}
    for requested_from, envelope in requests:
        sent += await _forged_coordination(attacker, requested_from, envelope, channels)
    return sent


async def _forged_push(
    attacker: aredis.Redis, layout: Layout, keys: ShardKeys, rng: random.Random
) -> int:
    """A push of an append no caller made, in one of three shapes: following on from the
    stream's last entry with a made-up id, naming an empty stream and the largest id, or naming
    the last real entry with other ops."""
    key = keys_on_shard(keys.shard, layout.shards, 1, "lst")[0]
    ops = json.dumps(
        [{"id": f"forged-{uuid.uuid4().hex}", "key": key, "op": "append", "args": ["forged"]}]
    )
    last = [entry_id.decode() for entry_id, _ in await attacker.xrevrange(keys.stream, count=2)]
    shape = rng.choice(("next", "largest", "swapped"))
    if shape == "largest" or not last:
        after, entry_id = "-", "99999999999999-0"
    elif shape == "swapped":
        entry_id, after = last[0], last[1] if len(last) > 1 else "-"
    else:
        ms, seq = map(int, last[0].split("-"))
        after, entry_id = last[0], f"{ms}-{seq + 1}"
    await attacker.publish(keys.wake_channel, f"push {after} {entry_id} 1\n{ops}")
    return 1


async def _replayed_as_fresh(attacker: aredis.Redis, keys: ShardKeys, rng: random.Random) -> int:
    """An entry of the shard's stream (committed or not) appended again, its ops as they are
    but the entry marked ``fresh``: with the submit script, so it comes pushed, or a plain
    XADD, so it is fetched. 0 if the stream holds no op of a caller's."""
    ops = []
    for _, fields in await attacker.xrevrange(keys.stream, count=20):
        try:
            envelopes = json.loads(fields.get(b"ops", b"[]"))
        except ValueError:
            continue
        ops += [
            item
            for item in envelopes
            if isinstance(item, dict)
            and item.get("op") != GRANT_OP
            and isinstance(item.get("id"), str)
        ]
    if not ops:
        return 0
    replayed = json.dumps([rng.choice(ops)])
    if rng.random() < 0.5:
        await attacker.eval(SUBMIT_SCRIPT, 1, keys.stream, 0, "1", replayed, keys.wake_channel, "1")
    else:
        await attacker.xadd(keys.stream, {"v": "1", "ops": replayed, "fresh": "1"})
    return 1


#: What a forged reply says: an op that failed, one that applied with a made-up value, one no
#: worker knew (recorded apart), and one that is not an outcome at all.
FORGED_OUTCOMES = (
    {"error": {"type": "keyserial.InsufficientFunds", "message": "forged"}},
    {"ok": ["forged"]},
    {"error": {"type": "keyserial.UnknownOperation", "message": "forged"}},
    {"error": "forged"},
)


async def _forged_replies(attacker: aredis.Redis, keys: ShardKeys, rng: random.Random) -> int:
    """A forged reply for each of the last few ops in the shard's stream, on the reply
    channel its envelope names (a client may read the streams, and publish on replies)."""
    sent = 0
    for _, fields in await attacker.xrevrange(keys.stream, count=5):
        try:
            envelopes = json.loads(fields.get(b"ops", b"[]"))
        except ValueError:
            continue
        for item in envelopes if isinstance(envelopes, list) else []:
            if isinstance(item, dict) and isinstance(item.get("reply"), str):
                reply = [[item.get("id"), rng.choice(FORGED_OUTCOMES)]]
                await attacker.publish(item["reply"], json.dumps({"v": 1, "r": reply}))
                sent += 1
    return sent


async def _grant_requests(
    attacker: aredis.Redis, layout: Layout
) -> list[tuple[int, dict[str, Any]]]:
    """Every grant request in the streams (a client may read them), with its shard."""
    found = []
    for shard in range(layout.shards):
        for _, fields in await attacker.xrange(layout.keys(shard).stream, count=200):
            try:
                envelopes = json.loads(fields.get(b"ops", b"[]"))
            except ValueError:
                continue
            found += [
                (shard, item)
                for item in envelopes
                if isinstance(item, dict)
                and item.get("op") == GRANT_OP
                and isinstance(item.get("kwargs"), dict)
            ]
    return found


async def _forged_coordination(
    attacker: aredis.Redis, shard: int, envelope: dict[str, Any], channels: set[str]
) -> int:
    """A grant with made-up states to the request's coordinator, and a decision notice that
    writes made-up states to every worker channel the forger knows."""
    request, keys = envelope["kwargs"], envelope.get("keys") or []
    states = [[key, FORGED_ACCOUNT if key.startswith("acct") else FORGED_LIST] for key in keys]
    grant = {
        "t": "g",
        "op": request.get("op"),
        "a": request.get("attempt"),
        "s": shard,
        "st": states,
        "f": 1,
        "c": "ks:forger",
    }
    notice = {
        "t": "d",
        "op": request.get("op"),
        "a": request.get("attempt"),
        "d": {"w": {str(shard): states}},
    }
    await attacker.publish(str(request.get("channel", "")), json.dumps(grant))
    for channel in channels:
        await attacker.publish(channel, json.dumps(notice))
    return 1 + len(channels)
