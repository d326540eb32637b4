"""The grant protocol's own script (``_worker.crossshard``): a participant that missed the
decision ``resolve`` s it. (Grants and decisions commit with the owners' steps: ``step.lua``'s
"g" and "c".)
"""

from __future__ import annotations

import json
from typing import Any

from .._wire.layout import ShardKeys
from .calls import ScriptArgs, ScriptCall, script_args


@script_args("resolve")
class ResolveArgs(ScriptArgs):
    """The attempt whose decision a participant looks up."""

    op_id: str
    #: The home epoch the attempt began in.
    attempt: int


def _decision(reply: bytes | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    decision: dict[str, Any] = json.loads(reply)
    return decision


def resolve(home: ShardKeys, args: ResolveArgs) -> ScriptCall[dict[str, Any] | None]:
    """The attempt's decision; an abort, recorded now, if its coordinator's epoch is over; None
    while it is undecided and its coordinator still owns the home shard. Not fenced."""
    keys = [home.epoch, home.results, home.results_old]
    return args.call(keys, _decision)
