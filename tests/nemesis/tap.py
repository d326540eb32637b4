"""A tap on every shard stream: which op ids were appended, so a lost one can be named.

It reads the streams directly from Redis (never through a proxy) as entries arrive. The worker
trims only entries whose ops all committed, so an entry the tap missed (trimmed before it was
read) was applied; the tap can miss appended ops only on the safe side.

Clients push entries to a shard's inbox, and only its owner moves them into the stream (its
step, a seal, a takeover, a retired shard's heir): the stream's order is the order they were
moved in, which is the order an owner takes them in, and the tap sees an item once it is
moved, in that order. An item still in an inbox has not been seen yet: the tap counts as
caught up only once the inboxes of the shards it follows are empty too (moved in, and read).

It can fall behind, though: across a Redis restart it reads again only once it has reconnected
(every 0.1 s, with :func:`direct_client`'s client). The runner therefore polls outcomes only
once the tap has caught up (:meth:`StreamTap.catch_up`), so that every op it names is polled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aredis
from anyio.abc import TaskGroup
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException

from keyserial._wire.codec import parse_id
from keyserial._wire.layout import Layout
from keyserial._wire.resharding import Move

#: Op ids of the entries the ``garbage`` fault appends start with this.
GARBAGE_PREFIX = "garbage-"
#: The argument position of the tag, per op the load submits.
_TAG_POSITION = {"append": 0, "slow_append": 0, "pay_tagged": 1, "pay_now_tagged": 1}


def direct_client(port: int) -> aredis.Redis:
    """A client of the server on ``port`` for the tap: no socket timeout (its reads block), and
    no retries. A client built with ``redis.asyncio.Redis(...)`` (not ``from_url``) retries a
    failed command three times on redis-py 6 and later, sleeping up to 2, 4 and 8 s between
    tries: a read begun while Redis was down could sleep seconds past its restart, and the tap
    fell that far behind the streams (short seed 102). The tap reconnects every 0.1 s instead."""
    return aredis.Redis(
        port=port, socket_timeout=None, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
    )


@dataclass
class Appended:
    op_id: str
    tag: str
    keys: tuple[str, ...]
    shard: int
    #: The stream it was seen in (after a reshard, of a later layout generation).
    stream: str
    #: Every entry that carried the op id (more than one: appended twice).
    entries: list[str]


@dataclass
class StreamTap:
    #: A new client of the deployment (called again after a failure).
    connect: Callable[[], Any]
    namespace: str
    shard_count: int
    #: One blocking read per stream (a cluster: each stream lives in its own slot, and one XREAD
    #: may not span slots), else one read of every stream.
    per_stream: bool = False
    #: op id -> what the tap saw appended (only ops the load submitted, tagged).
    seen: dict[str, Appended] = field(default_factory=dict)
    #: Stream -> the last entry the tap read in it ("0-0": none yet), for every stream it follows.
    read: dict[str, str] = field(default_factory=dict)

    async def run(self) -> None:
        """Read every stream until cancelled, resuming after a Redis restart or failover; the
        streams of each layout a reshard makes too, as soon as the move is recorded."""
        followed: set[int] = set()
        async with anyio.create_task_group() as group:
            self._follow_layout(group, Layout(self.namespace, self.shard_count), followed)
            while True:
                await anyio.sleep(0.2)
                for layout in await self._new_layouts(followed):
                    self._follow_layout(group, layout, followed)

    def _follow_layout(self, group: TaskGroup, layout: Layout, followed: set[int]) -> None:
        followed.add(layout.generation)
        streams = {keys.stream: keys.shard for keys in layout.all_keys()}
        self.read.update(dict.fromkeys(streams, "0-0"))
        if not self.per_stream:
            group.start_soon(self._follow, streams)
            return
        for name, shard in streams.items():
            group.start_soon(self._follow, {name: shard})

    async def _new_layouts(self, followed: set[int]) -> list[Layout]:
        """The live layout and a move's target, if the tap follows neither yet."""
        client = self.connect()
        try:
            shards, generation, move = await client.hmget(
                f"ks:{{{self.namespace}}}:meta", "shards", "generation", "move"
            )
        except (OSError, aredis.RedisError, RedisClusterException):
            return []
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()
        layouts = (
            [] if shards is None else [Layout(self.namespace, int(shards), int(generation or 0))]
        )
        if move is not None:
            layouts.append(Move.decode(self.namespace, move).target)
        return [layout for layout in layouts if layout.generation not in followed]

    async def behind(self, client: Any) -> list[str]:
        """The streams whose last entry, read now with ``client``, the tap has not read yet, and
        the inboxes of its shards that hold items (not moved into the stream yet, so not read
        either)."""
        lagging = []
        for name, read in list(self.read.items()):
            tail = await client.xrevrange(name, count=1)
            if tail and parse_id(tail[0][0].decode()) > parse_id(read):
                lagging.append(name)
            inbox = inbox_of(name)
            if await client.llen(inbox):
                lagging.append(inbox)
        return lagging

    async def catch_up(self, client: Any, timeout: float) -> list[str]:
        """Wait until the tap has read every entry its streams hold, and every item pushed to
        its shards' inboxes (moved into the streams by their owners: asked with ``client``,
        again and again: an entry trimmed meanwhile, committed, needs no reading); the streams
        and inboxes still behind after ``timeout`` seconds (empty: caught up)."""
        lagging = list(self.read)
        with anyio.move_on_after(timeout):
            while True:
                with suppress(OSError, aredis.RedisError, RedisClusterException):
                    lagging = await self.behind(client)
                    if not lagging:
                        return []
                await anyio.sleep(0.05)
        return lagging

    async def _follow(self, streams: dict[str, int]) -> None:
        last = self.read
        while True:
            client = self.connect()
            try:
                while True:
                    replies = await client.xread(
                        {name: last[name] for name in streams}, count=500, block=200
                    )
                    for stream, entries in replies:
                        name = stream.decode()
                        for entry_id, fields in entries:
                            last[name] = entry_id.decode()
                            self._note(streams[name], name, last[name], fields)
            except (OSError, aredis.RedisError, RedisClusterException):
                await anyio.sleep(0.1)
            finally:
                with anyio.CancelScope(shield=True):
                    await client.aclose()

    def _note(self, shard: int, stream: str, entry: str, fields: dict[bytes, bytes]) -> None:
        raw = fields.get(b"ops", b"[]")
        if _deeper_than(raw, 200):  # garbage the nemesis appended: never decoded here, so
            return  # no RecursionError is ever raised in the test process
        try:
            envelopes = json.loads(raw)
        except ValueError:  # garbage the nemesis itself appended
            return
        if not isinstance(envelopes, list):
            return
        for envelope in envelopes:
            with suppress(KeyError, IndexError, TypeError, ValueError):
                self._note_envelope(shard, stream, entry, envelope)

    def _note_envelope(self, shard: int, stream: str, entry: str, envelope: dict[str, Any]) -> None:
        op_id = envelope["id"]
        position = _TAG_POSITION.get(envelope.get("op", ""))
        if (
            not isinstance(op_id, str)
            or "#" in op_id
            or op_id.startswith(GARBAGE_PREFIX)
            or position is None
        ):
            return  # a grant request, or a foreign op
        tag = envelope["args"][position]
        if not isinstance(tag, str):
            return
        keys = tuple(envelope["keys"]) if "keys" in envelope else (envelope["key"],)
        seen = self.seen.setdefault(op_id, Appended(op_id, tag, keys, shard, stream, []))
        seen.entries.append(entry)


def inbox_of(stream: str) -> str:
    """The inbox of the shard whose stream is ``stream`` (``ks:{<ns>:<shard>}:stream``)."""
    return stream.removesuffix(":stream") + ":inbox"


def _deeper_than(raw: bytes, limit: int) -> bool:
    """Whether brackets in ``raw`` nest more than ``limit`` deep (counted without recursion;
    brackets inside strings count too, which only errs towards skipping)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for byte in raw:
        if byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False
