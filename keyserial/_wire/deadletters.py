"""A dead letter, as a shard's dead-letter stream keeps it (``ShardKeys.dead``): fields
``entry`` (the id of the stream entry it came from), ``reason`` and ``raw``.

``raw`` is a poison op's envelope, an unreadable entry's fields as a JSON object
(:func:`entry_raw`), or an element of an entry that is no envelope; ``_wire.codec``'s
``dead_letter_envelopes`` finds the ops in it. The step and acquire scripts write the letters
of a worker's own shard (in Lua, with these fields); a worker forwarding the strays of a
retired shard writes its refusals with :meth:`DeadLetterRecord.fields`; a reshard copies
letters as they are, adding ``moved``; the operator reads them with
:meth:`DeadLetterRecord.decode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .json_text import dumps


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    """One dead letter's fields."""

    #: The id of the shard stream's entry it came from.
    entry: str
    reason: str
    raw: str

    def fields(self) -> tuple[str, ...]:
        """Its fields and values, as ``XADD`` takes them."""
        return ("entry", self.entry, "reason", self.reason, "raw", self.raw)

    @classmethod
    def decode(cls, fields: Mapping[bytes, bytes]) -> DeadLetterRecord:
        """The record in a letter's fields (a field it lacks: empty; bytes that are not UTF-8:
        replacement characters, as an operator reads them)."""
        got = {
            name.decode(errors="replace"): value.decode(errors="replace")
            for name, value in fields.items()
        }
        return cls(got.get("entry", ""), got.get("reason", ""), got.get("raw", ""))


def entry_raw(fields: Mapping[bytes, bytes]) -> str:
    """An entry's fields as JSON text: the ``raw`` of an entry dead-lettered whole."""
    return dumps(
        {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
    )
