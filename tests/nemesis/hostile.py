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

It follows the reshard: each round it reads the namespace's layout records (the live layout,
a move's target, the layouts before it) and the streams of all of them, and

- appends grant requests for the run's accounts and lists to participant shards of every
  layout, live, sealed or retired: unsigned ones (or signed with another request's signature)
  under guessed attempts (those it saw, one either side, small numbers), and copies of genuine
  signed ones it read, to the same stream, to another shard, to another generation's shard, or
  with another attempt. Taken, one would hold its keys until the home shard changed owner:
  every key it named (``BaseSystem.forged_keys``) must answer an op after healing;
- appends to a shard of an older layout (or, with none, to another shard of the live one) an
  op under a victim's op id and reply channel, but with a key that routes elsewhere (a
  misrouted op), under the victim's own entry id where the stream allows it (else the largest
  id there is): the owner's signed refusal then names an entry id the victim also has, and a
  refusal stored under its id would answer the victim's op, which would then never run;
- publishes forged unsigned replies to the victims that name shards of older generations.

Everything goes to the test's own Redis on 127.0.0.1, and stops after the event's ``lasting``
seconds (at most :data:`MAX_APPENDS` entries appended by one event).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import anyio
import redis.asyncio as aredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from keyserial._wire.codec import LARGEST_ID
from keyserial._wire.layout import Layout, ShardKeys, shard_name
from keyserial._wire.resharding import LayoutRecord
from keyserial._wire.routing import home_shard, shard_for
from tests.helpers import keys_on_shard
from tests.nemesis.schedule import FaultEvent, rng_for
from tests.users import documented_rules

if TYPE_CHECKING:
    from tests.nemesis.faults import Faults
    from tests.nemesis.workloads import Keys

GRANT_OP = "keyserial.grant"
#: The forger's Redis user: the documented client user's rules (docs/deployment.md).
CLIENT_USER = "ks-nemesis-client"
#: What a forged decision or grant says a key holds: a list with a tag nobody submitted, or an
#: account with money from nowhere (both kinds of key are in every run).
FORGED_LIST = json.dumps(["forged"])
FORGED_ACCOUNT = json.dumps({"balance": 1_000_000, "ops": ["forged"]})
#: How often a round also appends a real op again as ``fresh`` (each costs its shard's owner a
#: restart, so not every round).
REPLAY_CHANCE = 0.2
#: The submit script, as a foreign client sends it (docs/wire-format.md).
SUBMIT_SCRIPT = resources.files("keyserial._scripts").joinpath("lua/submit.lua").read_text()
#: Grant requests (forged or copied) one round appends, at most.
REQUESTS_PER_ROUND = 3
#: How often a round appends a misrouted op under a victim's id, and publishes replies naming
#: an older generation's shard.
MISROUTED_CHANCE = 0.5
OLD_REPLY_CHANCE = 0.5
#: Entries one ``forge`` event appends in all (grant requests and misrouted ops), at most.
MAX_APPENDS = 150
#: Streams of layouts other than the live one read per round, at most (the live one's, all).
OTHER_STREAMS_READ = 16
#: Entries read per stream.
ENTRIES_READ = 100
#: What the forger remembers of what it read (the latest).
REMEMBERED = 64


async def forge(faults: Faults, number: int, event: FaultEvent) -> None:
    """Forge messages every ``every`` seconds for ``lasting`` seconds, as the client user."""
    system = faults.system
    password = uuid.uuid4().hex
    port = system.server.port  # type: ignore[attr-defined]
    rng = rng_for(system.plan.seed, f"forge:{number}")
    attacker = aredis.Redis.from_url(
        f"redis://{CLIENT_USER}:{password}@127.0.0.1:{port}/0", socket_timeout=5
    )
    forger = Forger(
        attacker,
        system.namespace,
        rng,
        rng_for(system.plan.seed, f"forge:{number}:layouts"),
        faults.load.keys,
        system.forged_keys,
    )
    sent = refused = 0
    user = False
    try:
        with anyio.move_on_after(event.params["lasting"]):
            while True:
                try:
                    if not user:
                        await _client_user(system.inspector, password)
                        user = True
                    sent += await forger.round()
                except NoPermissionError:
                    raise  # the forger tried what the client ACL does not allow: a bug here
                except AuthenticationError:  # a Redis restart forgot the user: set it again
                    user = False
                    refused += 1
                except RedisError:
                    refused += 1  # Redis down, BUSY or LOADING: a hostile client tries again
                await anyio.sleep(event.params["every"])
    finally:  # (the note first: the load's end may have cancelled the forger)
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.kinds.items()))
        missed = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.missed.items()))
        faults.note(
            f"forge: {sent} forged messages published as the client user"
            f" ({refused} rounds cut short by Redis); appended: {kinds or 'nothing'}"
            f" (not appended: {missed or 'none'}); {len(system.forged_keys)} keys targeted"
            " so far"
        )
        with anyio.CancelScope(shield=True):
            await attacker.aclose()


async def _client_user(admin: aredis.Redis, password: str) -> None:
    """Set the documented client user, with ``password`` (again after a Redis restart, which
    forgets it)."""
    own, *_ = documented_rules("client")
    rules = [rule.replace(">CLIENT_PASSWORD", f">{password}") for rule in own]
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", CLIENT_USER, "reset", *rules
    )


@dataclass(frozen=True)
class Seen:
    """An envelope read in a stream: where, under which entry id."""

    layout: Layout
    shard: int
    entry_id: str
    envelope: dict[str, Any]

    @property
    def keys(self) -> list[str]:
        envelope = self.envelope
        keys = envelope.get("keys") if "keys" in envelope else [envelope.get("key")]
        return [key for key in keys or [] if isinstance(key, str)]


class Forger:
    """One ``forge`` event's byzantine client, and what it has read so far."""

    def __init__(
        self,
        attacker: aredis.Redis,
        namespace: str,
        rng: random.Random,
        more: random.Random,
        keys: Keys,
        targeted: set[str],
    ) -> None:
        self.redis: Any = attacker  # (redis-py's asyncio stubs type replies as sync-or-async)
        self.namespace = namespace
        #: The draws of the forgeries on the live layout (as they were before the forger
        #: followed reshards), and of those that follow them.
        self.rng, self.more = rng, more
        #: The keys the run's load uses, which forged grant requests name.
        self.workload = sorted({*keys.accounts, *keys.lists})
        self.targeted = targeted
        #: What it appended, by kind; and what it tried to and could not.
        self.kinds: Counter[str] = Counter()
        self.missed: Counter[str] = Counter()
        self.requests: list[Seen] = []  # genuine (signed) grant requests
        self.victims: list[Seen] = []  # callers' ops in the streams of the layout new ops go to
        self.attempts: dict[tuple[int, int], set[int]] = {}  # (generation, home) -> attempts
        self.channels: dict[tuple[int, int], str] = {}  # (generation, home) -> coordinator's
        self.exhausted: set[str] = set()  # streams given the largest id
        self.own: set[str] = set()  # the envelopes it appended (JSON): never learned from

    async def round(self) -> int:
        """One round of forgeries: a push to a random shard, then a grant and a decision notice
        for every grant request in the streams, then what follows the reshard (see the module
        doc). How many messages were published or appended."""
        record = await self._layout_record()
        if record is None:
            return 0
        layout = record.live
        shard = layout.keys(self.rng.randrange(layout.shards))
        sent = await _forged_push(self.redis, layout, shard, self.rng)
        if self.rng.random() < REPLAY_CHANCE:
            sent += await _replayed_as_fresh(self.redis, shard, self.rng)
        sent += await _forged_replies(self.redis, shard, self.rng)
        requests = await self._read(record)
        # The workers' channels a client can learn: each grant request names its coordinator's.
        channels = {str(seen.envelope["kwargs"].get("channel")) for seen in requests}
        for seen in requests:
            sent += await _forged_coordination(self.redis, seen.shard, seen.envelope, channels)
        sent += await self._grant_requests(record)
        if self.more.random() < MISROUTED_CHANCE:
            sent += await self._misrouted(record)
        if self.more.random() < OLD_REPLY_CHANCE:
            sent += await self._old_generation_replies(record)
        return sent

    async def _layout_record(self) -> LayoutRecord | None:
        fields = await self.redis.hmget(
            f"ks:{{{self.namespace}}}:meta", ["shards", "generation", "move", "history"]
        )
        if fields[0] is None:
            return None
        return LayoutRecord.decode(self.namespace, *fields)

    # -- reading ---------------------------------------------------------------------------------

    async def _read(self, record: LayoutRecord) -> list[Seen]:
        """Read the streams of every shard of the live layout, and of a sample of the other
        layouts' (a move's target, those before): remember the genuine grant requests and the
        victims. Every grant request read (for the forged grants and notices)."""
        live = record.live
        streams = [(live, shard) for shard in range(live.shards)]
        others = [
            (layout, shard)
            for layout in _layouts(record)
            if layout != live
            for shard in range(layout.shards)
        ]
        streams += self.more.sample(others, min(len(others), OTHER_STREAMS_READ))
        async with self.redis.pipeline(transaction=False) as pipe:
            for layout, shard in streams:
                pipe.xrange(layout.keys(shard).stream, count=ENTRIES_READ)
            replies = await pipe.execute()
        requests: list[Seen] = []
        for (layout, shard), entries in zip(streams, replies, strict=True):
            for entry_id, fields in entries:
                for envelope in _envelopes(fields):
                    seen = Seen(layout, shard, entry_id.decode(), envelope)
                    own = _canonical(envelope) in self.own
                    if envelope.get("op") == GRANT_OP:
                        if isinstance(envelope.get("kwargs"), dict):
                            requests.append(seen)
                            if not own:
                                self._learn_request(seen)
                    elif (
                        not own
                        and layout == record.routing
                        and isinstance(envelope.get("id"), str)
                        and "#" not in envelope["id"]
                        and isinstance(envelope.get("reply"), str)
                        and seen.keys
                    ):
                        _remember(self.victims, seen)
        return requests

    def _learn_request(self, seen: Seen) -> None:
        request = seen.envelope["kwargs"]
        home, attempt = request.get("home"), request.get("attempt")
        if type(home) is not int or type(attempt) is not int:
            return
        where = (seen.layout.generation, home)
        self.attempts.setdefault(where, set()).add(attempt)
        if isinstance(request.get("channel"), str):
            self.channels[where] = request["channel"]
        if request.get("sig"):
            _remember(self.requests, seen)

    # -- grant requests --------------------------------------------------------------------------

    async def _grant_requests(self, record: LayoutRecord) -> int:
        """Up to :data:`REQUESTS_PER_ROUND` grant requests appended: forged, or copies of
        genuine ones (see the module doc)."""
        sent = 0
        for _ in range(self.more.randint(1, REQUESTS_PER_ROUND)):
            if self.kinds.total() >= MAX_APPENDS:
                break
            kind = self.more.choice(
                ("unsigned", "unsigned", "copy", "copy-elsewhere", "copy-other-generation")
            )
            if kind == "unsigned" or not self.requests:
                made = self._unsigned_request(record)
            else:
                made = self._copied_request(record, self.more.choice(self.requests), kind)
            if made is None:
                continue
            where, envelope, kind = made
            self.targeted.update(envelope["keys"])
            await self._append(where, [envelope], past_seal=True)
            self.kinds[f"grant request ({kind})"] += 1
            sent += 1
        return sent

    def _unsigned_request(
        self, record: LayoutRecord
    ) -> tuple[ShardKeys, dict[str, Any], str] | None:
        """A grant request no worker signed (or signed with the signature of another one), for
        workload keys of one participant shard of any layout, under a guessed attempt."""
        rng = self.more
        layout = rng.choice(_layouts(record))
        by_shard: dict[int, list[str]] = {}
        for key in self.workload:
            by_shard.setdefault(shard_for(key, layout.shards), []).append(key)
        participants = sorted(shard for shard in by_shard if shard > 0)
        if not participants:
            return None
        participant = rng.choice(participants)
        keys = rng.sample(by_shard[participant], min(len(by_shard[participant]), rng.randint(1, 2)))
        homes = [home for generation, home in self.attempts if generation == layout.generation]
        homes = [home for home in homes if home < participant] or list(range(participant))
        home = rng.choice(homes)
        victims = [seen.envelope["id"] for seen in self.victims if len(seen.keys) > 1]
        op_id = rng.choice(victims) if victims and rng.random() < 0.5 else _forged_id(rng)
        attempt = self._guessed_attempt(layout.generation, home)
        channel = self.channels.get((layout.generation, home)) or rng.choice(
            [*self.channels.values(), f"ks:{self.namespace}:worker:forged"]
        )
        request: dict[str, Any] = {
            "home": home,
            "op": op_id,
            "attempt": attempt,
            "channel": channel,
            "to": shard_name(participant, layout.generation),
            "at": int(time.time() * 1000),
        }
        kind = "unsigned"
        if self.requests and rng.random() < 0.3:  # a genuine signature, of another request
            other = rng.choice(self.requests).envelope["kwargs"]
            request |= {"k": other.get("k", ""), "sig": other.get("sig", "")}
            kind = "signature of another"
        envelope = {"id": f"{op_id}#{attempt}", "keys": keys, "op": GRANT_OP, "kwargs": request}
        return layout.keys(participant), envelope, kind

    def _copied_request(
        self, record: LayoutRecord, seen: Seen, kind: str
    ) -> tuple[ShardKeys, dict[str, Any], str] | None:
        """A genuine signed request again: to its own stream, to another shard of its layout
        above its home, to the same shard of another layout (or the next generation's, which
        no move has made yet), or with another attempt (its signature then covers another)."""
        rng, layout = self.more, seen.layout
        envelope = json.loads(json.dumps(seen.envelope))
        request = envelope["kwargs"]
        home = request.get("home")
        if kind == "copy" and rng.random() < 0.3:
            attempt = self._guessed_attempt(layout.generation, home)
            op_id = request.get("op")
            request["attempt"], envelope["id"] = attempt, f"{op_id}#{attempt}"
            return layout.keys(seen.shard), envelope, "copy, another attempt"
        if kind == "copy":
            return layout.keys(seen.shard), envelope, kind
        if kind == "copy-elsewhere":
            above = [shard for shard in range(layout.shards) if shard != seen.shard]
            above = [shard for shard in above if type(home) is not int or shard > home]
            return (layout.keys(rng.choice(above)), envelope, kind) if above else None
        generations = {each.generation: each for each in _layouts(record)}
        generations.pop(layout.generation, None)
        if record.move is None:
            newest = max([layout.generation, *generations])
            generations[newest + 1] = Layout(self.namespace, record.live.shards, newest + 1)
        other = generations[rng.choice(sorted(generations))]
        return other.keys(seen.shard % other.shards), envelope, kind

    def _guessed_attempt(self, generation: int, home: object) -> int:
        """The latest attempt seen in a genuine request of that home (its epoch now, likely:
        the one attempt a participant would hold keys for), another seen (of that home, or of
        any), one either side, or a small number."""
        rng = self.more
        seen = sorted(self.attempts.get((generation, home), set()) if type(home) is int else ())
        draw = rng.random()
        if seen and draw < 0.5:
            return seen[-1]
        seen = seen or sorted({attempt for each in self.attempts.values() for attempt in each})
        if seen and draw < 0.8:
            return max(0, rng.choice(seen) + rng.choice((-1, 0, 1)))
        return rng.randint(1, 6)

    # -- misrouted ops under a victim's id ---------------------------------------------------------

    async def _misrouted(self, record: LayoutRecord) -> int:
        """An op under a victim's op id and reply channel, with a key that routes elsewhere,
        appended to a shard of an older layout (or another shard of the live one, with none)
        under the victim's own entry id where the stream allows it, else (on an older layout's
        shard, once per stream) under the largest id there is."""
        if not self.victims or self.kinds.total() >= MAX_APPENDS:
            return 0
        rng = self.more
        if rng.random() < 0.5:  # (the newest: the likeliest id that another stream still takes)
            victim = max(self.victims, key=lambda seen: _order(seen.entry_id))
        else:
            victim = rng.choice(self.victims)
        older = [layout for layout in _layouts(record) if layout != record.routing]
        old = rng.choice(older) if older else record.routing
        shard = home_shard(victim.keys, old.shards)
        if not older:  # another shard of the layout new ops go to, one that takes the id
            others = [each for each in range(old.shards) if each != shard]
            below = await self._taking(old, others, victim.entry_id)
            if not below:
                self.missed["misrouted op: no other stream takes the victim's entry id"] += 1
                return 0
            shard = rng.choice(below)
        elsewhere = [key for key in self.workload if shard_for(key, old.shards) != shard]
        if not elsewhere:
            return 0
        key = rng.choice(elsewhere)
        envelope = {
            "id": victim.envelope["id"],
            "key": key,
            "op": "peek",  # (an op of the test apps; not one the stream tap follows)
            "args": [],
            "reply": victim.envelope["reply"],
        }
        if not await self._under_victims_id(old.keys(shard), envelope, victim, largest=bool(older)):
            return 0
        self.targeted.add(key)
        return 1

    async def _under_victims_id(
        self, where: ShardKeys, envelope: dict[str, Any], victim: Seen, *, largest: bool
    ) -> bool:
        """Append ``envelope`` under the victim's entry id, else (if ``largest``, once per
        stream) under the largest id; whether the stream took either."""
        for entry_id in (victim.entry_id, LARGEST_ID):
            if entry_id == LARGEST_ID and (not largest or where.stream in self.exhausted):
                break
            try:
                await self._append(where, [envelope], entry_id=entry_id)
            except NoPermissionError:
                raise
            except ResponseError:  # (the stream holds a larger id)
                continue
            if entry_id == LARGEST_ID:
                self.exhausted.add(where.stream)
            how = " (under the largest id)" if entry_id == LARGEST_ID else ""
            self.kinds[f"misrouted op under a victim's id{how}"] += 1
            return True
        self.missed["misrouted op: the stream took no id"] += 1
        return False

    async def _taking(self, layout: Layout, shards: list[int], entry_id: str) -> list[int]:
        """The shards of ``shards`` whose streams' last entries are below ``entry_id``."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.xrevrange(layout.keys(shard).stream, count=1)
            tops = await pipe.execute()
        return [
            shard
            for shard, top in zip(shards, tops, strict=True)
            if not top or _order(top[0][0].decode()) < _order(entry_id)
        ]

    async def _old_generation_replies(self, record: LayoutRecord) -> int:
        """Forged unsigned replies to a few victims, naming shards of older generations (or of
        the generation before the live one's, with none), and the victim's entry id."""
        if not self.victims:
            return 0
        rng = self.more
        older = [layout for layout in _layouts(record) if layout != record.routing]
        if not older:
            routing = record.routing
            older = [Layout(self.namespace, routing.shards, max(0, routing.generation - 1))]
        sent = 0
        for victim in rng.sample(self.victims, min(3, len(self.victims))):
            old = rng.choice(older)
            outcome = {
                **rng.choice(FORGED_OUTCOMES),
                "s": home_shard(victim.keys, old.shards),
                "g": old.generation,
                "e": [victim.entry_id],
            }
            message = {"v": 1, "r": [[victim.envelope["id"], outcome]]}
            await self.redis.publish(victim.envelope["reply"], json.dumps(message))
            sent += 1
        return sent

    # -- appending -------------------------------------------------------------------------------

    async def _append(
        self,
        where: ShardKeys,
        envelopes: list[dict[str, Any]],
        *,
        entry_id: str = "*",
        past_seal: bool = False,
    ) -> None:
        """Append an entry of ``envelopes`` and wake the shard's owner: under ``entry_id`` with
        XADD, or (``*``, now and then) with the submit script, past a seal if asked, fetched or
        pushed."""
        self.own.update(_canonical(envelope) for envelope in envelopes)
        ops = json.dumps(envelopes)
        if entry_id == "*" and self.more.random() < 0.3:
            fresh = "1" if self.more.random() < 0.5 else ""
            seal = "1" if past_seal else ""
            await self.redis.eval(
                SUBMIT_SCRIPT, 1, where.stream, 0, "1", ops, where.wake_channel, fresh, seal
            )
            return
        added = await self.redis.xadd(where.stream, {"v": "1", "ops": ops}, id=entry_id)
        await self.redis.publish(where.wake_channel, added)


def _layouts(record: LayoutRecord) -> list[Layout]:
    """The live layout, a move's target, and the layouts before (newest first)."""
    layouts = [record.live] + ([record.move.target] if record.move else [])
    layouts += [layout for layout, _ in reversed(record.history)]
    return list(dict.fromkeys(layouts))


def _envelopes(fields: dict[bytes, bytes]) -> list[dict[str, Any]]:
    try:
        envelopes = json.loads(fields.get(b"ops", b"[]"))
    except (ValueError, RecursionError):  # (garbage: the nemesis appends entries nested deep)
        return []
    if not isinstance(envelopes, list):
        return []
    return [each for each in envelopes if isinstance(each, dict)]


def _remember(seen: list[Seen], new: Seen) -> None:
    if any(each.entry_id == new.entry_id and each.envelope == new.envelope for each in seen):
        return
    seen.append(new)
    del seen[:-REMEMBERED]


def _canonical(envelope: dict[str, Any]) -> str:
    return json.dumps(envelope, sort_keys=True)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _forged_id(rng: random.Random) -> str:
    return f"forged-{rng.getrandbits(64):016x}"


async def _forged_push(attacker: Any, layout: Layout, keys: ShardKeys, rng: random.Random) -> int:
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


async def _replayed_as_fresh(attacker: Any, keys: ShardKeys, rng: random.Random) -> int:
    """An entry of the shard's stream (committed or not) appended again, its ops as they are
    but the entry marked ``fresh``: with the submit script, so it comes pushed, or a plain
    XADD, so it is fetched. 0 if the stream holds no op of a caller's."""
    ops = []
    for _, fields in await attacker.xrevrange(keys.stream, count=20):
        ops += [
            item
            for item in _envelopes(fields)
            if item.get("op") != GRANT_OP and isinstance(item.get("id"), str)
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
FORGED_OUTCOMES: tuple[dict[str, Any], ...] = (
    {"error": {"type": "keyserial.InsufficientFunds", "message": "forged"}},
    {"ok": ["forged"]},
    {"error": {"type": "keyserial.UnknownOperation", "message": "forged"}},
    {"error": "forged"},
)


async def _forged_replies(attacker: Any, keys: ShardKeys, rng: random.Random) -> int:
    """A forged reply for each of the last few ops in the shard's stream, on the reply
    channel its envelope names (a client may read the streams, and publish on replies)."""
    sent = 0
    for _, fields in await attacker.xrevrange(keys.stream, count=5):
        for item in _envelopes(fields):
            if isinstance(item.get("reply"), str):
                reply = [[item.get("id"), rng.choice(FORGED_OUTCOMES)]]
                await attacker.publish(item["reply"], json.dumps({"v": 1, "r": reply}))
                sent += 1
    return sent


async def _forged_coordination(
    attacker: Any, shard: int, envelope: dict[str, Any], channels: set[str]
) -> int:
    """A grant with made-up states to the request's coordinator, and a decision notice that
    writes made-up states to every worker channel the forger knows, alone and in a batch with
    the grant (as a worker sends what it owes another in one pipeline)."""
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
        await attacker.publish(channel, json.dumps({"t": "b", "m": [grant, notice]}))
    return 1 + 2 * len(channels)
