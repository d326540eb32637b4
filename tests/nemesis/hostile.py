"""The byzantine client: the ``forge`` fault. For a while, a client connected as the documented
client ACL user (docs/deployment.md) publishes forged messages on every channel it can name:
pushes on a shard's wake channel, grant requests on the workers' coordination channels, and
grants and decision notices for every grant request it hears of, on the workers' channels.
Each forgery, if a worker took it as an authority, would write a tag no caller submitted, a
balance out of nowhere, or hold keys nothing answers, which the usual checkers report. Now and
then it also pushes an op it reads in a stream again to the shard's inbox, marked ``fresh``
(its id new, so the owner skips looking it up), with the submit script or a plain ``RPUSH``,
fetched or pushed: run twice, it would write a caller's tag twice, or move money twice. And it
publishes forged replies for the ops it reads in a stream, on their callers' reply channels: a
caller that took one would report an op applied that failed, or failed that applied, or return
a list its own writes are missing from.

A client user writes no stream, only shards' inboxes, with ``RPUSH`` (docs/deployment.md). So
the forger's pushes (``push <place> <item>`` on a wake channel) name places that do not hold
their items: the inbox's next place (nothing there yet: an owner may run the op, and its next
step finds it missing), the place of an item waiting there (with other ops), a place already
moved into the stream, or one past a gap; now and then a message that is no item at all. It
pushes garbage to inboxes (items not of the documented form, another version, ops that are not
JSON: dead-lettered, none run). And every round it tries what the client ACL must refuse: an
``XADD`` to a stream (with ``MAXLEN 0``, under the largest id, under an explicit id, plain),
``LPUSH``, ``LTRIM`` and ``DEL`` of an inbox, ``DEL`` of a stream, also from inside a script
of its own. Each must be refused (``NOPERM``, counted); one accepted is a violation
(``Faults.acl_breaches``).

The workers' channels are no secret the design leans on: a shard's lease holds its owner's
(``_wire.layout.owner_channel``), and every operator's ``keyserial status`` shows who that is.
The client user may not GET a lease, so the forger reads them through the run's inspector, as
one told the names would, and subscribes to them as the client user (which it may): it hears
what the workers send each other, signed for each other, and learns the attempts and keys of
the genuine grant requests there.

It follows the reshard: each round it reads the namespace's layout records (the live layout,
a move's target, the layouts before it), the leases of the layouts workers serve, and the
streams of all of them, and

- publishes grant request items on the workers' channels, to the owner of the participant
  shard they name (or another worker): made up (under guessed attempts, for keys of the
  shard or of another, for another shard or generation, made hours ago), or a genuine one
  heard on a channel with its signature left off, each alone, in a batch with a forged
  grant, or under a forged signature (a listed signer's id, a made-up tag);
- publishes again, later, a signed message it heard (a worker's grant requests, grants or
  notices for another): on its own channel (a genuine request sent again: a worker takes it,
  and holds nothing for an attempt whose part is over there), on another worker's, or with a
  byte of it changed. Taken as an authority, any of these would hold keys until the home
  shard changed owner: every key it named (``BaseSystem.forged_keys``) must answer an op
  after healing;
- pushes ``keyserial.grant`` ops to participant shards of every layout, live, sealed or
  retired (as coordinators of an earlier version appended their requests; with a plain
  ``RPUSH`` where the submit script refuses a sealed shard): made up under
  guessed attempts, and copies of the genuine requests it heard, to their own shard, to
  another, to another generation's, or with another attempt. Workers refuse every one as a
  reserved name: taken, one would hold its keys (checked as above);
- pushes to a shard of an older layout (or, with none, to another shard of the live one) an
  op under a victim's op id and reply channel, but with a key that routes elsewhere (a
  misrouted op), at the victim's own place where the inbox allows it (junk pushed first, in
  one script of its own, up to the place before; an inbox already past it takes none): the
  owner's signed refusal then names a place the victim's entry also has, and a refusal stored
  under its id would answer the victim's op, which would then never run;
- publishes forged unsigned replies to the victims that name shards of older generations.

Everything goes to the test's own Redis on 127.0.0.1, and stops after the event's ``lasting``
seconds (at most :data:`MAX_APPENDS` entries pushed by one event, besides the junk before a
misrouted op and the garbage).
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import redis.asyncio as aredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from keyserial._wire.codec import LARGEST_ID, inbox_item
from keyserial._wire.layout import Layout, ShardKeys, owner_channel, part_id, shard_name
from keyserial._wire.resharding import LayoutRecord
from keyserial._wire.routing import home_shard, shard_for
from tests.helpers import keys_on_shard
from tests.nemesis.schedule import FaultEvent, rng_for
from tests.users import documented_rules

if TYPE_CHECKING:
    from tests.nemesis.faults import Faults
    from tests.nemesis.workloads import Keys

_T = TypeVar("_T")
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
#: A plain RPUSH of one item to an inbox (KEYS[1]), returning its place: the inbox's taken count
#: plus the list's length after the push, read in the same script (no move falls between). A
#: script of the forger's own: a client user may run one, with the commands its ACL allows.
PUSH_ITEM = """
local length = redis.call('RPUSH', KEYS[1], ARGV[1])
return tonumber(redis.call('GET', KEYS[1] .. ':taken') or '0') + length
"""
#: Junk pushed to an inbox (KEYS[1]) up to the place before ARGV[1], then the item ARGV[2] at
#: that place, in one script (no other push falls between); nothing where the inbox's next
#: place is past ARGV[1], or more than ARGV[3] items before it. Returns {1 if pushed, the next
#: place it found}.
PUSH_AT = """
local taken = tonumber(redis.call('GET', KEYS[1] .. ':taken') or '0')
local next_place = taken + redis.call('LLEN', KEYS[1]) + 1
local want = tonumber(ARGV[1])
if next_place > want or want - next_place > tonumber(ARGV[3]) then
  return {0, next_place}
end
for place = next_place, want - 1 do
  redis.call('RPUSH', KEYS[1], 'junk at place ' .. place)
end
redis.call('RPUSH', KEYS[1], ARGV[2])
return {1, next_place}
"""
#: Junk items pushed before a misrouted op, at most (the rest: no push).
MAX_JUNK = 16
#: Grant requests (forged or copied) one round appends, at most.
REQUESTS_PER_ROUND = 3
#: How often a round appends a misrouted op under a victim's id, and publishes replies naming
#: an older generation's shard.
MISROUTED_CHANCE = 0.5
OLD_REPLY_CHANCE = 0.5
#: Entries one ``forge`` event appends in all (grant requests and misrouted ops), at most.
MAX_APPENDS = 150
#: How often a round pushes an item of garbage (see :data:`GARBAGE_ITEMS`).
GARBAGE_CHANCE = 0.3
#: Writes a round tries that the client ACL must refuse, at most.
REFUSED_PER_ROUND = 3
#: Streams of layouts other than the live one read per round, at most (the live one's, all).
OTHER_STREAMS_READ = 16
#: Entries read per stream.
ENTRIES_READ = 100
#: What the forger remembers of what it read (the latest).
REMEMBERED = 64


#: Grant request items one round publishes on the workers' channels, at most; and signed
#: messages heard there that it publishes again.
REQUEST_MESSAGES_PER_ROUND = 3
REPLAYS_PER_ROUND = 2
#: Messages read off the workers' channels per round, at most (the rest wait for the next).
HEARD_PER_ROUND = 500
#: Requests heard in a round that get a forged grant and decision notices, at most.
HEARD_FORGED_FOR = 8
#: A signed message's end: the signer's id and the tag (``_wire.signing``).
SIGNED_END = re.compile(rb',"k":"([0-9a-f]{16})","t":"[0-9a-f]{32}"}\Z')


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
        system.inspector,
        rng_for(system.plan.seed, f"forge:{number}:channels"),
        inboxes=rng_for(system.plan.seed, f"forge:{number}:inboxes"),
        breaches=faults.acl_breaches,
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
                    await forger.deaf()
                except RedisError:
                    refused += 1  # Redis down, BUSY or LOADING: a hostile client tries again
                    await forger.deaf()
                await anyio.sleep(event.params["every"])
    finally:  # (the note first: the load's end may have cancelled the forger)
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.kinds.items()))
        missed = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.missed.items()))
        published = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.published.items()))
        denied = ", ".join(f"{kind} {count}" for kind, count in sorted(forger.refused.items()))
        faults.note(
            f"forge: {sent} forged messages published as the client user"
            f" ({refused} rounds cut short by Redis); appended: {kinds or 'nothing'}"
            f" (not appended: {missed or 'none'}); on the workers' channels"
            f" ({forger.heard} messages heard, {len(forger.requests)} genuine requests"
            f" remembered): {published or 'nothing'}; {len(system.forged_keys)} keys"
            f" targeted so far; refused by the ACL: {denied or 'nothing tried'}"
            f" ({len(forger.accepted)} accepted)"
        )
        with anyio.CancelScope(shield=True):
            await forger.deaf()
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
    """An envelope read in a stream: where, under which entry id, and what the entry's replies
    name it by (its place in the inbox it was pushed to: the field ``p``; an entry appended to
    the stream itself has none, and is named by its id)."""

    layout: Layout
    shard: int
    entry_id: str
    envelope: dict[str, Any]
    place: str = ""

    @property
    def named(self) -> str:
        return self.place or self.entry_id

    @property
    def keys(self) -> list[str]:
        envelope = self.envelope
        keys = envelope.get("keys") if "keys" in envelope else [envelope.get("key")]
        return [key for key in keys or [] if isinstance(key, str)]


@dataclass(frozen=True)
class Asked:
    """A grant request: an item heard on a worker's channel (``{"t": "q", ...}``, see
    docs/wire-format.md), or one of the forger's own, for a participant shard of ``layout``."""

    layout: Layout
    shard: int
    item: dict[str, Any]

    @property
    def op_id(self) -> object:
        return self.item.get("op")

    @property
    def attempt(self) -> object:
        return self.item.get("a")

    @property
    def home(self) -> object:
        return self.item.get("h")

    @property
    def channel(self) -> str:
        return str(self.item.get("c", ""))

    @property
    def keys(self) -> list[str]:
        keys = self.item.get("k")
        return [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []


@dataclass(frozen=True)
class Heard:
    """A signed message heard on a worker's channel, as it came, and the keys its items name."""

    channel: str
    data: bytes
    keys: tuple[str, ...]
    requests: bool


class Forger:
    """One ``forge`` event's byzantine client, and what it has read and heard so far."""

    def __init__(
        self,
        attacker: aredis.Redis,
        namespace: str,
        rng: random.Random,
        more: random.Random,
        keys: Keys,
        targeted: set[str],
        inspector: Any = None,
        channels_rng: random.Random | None = None,
        *,
        inboxes: random.Random | None = None,
        breaches: list[dict[str, Any]] | None = None,
    ) -> None:
        self.redis: Any = attacker  # (redis-py's asyncio stubs type replies as sync-or-async)
        self.namespace = namespace
        #: The draws of the forgeries on the live layout (as they were before the forger
        #: followed reshards), of those that follow them, and of those on the workers'
        #: channels.
        self.rng, self.more = rng, more
        self.messages = channels_rng or random.Random(0)
        #: The draws of the garbage pushed to inboxes and of the writes the ACL must refuse
        #: (a stream of their own: the draws above stay as they were).
        self.inboxes = inboxes or random.Random(1)
        #: Where the forger reads the leases (see the module doc); None: it reads none.
        self.inspector = inspector
        #: The keys the run's load uses, which forged grant requests name.
        self.workload = sorted({*keys.accounts, *keys.lists})
        self.targeted = targeted
        #: What it appended, by kind; what it tried to and could not; and what it published
        #: on the workers' channels, by kind.
        self.kinds: Counter[str] = Counter()
        self.missed: Counter[str] = Counter()
        self.published: Counter[str] = Counter()
        self.requests: list[Asked] = []  # genuine grant requests, heard on workers' channels
        self.signed: list[Heard] = []  # signed messages heard there
        self.signers: set[str] = set()  # the ids of the signers of those
        self.victims: list[Seen] = []  # callers' ops in the streams of the layout new ops go to
        self.attempts: dict[tuple[int, int], set[int]] = {}  # (generation, home) -> attempts
        self.channels: dict[tuple[int, int], str] = {}  # (generation, home) -> coordinator's
        #: Each owned shard's owner's channel, by the shard's name, as the leases say.
        self.owners: dict[str, str] = {}
        #: The writes the client ACL refused, by kind, and those it accepted (each a
        #: violation: kept in ``breaches`` too, the run's ``Faults.acl_breaches``).
        self.refused: Counter[str] = Counter()
        self.accepted: list[dict[str, Any]] = []
        self.breaches = breaches if breaches is not None else []
        self.own: set[str] = set()  # the envelopes it appended (JSON): never learned from
        #: The client user's subscription to the workers' channels, and those it listens on.
        self.listener: Any = None
        self.listened: set[str] = set()
        self.heard = 0

    async def round(self) -> int:
        """One round of forgeries: a push to a random shard, then a grant and a decision notice
        for every grant request heard of, then grant requests and signed messages again on the
        workers' channels, then what follows the reshard, then garbage and writes the ACL must
        refuse (see the module doc). How many messages were published or appended."""
        record = await self._layout_record()
        if record is None:
            return 0
        layout = record.live
        shard = layout.keys(self.rng.randrange(layout.shards))
        sent = await _forged_push(self.redis, layout, shard, self.rng)
        if self.rng.random() < REPLAY_CHANCE:
            sent += await _replayed_as_fresh(self.redis, shard, self.rng)
        sent += await _forged_replies(self.redis, shard, self.rng)
        await self._listen(record)
        heard = await self._hear(record)
        appended = await self._read(record)
        channels = {*self.owners.values(), *(asked.channel for asked in heard)}
        heard = self.messages.sample(heard, min(len(heard), HEARD_FORGED_FOR))
        for asked in [*heard, *appended]:
            sent += await _forged_coordination(self.redis, asked, channels)
        sent += await self._grant_requests(record)
        sent += await self._request_messages(record)
        sent += await self._replays()
        if self.more.random() < MISROUTED_CHANCE:
            sent += await self._misrouted(record)
        if self.more.random() < OLD_REPLY_CHANCE:
            sent += await self._old_generation_replies(record)
        if self.inboxes.random() < GARBAGE_CHANCE:
            sent += await self._garbage(record)
        await self._refused_writes(record)
        return sent

    # -- garbage, and writes the ACL must refuse -------------------------------------------------

    async def _garbage(self, record: LayoutRecord) -> int:
        """An item of :data:`GARBAGE_ITEMS` pushed to a shard of any layout, with a plain
        RPUSH, and its place published (a plain wake-up). Its owner dead-letters it; no op of
        it runs (a forged tag applied would show in the lists)."""
        rng = self.inboxes
        layout = rng.choice(_layouts(record))
        keys = layout.keys(rng.randrange(layout.shards))
        key = keys_on_shard(keys.shard, layout.shards, 1, "lst")[0]
        kind = rng.choice(sorted(GARBAGE_ITEMS))
        envelope = {"id": _forged_id(rng), "key": key, "op": "append", "args": ["forged"]}
        item = GARBAGE_ITEMS[kind](json.dumps([envelope]))
        place = await self.redis.eval(PUSH_ITEM, 1, keys.inbox, item)
        await self.redis.publish(keys.wake_channel, str(place))
        self.kinds[f"garbage ({kind})"] += 1
        return 1

    async def _refused_writes(self, record: LayoutRecord) -> None:
        """Up to :data:`REFUSED_PER_ROUND` writes of :func:`_must_be_refused` to a shard of the
        live layout: each refused is counted, each accepted a breach (a violation)."""
        rng = self.inboxes
        keys = record.live.keys(rng.randrange(record.live.shards))
        tries = _must_be_refused(keys, rng)
        for kind, command in rng.sample(tries, rng.randint(1, REFUSED_PER_ROUND)):
            try:
                reply = await self.redis.execute_command(*command)
            except NoPermissionError:
                self.refused[kind] += 1
                continue
            except ResponseError as error:
                said = str(error)
                if said.startswith(("BUSY", "LOADING")):
                    raise  # (Redis did not run it: the round is cut short)
                if "can't run this command" in said:  # (a command a script runs, refused there)
                    self.refused[kind] += 1
                    continue
                reply = error  # (let through, and failed on its own: WRONGTYPE...)
            breach = {"kind": kind, "command": [str(arg)[:80] for arg in command]}
            breach["reply"] = repr(reply)[:200]
            self.accepted.append(breach)
            self.breaches.append(breach)

    async def _layout_record(self) -> LayoutRecord | None:
        fields = await self.redis.hmget(
            f"ks:{{{self.namespace}}}:meta", ["shards", "generation", "move", "history"]
        )
        if fields[0] is None:
            return None
        return LayoutRecord.decode(self.namespace, *fields)

    # -- the workers' channels -------------------------------------------------------------------

    async def _listen(self, record: LayoutRecord) -> None:
        """Read who owns each shard of the layouts workers serve (the live one, a move's
        target) in the leases, and listen on every owner's channel not listened on yet."""
        if self.inspector is None:
            return
        served = [record.live] + ([record.move.target] if record.move else [])
        shards = [(layout, shard) for layout in served for shard in range(layout.shards)]
        async with self.inspector.pipeline(transaction=False) as pipe:
            for layout, shard in shards:
                pipe.get(layout.keys(shard).lease)
            leases = await pipe.execute()
        self.owners = {
            shard_name(shard, layout.generation): owner_channel(self.namespace, lease.decode())
            for (layout, shard), lease in zip(shards, leases, strict=True)
            if lease is not None
        }
        new = sorted(set(self.owners.values()) - self.listened)
        if new:
            if self.listener is None:
                self.listener = self.redis.pubsub()
            await self.listener.subscribe(*new)
            self.listened.update(new)

    async def deaf(self) -> None:
        """Drop the subscription (Redis went away, or the event ends): the next round listens
        again."""
        listener, self.listener = self.listener, None
        self.listened.clear()
        if listener is not None:
            with suppress(RedisError, OSError):
                await listener.aclose()

    async def _hear(self, record: LayoutRecord) -> list[Asked]:
        """What arrived on the workers' channels since the last round: each signed message is
        remembered, with its signer, and each grant request it carries (with the attempt and
        the coordinator's channel, by home). The requests heard now."""
        if self.listener is None:
            return []
        generations = {layout.generation: layout for layout in _layouts(record)}
        heard: list[Asked] = []
        for _ in range(HEARD_PER_ROUND):
            message = await self.listener.get_message(ignore_subscribe_messages=True, timeout=0)
            if message is None:
                break
            self.heard += 1
            data, channel = message["data"], message["channel"]
            signed = SIGNED_END.search(data)
            if signed is None:
                continue  # (a forgery: the forger's own, or another's)
            self.signers.add(signed.group(1).decode())
            items = _items(data[: signed.start()] + b"}")
            asked = [
                each
                for item in items
                if item.get("t") == "q" and (each := _asked(item, generations)) is not None
            ]
            keys = {key for item in items for key in _item_keys(item)}
            _keep(self.signed, Heard(channel.decode(), data, tuple(sorted(keys)), bool(asked)))
            for each in asked:
                self._learn(each)
                heard.append(each)
        return heard

    def _learn(self, asked: Asked) -> None:
        if type(asked.home) is not int or type(asked.attempt) is not int:
            return
        where = (asked.layout.generation, asked.home)
        self.attempts.setdefault(where, set()).add(asked.attempt)
        if asked.channel:
            self.channels[where] = asked.channel
        _keep(self.requests, asked)

    async def _request_messages(self, record: LayoutRecord) -> int:
        """Up to :data:`REQUEST_MESSAGES_PER_ROUND` grant request items published on the
        workers' channels: made up, or genuine ones unsigned (see the module doc)."""
        if not self.owners:
            return 0
        rng, sent = self.messages, 0
        for _ in range(rng.randint(1, REQUEST_MESSAGES_PER_ROUND)):
            if self.requests and rng.random() < 0.3:
                asked, kind = rng.choice(self.requests), "genuine, unsigned"
            else:
                made = self._made_up_request(record)
                if made is None:
                    continue
                asked, kind = made
            channel = self.owners.get(str(asked.item.get("s")))
            if channel is None or rng.random() < 0.2:
                channel = rng.choice(sorted(self.owners.values()))
            item = json.dumps(asked.item)
            shape = rng.choice(("alone", "in a batch", "under a forged signature"))
            if shape == "in a batch":
                grant = _forged_grant(asked, channel)
                message = json.dumps({"t": "b", "m": [asked.item, grant]})
            elif shape == "under a forged signature" and self.signers:
                signer, tag = rng.choice(sorted(self.signers)), f"{rng.getrandbits(128):032x}"
                message = f'{item[:-1]},"k":"{signer}","t":"{tag}"}}'
            else:
                message, shape = item, "alone"
            self.targeted.update(asked.keys)
            await self.redis.publish(channel, message)
            self.published[f"grant request ({kind}, {shape})"] += 1
            sent += 1
        return sent

    def _made_up_request(self, record: LayoutRecord) -> tuple[Asked, str] | None:
        """A grant request item no worker made, for a shard of a layout workers serve: for
        workload keys of that shard (or now and then of another), under a guessed attempt of
        a home below it, now and then for another shard's name or made hours ago."""
        rng = self.messages
        served = [record.live] + ([record.move.target] if record.move else [])
        layout = rng.choice(served)
        made = self._made_up(layout, rng)
        if made is None:
            return None
        participant, home, op_id, attempt, keys, channel = made
        kind = "made up"
        target = shard_name(participant, layout.generation)
        at = int(time.time() * 1000)
        draw = rng.random()
        if draw < 0.15:
            keys = [*keys, rng.choice(self.workload)]  # (now and then one of another shard)
            kind = "made up, keys anywhere"
        elif draw < 0.25:
            target = shard_name(rng.randrange(layout.shards), layout.generation + rng.randint(0, 1))
            kind = "made up, another shard's name"
        elif draw < 0.35:
            at += rng.choice((-1, 1)) * 2 * 3600 * 1000
            kind = "made up, hours from now"
        item = {
            "t": "q",
            "op": op_id,
            "a": attempt,
            "h": home,
            "s": target,
            "k": keys,
            "c": channel,
            "at": at,
        }
        return Asked(layout, participant, item), kind

    def _made_up(
        self, layout: Layout, rng: random.Random
    ) -> tuple[int, int, str, int, list[str], str] | None:
        """A participant shard of ``layout`` with workload keys, a home below it, an op id (a
        victim's multi-key op's, a genuine request's, or made up), a guessed attempt, keys of
        the participant and a coordinator's channel (a real worker's, where known)."""
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
        genuine = [str(asked.op_id) for asked in self.requests]
        draw = rng.random()
        if victims and draw < 0.4:
            op_id = rng.choice(victims)
        elif genuine and draw < 0.7:
            op_id = rng.choice(genuine)
        else:
            op_id = _forged_id(rng)
        attempt = self._guessed_attempt(layout.generation, home, rng)
        channel = self.channels.get((layout.generation, home)) or rng.choice(
            [*self.channels.values(), *self.owners.values(), f"ks:{self.namespace}:worker:forged"]
        )
        return participant, home, op_id, attempt, keys, channel

    async def _replays(self) -> int:
        """Up to :data:`REPLAYS_PER_ROUND` signed messages heard on the workers' channels,
        published again: as they came on their own channel (most of them), on another
        worker's, or with a byte changed (see the module doc)."""
        if not self.signed:
            return 0
        rng, sent = self.messages, 0
        carrying = [heard for heard in self.signed if heard.requests]
        for _ in range(rng.randint(0, REPLAYS_PER_ROUND)):
            heard = rng.choice(carrying if carrying and rng.random() < 0.7 else self.signed)
            channel, data = heard.channel, heard.data
            kind = rng.choice(("as it came", "as it came", "to another worker", "changed"))
            others = sorted(set(self.owners.values()) - {channel})
            if kind == "to another worker" and others:
                channel = rng.choice(others)
            elif kind == "changed":  # (a digit of what the tag covers: an attempt, a time)
                digits = [at for at, byte in enumerate(data[:-63]) if 48 <= byte <= 57]
                at = rng.choice(digits)
                data = data[:at] + str((data[at] - 47) % 10).encode() + data[at + 1 :]
            else:
                kind = "as it came"
            what = "requests" if heard.requests else "grants or notices"
            self.targeted.update(heard.keys)
            await self.redis.publish(channel, data)
            self.published[f"signed message again ({what}, {kind})"] += 1
            sent += 1
        return sent

    # -- reading ---------------------------------------------------------------------------------

    async def _read(self, record: LayoutRecord) -> list[Asked]:
        """Read the streams of every shard of the live layout, and of a sample of the other
        layouts' (a move's target, those before): remember the victims. The grant ops read
        there (no worker appends one: the forger's own, or another forger's), as requests."""
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
        requests: list[Asked] = []
        for (layout, shard), entries in zip(streams, replies, strict=True):
            for entry_id, fields in entries:
                place = fields.get(b"p", b"").decode(errors="replace")
                for envelope in _envelopes(fields):
                    seen = Seen(layout, shard, entry_id.decode(), envelope, place)
                    own = _canonical(envelope) in self.own
                    if envelope.get("op") == GRANT_OP:
                        if isinstance(envelope.get("kwargs"), dict):
                            requests.append(_appended_request(layout, shard, seen))
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

    # -- grant ops in the streams ----------------------------------------------------------------

    async def _grant_requests(self, record: LayoutRecord) -> int:
        """Up to :data:`REQUESTS_PER_ROUND` ``keyserial.grant`` ops appended: made up, or
        copies of genuine requests heard (see the module doc)."""
        sent = 0
        for _ in range(self.more.randint(1, REQUESTS_PER_ROUND)):
            if self.kinds.total() >= MAX_APPENDS:
                break
            kind = self.more.choice(
                ("made up", "made up", "copy", "copy-elsewhere", "copy-other-generation")
            )
            if kind == "made up" or not self.requests:
                made = self._made_up_grant_op(record)
            else:
                made = self._copied_request(record, self.more.choice(self.requests), kind)
            if made is None:
                continue
            where, envelope, kind = made
            self.targeted.update(envelope["keys"])
            await self._append(where, [envelope])
            self.kinds[f"grant op ({kind})"] += 1
            sent += 1
        return sent

    def _made_up_grant_op(
        self, record: LayoutRecord
    ) -> tuple[ShardKeys, dict[str, Any], str] | None:
        """A ``keyserial.grant`` op no worker made, for workload keys of one participant shard
        of any layout, under a guessed attempt (its id the part's name a run of it has, the
        attempt's as an earlier version named it, or now and then a plain one), its request in
        the shape coordinators of an earlier version appended, now and then with a genuine
        signer's id."""
        rng = self.more
        layout = rng.choice(_layouts(record))
        made = self._made_up(layout, rng)
        if made is None:
            return None
        participant, home, op_id, attempt, keys, channel = made
        request: dict[str, Any] = {
            "home": home,
            "op": op_id,
            "attempt": attempt,
            "channel": channel,
            "to": shard_name(participant, layout.generation),
            "at": int(time.time() * 1000),
        }
        kind = "made up"
        if self.signers and rng.random() < 0.3:  # a listed signer's id, a made-up signature
            request |= {"k": rng.choice(sorted(self.signers)), "sig": f"{rng.getrandbits(64):x}"}
            kind = "made up, a signer's id"
        named = rng.choice(("the part's", "the part's", "the attempt's", "a plain"))
        op_ids = {
            "the part's": part_id(op_id, home, attempt),
            "the attempt's": f"{op_id}#{attempt}",
            "a plain": op_id,
        }
        envelope = {"id": op_ids[named], "keys": keys, "op": GRANT_OP, "kwargs": request}
        return layout.keys(participant), envelope, f"{kind}, {named} id"

    def _copied_request(
        self, record: LayoutRecord, asked: Asked, kind: str
    ) -> tuple[ShardKeys, dict[str, Any], str] | None:
        """A genuine request heard on a channel, as a grant op: to its own shard's stream, to
        another shard of its layout above its home, to the same shard of another layout (or
        the next generation's, which no move has made yet), or with another attempt."""
        rng, layout = self.more, asked.layout
        request = dict(asked.item)
        home, op_id, attempt = asked.home, asked.op_id, asked.attempt
        if kind == "copy" and rng.random() < 0.3:
            attempt = request["a"] = self._guessed_attempt(layout.generation, home)
            kind = "copy, another attempt"
        named = part_id(str(op_id), home, attempt) if type(home) is type(attempt) is int else None
        envelope = {
            "id": named or f"{op_id}#{attempt}",
            "keys": asked.keys,
            "op": GRANT_OP,
            "kwargs": request,
        }
        if kind in ("copy", "copy, another attempt"):
            return layout.keys(asked.shard), envelope, kind
        if kind == "copy-elsewhere":
            above = [shard for shard in range(layout.shards) if shard != asked.shard]
            above = [shard for shard in above if type(home) is not int or shard > home]
            return (layout.keys(rng.choice(above)), envelope, kind) if above else None
        generations = {each.generation: each for each in _layouts(record)}
        generations.pop(layout.generation, None)
        if record.move is None:
            newest = max([layout.generation, *generations])
            generations[newest + 1] = Layout(self.namespace, record.live.shards, newest + 1)
        other = generations[rng.choice(sorted(generations))]
        return other.keys(asked.shard % other.shards), envelope, kind

    def _guessed_attempt(
        self, generation: int, home: object, rng: random.Random | None = None
    ) -> int:
        """The latest attempt heard in a genuine request of that home (its epoch now, likely:
        the one attempt a participant would hold keys for), another heard (of that home, or of
        any), one either side, or a small number."""
        rng = rng or self.more
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
        pushed to a shard of an older layout (or another shard of the live one, with none) at
        the victim's own place, where the inbox has not passed it (see :data:`PUSH_AT`)."""
        if not self.victims or self.kinds.total() >= MAX_APPENDS:
            return 0
        rng = self.more
        if rng.random() < 0.5:  # (the newest: the likeliest place that another inbox still takes)
            victim = max(self.victims, key=lambda seen: _order(seen.entry_id))
        else:
            victim = rng.choice(self.victims)
        if not victim.place.isdigit():
            self.missed["misrouted op: the victim's entry has no place"] += 1
            return 0
        older = [layout for layout in _layouts(record) if layout != record.routing]
        old = rng.choice(older) if older else record.routing
        shard = home_shard(victim.keys, old.shards)
        if not older:  # another shard of the layout new ops go to, one that takes the place
            others = [each for each in range(old.shards) if each != shard]
            below = await self._taking(old, others, int(victim.place))
            if not below:
                self.missed["misrouted op: no other inbox takes the victim's place"] += 1
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
        if not await self._at_victims_place(old.keys(shard), envelope, victim):
            return 0
        self.targeted.add(key)
        return 1

    async def _at_victims_place(
        self, where: ShardKeys, envelope: dict[str, Any], victim: Seen
    ) -> bool:
        """Push ``envelope`` at the victim's place, junk before it (:data:`PUSH_AT`), and wake
        the owner; whether the inbox took it there."""
        self.own.add(_canonical(envelope))
        item = inbox_item(json.dumps([envelope]), fresh=False)
        pushed, next_place = await self.redis.eval(
            PUSH_AT, 1, where.inbox, victim.place, item, MAX_JUNK
        )
        if not pushed:
            past = int(next_place) > int(victim.place)
            self.missed[f"misrouted op: the inbox is {'past' if past else 'far below'} it"] += 1
            return False
        await self.redis.publish(where.wake_channel, victim.place)
        self.kinds["misrouted op at a victim's place"] += 1
        return True

    async def _taking(self, layout: Layout, shards: list[int], place: int) -> list[int]:
        """The shards of ``shards`` whose inboxes' next places are ``place`` or below it, by
        :data:`MAX_JUNK` at most."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.get(layout.keys(shard).inbox_taken)
                pipe.llen(layout.keys(shard).inbox)
            replies = await pipe.execute()
        taking = []
        for at, shard in enumerate(shards):
            taken, waiting = replies[2 * at : 2 * at + 2]
            next_place = int(taken or 0) + int(waiting) + 1
            if next_place <= place <= next_place + MAX_JUNK:
                taking.append(shard)
        return taking

    async def _old_generation_replies(self, record: LayoutRecord) -> int:
        """Forged unsigned replies to a few victims, naming shards of older generations (or of
        the generation before the live one's, with none), and the victim's entry (its place)."""
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
                "e": [victim.named],
            }
            message = {"v": 1, "r": [[victim.envelope["id"], outcome]]}
            await self.redis.publish(victim.envelope["reply"], json.dumps(message))
            sent += 1
        return sent

    # -- appending -------------------------------------------------------------------------------

    async def _append(self, where: ShardKeys, envelopes: list[dict[str, Any]]) -> None:
        """Push an entry of ``envelopes`` to the shard's inbox and wake its owner: now and then
        with the submit script (fetched or pushed), else, and where the script refuses a sealed
        shard, with a plain RPUSH and a plain wake-up (its place)."""
        self.own.update(_canonical(envelope) for envelope in envelopes)
        ops = json.dumps(envelopes)
        if self.more.random() < 0.3:
            fresh = "1" if self.more.random() < 0.5 else ""
            try:
                await self.redis.eval(
                    SUBMIT_SCRIPT, 1, where.inbox, 0, "1", ops, where.wake_channel, fresh
                )
                return
            except ResponseError as error:
                if not str(error).startswith("RESHARDED"):
                    raise
        place = await self.redis.eval(PUSH_ITEM, 1, where.inbox, inbox_item(ops, fresh=False))
        await self.redis.publish(where.wake_channel, place)


def _layouts(record: LayoutRecord) -> list[Layout]:
    """The live layout, a move's target, and the layouts before (newest first)."""
    layouts = [record.live] + ([record.move.target] if record.move else [])
    layouts += [layout for layout, _ in reversed(record.history)]
    return list(dict.fromkeys(layouts))


def _envelopes(fields: dict[bytes, bytes]) -> list[dict[str, Any]]:
    """The op envelopes of an entry a worker runs: none of one of another wire version, such as
    the forger's own garbage moved in (pushed again as an item of the documented form, its op
    would be one the client user submitted, and run)."""
    if fields.get(b"v") != b"1":
        return []
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


def _keep(kept: list[_T], new: _T) -> None:
    """Remember ``new`` (once), with the :data:`REMEMBERED` latest."""
    if new not in kept:
        kept.append(new)
        del kept[:-REMEMBERED]


def _canonical(envelope: dict[str, Any]) -> str:
    return json.dumps(envelope, sort_keys=True)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _forged_id(rng: random.Random) -> str:
    return f"forged-{rng.getrandbits(64):016x}"


async def _forged_push(attacker: Any, layout: Layout, keys: ShardKeys, rng: random.Random) -> int:
    """A push of an append no caller made, at a place that does not hold it: the inbox's next
    place (nothing was pushed there: its owner may take it in and run it, and its next step,
    finding the inbox without it, commits nothing of it), the place of an item waiting there
    (its ops are not these), a place its owner moved into the stream already, or one past a
    gap; or a message that is no item at all (a plain wake-up, then)."""
    key = keys_on_shard(keys.shard, layout.shards, 1, "lst")[0]
    ops = json.dumps(
        [{"id": f"forged-{uuid.uuid4().hex}", "key": key, "op": "append", "args": ["forged"]}]
    )
    taken = int(await attacker.get(keys.inbox_taken) or 0)
    waiting = int(await attacker.llen(keys.inbox))
    shape = rng.choice(("next", "waiting", "moved", "gap", "no item"))
    place = taken + waiting + 1  # (next)
    if shape == "waiting" and waiting:
        place = taken + 1 + rng.randrange(waiting)
    elif shape == "moved" and taken:
        place = max(1, taken - rng.randrange(3))
    elif shape == "gap":
        place += rng.randint(1, 5)
    item = inbox_item(ops, fresh=True)
    if shape == "no item":
        item = rng.choice((ops, f"1 stale\n{ops}", f"fresh\n{ops}"))
    await attacker.publish(keys.wake_channel, f"push {place} {item}")
    return 1


async def _replayed_as_fresh(attacker: Any, keys: ShardKeys, rng: random.Random) -> int:
    """An op of the shard's stream (committed or not) pushed again, as it is but its item
    marked ``fresh``: with the submit script, so it comes pushed (where the shard is not
    sealed for a reshard), or a plain RPUSH followed by
    its push (``push <place> <item>``, at the place it took: the owner may take it in), by its
    bare place (fetched), or by nothing (fetched at the owner's poll). 0 if the stream holds no
    op of a caller's."""
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
        try:
            await attacker.eval(
                SUBMIT_SCRIPT, 1, keys.inbox, 0, "1", replayed, keys.wake_channel, "1"
            )
            return 1
        except ResponseError as error:  # (a shard sealed for a reshard: pushed plainly)
            if not str(error).startswith("RESHARDED"):
                raise
    item = inbox_item(replayed, fresh=True)
    place = await attacker.eval(PUSH_ITEM, 1, keys.inbox, item)
    wake = rng.choice(("push", "place", "none"))
    if wake != "none":
        message = f"push {place} {item}" if wake == "push" else str(place)
        await attacker.publish(keys.wake_channel, message)
    return 1


#: Garbage items (``_garbage``), each made of the JSON ops of one forged envelope: not of the
#: documented form (``<version>[ fresh]\n<ops>``), of another version, or with ops that are not
#: a JSON array. Every one is dead-lettered; none runs.
GARBAGE_ITEMS: dict[str, Callable[[str], str]] = {
    "no newline": lambda ops: f"forged {ops}",
    "empty": lambda ops: "",
    "empty first line": lambda ops: f"\n{ops}",
    "another flag": lambda ops: f"1 stale\n{ops}",
    "fresh twice": lambda ops: f"1 fresh fresh\n{ops}",
    "another version": lambda ops: f"2\n{ops}",
    "ops not JSON": lambda ops: f"1\n{ops[:-3]}",
    "ops not a list": lambda ops: f"1 fresh\n{ops[1:-1]}",
}


def _must_be_refused(keys: ShardKeys, rng: random.Random) -> list[tuple[str, tuple[Any, ...]]]:
    """The writes to a shard's stream and inbox that the client ACL must refuse, by kind: each
    would drop, reorder or block the entries of other clients (docs/deployment.md)."""
    entry = ("v", "1", "ops", "[]")
    explicit = f"{int(time.time() * 1000) + rng.randrange(1000)}-{rng.randrange(5)}"
    xadd_in_script = "return redis.call('XADD', ARGV[1], 'MAXLEN', 0, '*', 'v', '1', 'ops', '[]')"
    return [
        ("XADD MAXLEN 0 to a stream", ("XADD", keys.stream, "MAXLEN", "0", "*", *entry)),
        ("XADD under the largest id", ("XADD", keys.stream, LARGEST_ID, *entry)),
        ("XADD under an explicit id", ("XADD", keys.stream, explicit, *entry)),
        ("XADD to a stream", ("XADD", keys.stream, "*", *entry)),
        ("XADD to an inbox", ("XADD", keys.inbox, "*", *entry)),
        ("XTRIM of a stream", ("XTRIM", keys.stream, "MAXLEN", "0")),
        ("LPUSH to an inbox", ("LPUSH", keys.inbox, "1\n[]")),
        ("LTRIM of an inbox", ("LTRIM", keys.inbox, "1", "0")),
        ("RPOP of an inbox", ("RPOP", keys.inbox)),
        ("DEL of an inbox", ("DEL", keys.inbox)),
        ("DEL of a stream", ("DEL", keys.stream)),
        ("INCRBY of an inbox's taken count", ("INCRBY", keys.inbox_taken, "1")),
        (
            "LTRIM of an inbox in a script",
            ("EVAL", "return redis.call('LTRIM', KEYS[1], 1, 0)", 1, keys.inbox),
        ),
        ("XADD MAXLEN 0 in a script", ("EVAL", xadd_in_script, 1, keys.inbox, keys.stream)),
        ("a script given a stream as a key", ("EVAL", "return 1", 1, keys.stream)),
    ]


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


async def _forged_coordination(attacker: Any, asked: Asked, channels: set[str]) -> int:
    """A grant with made-up states to the request's coordinator, and a decision notice that
    writes made-up states to every worker channel the forger knows, alone and in a batch with
    the grant (as a worker sends what it owes another in one pipeline)."""
    grant = _forged_grant(asked, "ks:forger")
    states = grant["st"]
    notice = {
        "t": "d",
        "op": asked.op_id,
        "a": asked.attempt,
        "h": asked.home,
        "d": {"w": {str(asked.shard): states}},
    }
    await attacker.publish(asked.channel, json.dumps(grant))
    for channel in channels:
        await attacker.publish(channel, json.dumps(notice))
        await attacker.publish(channel, json.dumps({"t": "b", "m": [grant, notice]}))
    return 1 + 2 * len(channels)


def _forged_grant(asked: Asked, channel: str) -> dict[str, Any]:
    """A grant of ``asked``'s keys with made-up states, from ``channel``."""
    states = [
        [key, FORGED_ACCOUNT if key.startswith("acct") else FORGED_LIST] for key in asked.keys
    ]
    return {
        "t": "g",
        "op": asked.op_id,
        "a": asked.attempt,
        "s": asked.shard,
        "st": states,
        "f": 1,
        "c": channel,
        "h": asked.home,
    }


def _appended_request(layout: Layout, shard: int, seen: Seen) -> Asked:
    """A grant op read in a stream, as a request item (its request in either shape the forger
    appends: a request item's, or one of an earlier version's ``home``, ``attempt``...)."""
    request = seen.envelope["kwargs"]
    item = {
        "t": "q",
        "op": request.get("op"),
        "a": request.get("a", request.get("attempt")),
        "h": request.get("h", request.get("home")),
        "s": shard_name(shard, layout.generation),
        "k": seen.keys,
        "c": request.get("c", request.get("channel")),
    }
    return Asked(layout, shard, item)


def _items(text: bytes) -> list[dict[str, Any]]:
    """The items of a coordination message (its signature cut off): one, or a batch's."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(message, dict):
        return []
    items = message.get("m") if message.get("t") == "b" else [message]
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _item_keys(item: dict[str, Any]) -> list[str]:
    """The keys an item names: a request's, a grant's states', a notice's writes'."""
    if item.get("t") == "q":
        keys = item.get("k")
        return [key for key in keys if isinstance(key, str)] if isinstance(keys, list) else []
    if item.get("t") == "g":
        states = item.get("st")
        pairs = states if isinstance(states, list) else []
    else:
        writes = item.get("d", {}).get("w", {}) if isinstance(item.get("d"), dict) else {}
        pairs = [pair for each in writes.values() if isinstance(each, list) for pair in each]
    return [
        pair[0] for pair in pairs if isinstance(pair, list) and pair and isinstance(pair[0], str)
    ]


def _asked(item: dict[str, Any], generations: dict[int, Layout]) -> Asked | None:
    """A request item heard, for a shard of a layout the forger knows of (else None)."""
    number, _, generation = str(item.get("s", "")).partition("@")
    if not number.isdigit() or not (generation or "0").isdigit():
        return None
    layout = generations.get(int(generation or "0"))
    if layout is None or int(number) >= layout.shards:
        return None
    return Asked(layout, int(number), item)
