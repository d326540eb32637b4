"""An operator's pause of a key, as its shard's paused hash keeps it (``ShardKeys.paused``):
field the key, value ``{"at": <unix ms>}``.

The operator writes it (``keyserial keys pause``, the dashboard); a reshard copies it as it is;
``keyserial status`` and ``keyserial keys paused`` read it. A worker holds every key the hash
names, whatever its record says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PauseRecord:
    """One paused key's record."""

    #: When the key was paused (ms since the epoch, the operator's clock); None for a record
    #: that does not say.
    at: int | None

    def encode(self) -> str:
        return json.dumps({"at": self.at})

    @classmethod
    def decode(cls, raw: bytes | str) -> PauseRecord:
        """The record in ``raw``; one without a time for anything that is not one (a paused
        key stays paused whatever its record holds)."""
        try:
            at = json.loads(raw)["at"]
        except (ValueError, TypeError, KeyError):
            return cls(None)
        return cls(at if type(at) is int else None)

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at}
