"""Stream entries appended, and outcomes read, with plain Redis commands as docs/wire-format.md
has them: for tests that put an entry exactly where they need it."""

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
