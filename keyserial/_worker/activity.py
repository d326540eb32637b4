"""What a worker ran lately, for ``keyserial dashboard``: its hottest keys, the last ops it ran
and the last that failed.

Kept in memory and bounded (a few hundred ops, whatever the number of keys), and posted to the
namespace's activity hash (``ks:<ns>:activity``, field: the worker's token, only workers may
write it) every :data:`POST_EVERY` seconds in which something ran: an idle worker writes
nothing. The hot path pays a deque append and a counter increment per op. Only ids, names and
keys are kept: the dashboard reads an op's outcome (value, error, traceback) from the shard's
results, where it is the record.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from .._wire.codec import GRANT_OP, error_type
from .._wire.json_text import dumps

if TYPE_CHECKING:
    from .commits import Finished
    from .execution import Run

#: The last ops a worker ran, and the last that failed, that it keeps and posts.
RECENT_OPS = 200
FAILED_OPS = 50
#: The hottest keys of a posting interval that are posted.
HOT_KEYS = 20
#: Seconds between two posts (of a worker that ran something in between).
POST_EVERY = 2.0

#: (op id, shard, op name, keys, when: ms since the epoch)
_Ran = tuple[str, int, str, tuple[str, ...], int]


class Activity:
    """One worker's recent ops and hot keys (touched only by its event loop)."""

    __slots__ = ("_failed", "_hot", "_interval_began", "_recent")

    def __init__(self) -> None:
        self._recent: deque[_Ran] = deque(maxlen=RECENT_OPS)
        self._failed: deque[tuple[_Ran, str]] = deque(maxlen=FAILED_OPS)
        self._hot: dict[str, int] = {}  # ops per key this interval
        self._interval_began = time.monotonic()

    def ran(self, shard: int, runs: Iterable[Run]) -> None:
        """Ops about to run on ``shard`` (not grant requests: they run no code of the app)."""
        now_ms = int(time.time() * 1000)
        append, hot, count = self._recent.append, self._hot, self._hot.get
        for run in runs:
            envelope = run.envelope
            if envelope.name == GRANT_OP:
                continue
            keys = envelope.keys
            append((envelope.op_id, shard, envelope.name, keys, now_ms))
            for key in keys:
                hot[key] = count(key, 0) + 1

    def committed(self, batch: Iterable[Finished]) -> None:
        """Outcomes a step committed: the errors of ops this worker ran are kept."""
        for finished in batch:
            if finished.op_id and not finished.outcome.startswith('{"ok"'):
                kind = error_type(finished.outcome)
                if kind is not None:
                    self._failed_op(finished.op_id, kind)

    def _failed_op(self, op_id: str, kind: str) -> None:
        for ran in reversed(self._recent):  # (rare: only for errors)
            if ran[0] == op_id:
                self._failed.append((ran, kind))
                return

    def take_record(self, token: str) -> str | None:
        """The record to post (JSON, see ``docs/operations.md``), and a new interval for the hot
        keys; None when nothing ran since the last one."""
        now = time.monotonic()
        interval_ms = round((now - self._interval_began) * 1000)
        self._interval_began = now
        if not self._hot:
            return None
        hot = heapq.nlargest(HOT_KEYS, self._hot.items(), key=itemgetter(1))
        self._hot = {}
        record: dict[str, Any] = {
            "v": 1,
            "worker": token,
            "at": int(time.time() * 1000),
            "interval_ms": interval_ms,
            "hot": hot,
            "recent": [_ran_json(ran) for ran in self._recent],
            "failed": [{**_ran_json(ran), "error": error} for ran, error in self._failed],
        }
        return dumps(record)


def _ran_json(ran: _Ran) -> dict[str, Any]:
    op_id, shard, name, keys, at = ran
    return {"id": op_id, "shard": shard, "op": name, "keys": list(keys), "at": at}
