"""The structured fields of keyserial's log records. A record about an op, a key or a shard
carries them as attributes (``extra=fields(...)``), and ``--log-format json`` writes each one
present as a member of its line, so a log pipeline filters by shard or op id without parsing
the message."""

from __future__ import annotations

#: The fields, in the order a JSON line lists them.
FIELDS = ("shard", "epoch", "key", "op", "op_id", "error")


def fields(
    *,
    shard: int | None = None,
    epoch: int | None = None,
    key: str | None = None,
    op: str | None = None,
    op_id: str | None = None,
    error: str | None = None,
) -> dict[str, object]:
    """``extra=`` for a log call: the fields given (those left out, or None, are absent)."""
    given = {"shard": shard, "epoch": epoch, "key": key, "op": op, "op_id": op_id, "error": error}
    return {name: value for name, value in given.items() if value is not None}
