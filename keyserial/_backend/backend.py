"""The Redis boundary, as the rest of keyserial sees it: :class:`Backend`'s methods name each
read and write by what the keys hold (the commands as data in ``_backend.commands``), over one
transport (``_backend.transport``), which sends them and maps every failure to keyserial's
exceptions. ``_backend.durability`` confirms writes, and script calls are typed in
``_scripts.calls`` and its siblings. Every script touches one shard's keys (one cluster slot),
except a step that writes other shards for a cross-shard op, which only runs so on a standalone
server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from .._scripts.calls import ScriptArg, ScriptCall, decoded
from .._scripts.refusals import ScriptMissing
from .._scripts.submit import Pushed, SubmitArgs, present, submit
from .._wire.codec import LARGEST_ID, item_fields
from .._wire.layout import (
    PAUSES_CHANGED,
    Layout,
    ShardKeys,
    activity_key,
    meta_key,
    pauses_key,
    roster_key,
    signers_key,
)
from .._wire.resharding import LayoutRecord, Seal, sealed_key
from ..errors import ConfigError, ShardCountMismatch
from .commands import Command, merged_stored, publish_command, raise_errors, raised, stored_commands
from .resp import AnyRedis
from .transport import Transport, open_transport

__all__ = ["AnyRedis", "Backend"]

R = TypeVar("R")


class Backend:
    """A connection to one Redis deployment, standalone or cluster, and keyserial's commands
    over it: script calls, and reads and writes of its keys by what they hold. Every method
    raises ``BackendUnavailable`` if the server does not answer."""

    def __init__(self, transport: Transport) -> None:
        #: How the commands reach Redis (chosen once, at :meth:`connect`).
        self.transport = transport
        #: For messages and logs: the password is hidden.
        self.url = transport.url
        #: Whether the server has failed to answer since it last did; warnings of callers that
        #: retry go through it (see ``_backend.outage``).
        self.outage = transport.outage
        #: Whether wake-ups, replies and coordination messages travel as shard messages
        #: (``_wire.layout.in_shard``): on a cluster of servers that have them (Redis 7+,
        #: Valkey).
        self.sharded_pubsub = transport.sharded_pubsub
        #: See :attr:`Transport.publish_after_waits`.
        self.publish_after_waits = transport.publish_after_waits
        #: See :attr:`Transport.is_cluster`.
        self.is_cluster = transport.is_cluster
        #: See :attr:`Transport.one_script_reaches_every_shard`.
        self.one_script_reaches_every_shard = transport.one_script_reaches_every_shard
        # (The transport's own calls, as they are: :meth:`Transport.send` and the rest.)
        self.on_node = transport.on_node
        self.publish_after = transport.publish_after
        self.listen = transport.listen
        self.node_of = transport.node_of
        self.refresh_routing = transport.refresh_routing
        self.aclose = transport.aclose
        self.ping = transport.ping

    @classmethod
    async def connect(cls, redis: str | AnyRedis) -> Backend:
        """Open ``redis`` (a URL, or a client the caller configured and keeps owning), with the
        transport that serves it (:func:`~keyserial._backend.transport.open_transport`).

        :raises BackendUnavailable: if the server does not answer.
        """
        return cls(await open_transport(redis))

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Commands in one pipeline (on a cluster, routed by key): each reply, or its error."""
        return await self.transport.send(commands)

    async def call(self, *command: ScriptArg) -> Any:
        """One command's reply; its error reply raised."""
        (reply,) = await self.transport.send([command])
        return raised(reply)

    # -- scripts -------------------------------------------------------------------------------

    async def run_many(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """Run scripts in one pipeline: each reply as its call decodes it, or its error."""
        replies = await self.pipeline([call.evalsha_command() for call in calls])
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, ScriptMissing)]
        if missing:  # a restarted or flushed server: send those once as EVAL
            again = await self.pipeline([calls[index].eval_command() for index in missing])
            for index, reply in zip(missing, again, strict=True):
                replies[index] = reply
        return decoded(calls, replies)

    async def run_call(self, call: ScriptCall[R]) -> R:
        """Run one script: its reply, decoded; its refusal raised."""
        (reply,) = await self.run_many([call])
        result: R = raised(reply)
        return result

    def append_calls(
        self, entries: Sequence[tuple[ShardKeys, SubmitArgs]]
    ) -> list[ScriptCall[Pushed]]:
        """The ``submit`` calls that push entries to shards' inboxes. An entry marked ``fresh``
        (op ids appended for the first time: its owner looks none up) must land once, so it goes
        out marked only where a command is sent at most once: on keyserial's own connection,
        which never sends one again (redis-py may, after a lost connection)."""
        if not self.transport.sends_once:
            entries = [(keys, replace(args, fresh=False)) for keys, args in entries]
        return [submit(keys, args) for keys, args in entries]

    async def append(self, entries: Sequence[tuple[ShardKeys, SubmitArgs]]) -> list[Any]:
        """Push entries to shards' inboxes (:meth:`append_calls`) in one pipeline: where each
        went (:class:`Pushed`), or its error."""
        return await self.run_many(self.append_calls(entries))

    # -- keys ----------------------------------------------------------------------------------

    async def stored(self, shard: ShardKeys, fields: Sequence[str]) -> list[bytes | None]:
        """Stored results (or cross-shard records) of ``fields`` in a shard: from the current
        generation, else the previous one (both read in one round trip)."""
        return merged_stored(raise_errors(await self.pipeline(stored_commands(shard, fields))))

    async def stored_on_many(
        self, wanted: Sequence[tuple[ShardKeys, Sequence[str]]]
    ) -> list[list[bytes | None]]:
        """:meth:`stored` of several shards in one pipeline (on a cluster, one round trip
        per node, in parallel)."""
        commands = [
            command for shard, fields in wanted for command in stored_commands(shard, fields)
        ]
        replies = raise_errors(await self.pipeline(commands))
        return [merged_stored(replies[at : at + 2]) for at in range(0, len(replies), 2)]

    async def entries_present(self, shard: ShardKeys, pushed: Sequence[Pushed]) -> list[bool]:
        """Whether each pushed entry is still in the shard's inbox or stream (one round trip)."""
        return await self.run_call(present(shard, pushed))

    async def state(self, shard: ShardKeys, key: str) -> bytes | None:
        """The committed state (JSON) of ``key``, or None."""
        state: bytes | None = await self.call("HGET", shard.state, key)
        return state

    async def states(self, shard: ShardKeys, keys: Sequence[str]) -> list[bytes | None]:
        """The committed states (JSON) of ``keys``, None for a key that has none."""
        states: list[bytes | None] = await self.call("HMGET", shard.state, *keys)
        return states

    async def state_count(self, shard: ShardKeys) -> int:
        """How many keys of the shard have a state."""
        return int(await self.call("HLEN", shard.state))

    async def all_states(self, shard: ShardKeys) -> dict[bytes, bytes]:
        """Every state of the shard, by key."""
        return _as_dict(await self.call("HGETALL", shard.state))

    async def timers(self, shard: ShardKeys) -> list[tuple[bytes, float, bytes]]:
        """The shard's timers, soonest due first: (id, due time in ms, item)."""
        scored, items = raise_errors(
            await self.pipeline(
                [("ZRANGE", shard.timers, 0, -1, "WITHSCORES"), ("HGETALL", shard.timed)]
            )
        )
        timed = _as_dict(items)
        if not scored or not isinstance(scored[0], (list, tuple)):  # (RESP2: a flat list)
            scored = list(zip(scored[::2], scored[1::2], strict=True))
        return [(member, float(due), timed[member]) for member, due in scored if member in timed]

    async def held(self, shard: ShardKeys) -> dict[bytes, bytes]:
        """The shard's holds for other shards' cross-shard ops (its held hash), by attempt: what
        a new owner holds again before it runs anything."""
        return _as_dict(await self.call("HGETALL", shard.held))

    async def list_signer(self, namespace: str, signer_id: str, record: str) -> dict[bytes, bytes]:
        """Write a reply signer's entry in the namespace's signers hash; every entry listed."""
        return await self._renew_listing(signers_key(namespace), signer_id, record)

    async def drop_signers(self, namespace: str, signer_ids: Sequence[str | bytes]) -> None:
        raise_errors(await self.pipeline([("HDEL", signers_key(namespace), *signer_ids)]))

    async def list_worker(self, namespace: str, token: str, entry: str) -> dict[bytes, bytes]:
        """Write a worker's roster entry; every entry listed."""
        return await self._renew_listing(roster_key(namespace), token, entry)

    async def drop_workers(self, namespace: str, tokens: Sequence[str | bytes]) -> None:
        """Drop workers' roster entries, and what they posted of their activity."""
        raise_errors(
            await self.pipeline(
                [
                    ("HDEL", roster_key(namespace), *tokens),
                    ("HDEL", activity_key(namespace), *tokens),
                ]
            )
        )

    async def post_activity(self, namespace: str, token: str, record: str) -> None:
        """Write what a worker ran lately (see ``_worker.activity``)."""
        raise_errors(await self.pipeline([("HSET", activity_key(namespace), token, record)]))

    async def activities(self, namespace: str) -> dict[bytes, bytes]:
        """What each worker posted of its activity, by token."""
        (posted,) = raise_errors(await self.pipeline([("HGETALL", activity_key(namespace))]))
        return _as_dict(posted)

    async def roster(self, namespace: str) -> dict[bytes, bytes]:
        """The namespace's roster of workers, as listed (see ``_wire.roster``)."""
        (listed,) = raise_errors(await self.pipeline([("HGETALL", roster_key(namespace))]))
        return _as_dict(listed)

    async def _renew_listing(self, key: str, field: str, record: str) -> dict[bytes, bytes]:
        """Write one entry of a hash that processes list themselves in; every entry."""
        _, listed = raise_errors(
            await self.pipeline([("HSET", key, field, record), ("HGETALL", key)])
        )
        return _as_dict(listed)

    async def signer_records(self, namespace: str, signer_ids: Sequence[str]) -> list[bytes | None]:
        """The signers hash's entries for ``signer_ids`` (None where there is none)."""
        (records,) = raise_errors(
            await self.pipeline([("HMGET", signers_key(namespace), *signer_ids)])
        )
        return list(records)

    async def entries_after(self, cursors: Sequence[tuple[ShardKeys, str]]) -> list[bool]:
        """For each (shard, entry id): whether the shard's stream has an entry after that one,
        or its inbox an item (True too where the server answered with an error: look, to be
        safe). One pipeline."""
        commands: list[tuple[str, ...]] = []
        for shard, cursor in cursors:
            commands += [("XRANGE", shard.stream, f"({cursor}", "+", "COUNT", "1")]
            commands += [("LLEN", shard.inbox)]
        replies = await self.pipeline(commands)
        return [
            any(isinstance(reply, Exception) or bool(reply) for reply in replies[at : at + 2])
            for at in range(0, len(replies), 2)
        ]

    async def entries_since(
        self, cursors: Sequence[tuple[ShardKeys, str]], count: int
    ) -> list[list[tuple[bytes, dict[bytes, bytes]]]]:
        """For each (shard, entry id): up to ``count`` entries after that one, oldest first
        (none after the largest id there is, where XRANGE would refuse the range). One
        pipeline."""
        asked = [(shard, cursor) for shard, cursor in cursors if cursor != LARGEST_ID]
        replies = (
            raise_errors(
                await self.pipeline(
                    [
                        ("XRANGE", shard.stream, f"({cursor}", "+", "COUNT", count)
                        for shard, cursor in asked
                    ]
                )
            )
            if asked
            else []
        )
        found = iter(replies)
        return [[] if cursor == LARGEST_ID else _entries(next(found)) for _, cursor in cursors]

    async def queued(self, shard: ShardKeys, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to ``count`` entries after the shard's progress marker, oldest first: (id,
        fields); ops waiting or under way: the stream's, then the inbox's, not moved in yet
        (named ``inbox <place>``; an item of another form than the wire format's is left out)."""
        progress = await self.call("GET", shard.progress)
        first = f"({progress.decode()}" if progress else "-"
        found = _entries(await self.call("XRANGE", shard.stream, first, "+", "COUNT", count))
        if len(found) < count:
            taken, items = raise_errors(
                await self.pipeline(
                    [("GET", shard.inbox_taken), ("LRANGE", shard.inbox, 0, count - len(found) - 1)]
                )
            )
            for at, item in enumerate(items, int(taken or 0) + 1):
                if (fields := item_fields(item)) is not None:
                    found.append((f"inbox {at}".encode(), fields))
        return found

    async def paused_keys(self, shard: ShardKeys) -> dict[bytes, bytes]:
        """The shard's paused keys, with their records."""
        (paused,) = await self.all_paused([shard])
        return paused

    async def all_paused(self, shards: Sequence[ShardKeys]) -> list[dict[bytes, bytes]]:
        """Each shard's paused keys, in one pipeline."""
        replies = raise_errors(await self.pipeline([("HGETALL", s.paused) for s in shards]))
        return [_as_dict(paused) for paused in replies]

    async def seals(self, shards: Sequence[ShardKeys]) -> list[Seal | None]:
        """Each shard's seal by a reshard, if it has one, in one pipeline."""
        replies = raise_errors(await self.pipeline([("GET", sealed_key(s)) for s in shards]))
        return [
            None if record is None else Seal.decode(shard.namespace, record)
            for shard, record in zip(shards, replies, strict=True)
        ]

    async def lease_holders(self, shards: Sequence[ShardKeys]) -> list[bytes | None]:
        """Each shard's lease value (None: no worker holds it), in one pipeline (on a cluster,
        one per node). A lease holds its holder's coordination channel less its prefix
        (``_wire.layout.owner_channel``): so a cross-shard op's coordinator finds the channel
        of each participant shard's owner, to message it, in one round trip."""
        return raise_errors(await self.pipeline([("GET", s.lease) for s in shards]))

    async def pauses_changed(self, namespace: str) -> int:
        """The namespace's count of pauses and resumes (0: none yet)."""
        return int(await self.call("GET", pauses_key(namespace)) or 0)

    async def set_paused(self, shard: ShardKeys, key: str, record: str | None) -> bool:
        """Pause ``key`` (``record``: its JSON record) or resume it (None), then bump the
        namespace's counter and wake the shard's owner; whether the key was paused before."""
        change: Command = (
            ("HDEL", shard.paused, key) if record is None else ("HSET", shard.paused, key, record)
        )
        before, *_ = raise_errors(
            await self.pipeline(
                [
                    ("HEXISTS", shard.paused, key),
                    change,
                    ("INCR", pauses_key(shard.namespace)),
                    publish_command(shard.wake(self.sharded_pubsub), PAUSES_CHANGED),
                ]
            )
        )
        return bool(before)

    async def held_and_paused(
        self, shard: ShardKeys, keys: Sequence[str]
    ) -> tuple[bool, list[str]]:
        """Whether some worker holds the shard's lease, and which of ``keys`` (of the shard) an
        operator paused: one round trip, with the commands a client user may send (``EXISTS``,
        ``HMGET``)."""
        held, records = raise_errors(
            await self.pipeline([("EXISTS", shard.lease), ("HMGET", shard.paused, *keys)])
        )
        return bool(held), [key for key, record in zip(keys, records, strict=True) if record]

    async def dead_letters(
        self, shard: ShardKeys, first: str = "-", last: str = "+", count: int | None = None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The shard's dead letters from ``first`` to ``last`` (ids), oldest first: (id,
        fields)."""
        command: list[ScriptArg] = ["XRANGE", shard.dead, first, last]
        if count is not None:
            command += ["COUNT", count]
        return _entries(await self.call(*command))

    async def drop_dead_letter(self, shard: ShardKeys, letter_id: str) -> bool:
        """Delete one dead letter: whether it was there."""
        return bool(await self.call("XDEL", shard.dead, letter_id))

    async def publish(self, channel: str, message: str) -> None:
        await self.call(*publish_command(channel, message))

    async def recorded_layout(self, namespace: str) -> Layout | None:
        """The layout the namespace records, or None if nothing has used it yet."""
        record = await self.layout_record(namespace)
        return None if record is None else record.live

    async def layout_record(self, namespace: str) -> LayoutRecord | None:
        """The namespace's layout, the reshard under way and the layouts before; None if
        nothing has used the namespace yet."""
        shards, *rest = await self.call(
            "HMGET", meta_key(namespace), "shards", "generation", "move", "history"
        )
        return None if shards is None else LayoutRecord.decode(namespace, shards, *rest)

    async def ensure_layout(self, namespace: str, shard_count: int | None) -> Layout:
        """Record the namespace's shard count on first use; return the recorded layout.

        ``None`` adopts the recorded count, or records 16 for a new namespace. A namespace in
        use is only read, so a client's ACL user needs no write access to it.

        :raises ShardCountMismatch: when ``shard_count`` differs from the recorded count.
        :raises ConfigError: when the count is not recorded yet and this user may not record it.
        """
        wanted = 16 if shard_count is None else shard_count
        if wanted < 1:
            raise ConfigError(f"shard count must be at least 1, not {wanted}")
        recorded = await self.recorded_layout(namespace)
        if recorded is None:
            try:
                await self.call("HSETNX", meta_key(namespace), "shards", wanted)
            except ConfigError as exc:  # the ACL refused it (see classify_reply)
                raise ConfigError(
                    f"namespace {namespace!r} has no shard count recorded yet, and this Redis"
                    f" user may not record it ({exc.__cause__}); start a worker first, which"
                    " records it"
                ) from exc
            recorded = await self.recorded_layout(namespace)
            assert recorded is not None, "recorded just now"
        if shard_count is not None and recorded.shards != shard_count:
            raise ShardCountMismatch(
                namespace=namespace, recorded=recorded.shards, configured=shard_count
            )
        return recorded


def _entries(entries: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as XRANGE returns them, each entry's fields as a dict."""
    return [(entry_id, _as_dict(fields)) for entry_id, fields in entries]


def _as_dict(flat: Any) -> dict[bytes, bytes]:
    """A hash as HGETALL returns it: a dict already (RESP3, or a client that parses it), else
    a flat list of fields and values."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True))
