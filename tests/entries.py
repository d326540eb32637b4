"""Stream entries appended, and outcomes read, with plain Redis commands as docs/wire-format.md
has them: for tests that put an entry exactly where they need it."""

from __future__ import annotations

import json
from typing import Any

from keyserial.testing import ShardKeys


def envelope(op_id: str, key: str, op: str, *args: Any) -> dict[str, Any]:
    """An op envelope: what one op is on the wire."""
    return {"id": op_id, "key": key, "op": op, "args": list(args)}


async def append_entry(client: Any, namespace: str, shard: int, envelopes: list[Any], *,
                       fresh: bool) -> str:
    """One stream entry carrying ``envelopes``, as the documented wire format has it."""
    fields = {"v": "1", "ops": json.dumps(envelopes)}
    if fresh:
        fields["fresh"] = "1"
    entry_id: bytes = await client.xadd(ShardKeys(namespace, shard).stream, fields)
    return entry_id.decode()


async def stored(client: Any, namespace: str, shard: int, op_id: str) -> Any:
    """The outcome stored for ``op_id`` (either results generation), or None."""
    keys = ShardKeys(namespace, shard)
    raw = await client.hget(keys.results, op_id) or await client.hget(keys.results_old, op_id)
    return None if raw is None else json.loads(raw)
