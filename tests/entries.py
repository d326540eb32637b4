"""Stream entries appended, inbox items pushed and read, and outcomes read, with plain Redis
commands as docs/wire-format.md has them: for tests that put an entry exactly where they need
it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from keyserial._scripts.commit import StepArgs
from keyserial.testing import ShardKeys


def envelope(op_id: str, key: str, op: str, *args: Any) -> dict[str, Any]:
    """An op envelope: what one op is on the wire."""
    return {"id": op_id, "key": key, "op": op, "args": list(args)}


async def append_entry(
    client: Any, namespace: str, shard: int, envelopes: list[Any], *, fresh: bool
) -> str:
    """One stream entry carrying ``envelopes``, as the documented wire format has it."""
    fields = {"v": "1", "ops": json.dumps(envelopes)}
    if fresh:
        fields["fresh"] = "1"
    entry_id: bytes = await client.xadd(ShardKeys(namespace, shard).stream, fields)
    return entry_id.decode()


#: RPUSH an item to a shard's inbox (KEYS[1]) and return its place: the inbox's taken count plus
#: the list's length after the push, read in the same script so that no move by the owner can
#: fall between them (a client user may not send MULTI). The push itself is the plain RPUSH a
#: client user may send.
_PUSH_ITEM = """
local length = redis.call('RPUSH', KEYS[1], ARGV[1])
return tonumber(redis.call('GET', KEYS[1] .. ':taken') or '0') + length
"""


def inbox_item(envelopes: list[Any], *, fresh: bool) -> str:
    """The inbox item of one entry carrying ``envelopes``: ``<version>[ fresh]\\n<ops JSON>``, as
    the documented wire format has it."""
    return f"1{' fresh' if fresh else ''}\n{json.dumps(envelopes)}"


async def push_item(
    client: Any,
    namespace: str,
    shard: int,
    envelopes: list[Any],
    *,
    fresh: bool,
    wake: bool = False,
) -> int:
    """One inbox item carrying ``envelopes`` pushed to the shard's inbox with an RPUSH, as any
    client user may, without the submit script (no seal or backlog check); its place (its
    number in the order of the inbox's pushes, from 1). Its owner takes it in at its next fetch
    or poll; with ``wake``, a wake-up follows on the shard's wake channel, as ``submit.lua``
    sends it: ``push <place> <item>`` for a fresh item (its owner may take it in without
    fetching it), its bare place otherwise."""
    keys = ShardKeys(namespace, shard)
    item = inbox_item(envelopes, fresh=fresh)
    place = int(await client.eval(_PUSH_ITEM, 1, keys.inbox, item))
    if wake:
        await client.publish(keys.wake_channel, f"push {place} {item}" if fresh else str(place))
    return place


async def inbox_entries(client: Any, namespace: str, shard: int) -> list[dict[bytes, bytes]]:
    """The items waiting in the shard's inbox, in order, each as the fields of the stream entry
    its owner moves it in as (``v``, ``ops``, and ``fresh`` if it is), less its place."""
    entries = []
    for item in await client.lrange(ShardKeys(namespace, shard).inbox, 0, -1):
        header, _, ops = item.partition(b"\n")
        version, _, flags = header.partition(b" ")
        fields = {b"v": version, b"ops": ops}
        if flags == b"fresh":
            fields[b"fresh"] = b"1"
        entries.append(fields)
    return entries


async def stored(client: Any, namespace: str, shard: int, op_id: str) -> Any:
    """The outcome stored for ``op_id`` (either results generation), or None; as its caller
    reads it (without the binding ``b``, see :func:`bound_to`)."""
    raw = await stored_raw(client, namespace, shard, op_id)
    if raw is None:
        return None
    outcome = json.loads(raw)
    outcome.pop("b", None)
    return outcome


async def stored_raw(client: Any, namespace: str, shard: int, op_id: str) -> bytes | None:
    keys = ShardKeys(namespace, shard)
    raw: bytes | None = await client.hget(keys.results, op_id) or await client.hget(
        keys.results_old, op_id
    )
    return raw


async def bound_to(client: Any, namespace: str, shard: int, op_id: str) -> str | None:
    """The binding stored with ``op_id``'s outcome (its op's digest), or None."""
    raw = await stored_raw(client, namespace, shard, op_id)
    found = None if raw is None else json.loads(raw).get("b")
    return found if isinstance(found, str) else None


def step_args(epoch: int, **changes: Any) -> StepArgs:
    """The arguments of a step by the owner of ``epoch`` that fetches up to 10 entries after
    ``0-0`` and commits, moves and trims nothing, holding every state; ``changes`` set any
    other field (``cursor=…``, ``replaying=True``)."""
    plain = StepArgs(
        epoch=epoch,
        progress="",
        rotate=False,
        cursor="0-0",
        fetch=10,
        replaying=False,
        result_ttl_ms=60_000,
        trim_to="",
        trim_now=False,
        states_held=True,
    )
    return dataclasses.replace(plain, **changes)


async def push_raw_item(
    client: Any, keys: ShardKeys, item: str | bytes, *, wake: bool = False
) -> int:
    """``item``, as it is (an item of the documented form or not), pushed with an RPUSH to the
    inbox of ``keys`` (a shard of any layout generation, sealed or retired too: no script
    checks anything), as any client user may; its place. With ``wake``, a wake-up follows as
    :func:`push_item` sends it (``push <place> <item>`` for an item whose first line says
    ``fresh``, its bare place otherwise)."""
    place = int(await client.eval(_PUSH_ITEM, 1, keys.inbox, item))
    if wake:
        text = item.decode() if isinstance(item, bytes) else item
        fresh = text.partition("\n")[0].endswith(" fresh")
        await client.publish(keys.wake_channel, f"push {place} {text}" if fresh else str(place))
    return place
