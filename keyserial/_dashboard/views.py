"""What ``keyserial dashboard`` shows and does, as JSON: the same reads and actions as
``keyserial status``, ``dead-letters`` and ``keys``, on one connection.

Every figure is read from the records in Redis (leases, streams, results, the roster), except
the hottest keys and each worker's recent ops: those come from what workers post of their
activity (``ks:<ns>:activity``), so they cover the last few hundred ops of each worker.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._backend.backend import Backend
from .._operator import deadletters, timers
from .._operator.namespace import layout_in_use, record_in_use
from .._operator.pauses import pause
from .._operator.status import Rates, as_json, snapshot, workers
from .._wire.codec import MalformedEntry, decode_entry, decode_outcome
from .._wire.layout import Layout, ShardKeys
from .._wire.roster import WorkerEntry, live_entries
from .._wire.routing import shard_for

#: Hot keys are posted per interval; a post older than this is no longer "now".
HOT_FOR_MS = 10_000
#: The most shown of a list: hot keys, failed ops, dead letters per shard, a key's queued ops.
SHOWN = 50
#: A key's state is shown up to this many characters of its JSON (a state may be megabytes).
STATE_SHOWN = 64 * 1024
#: A key's queued ops are looked for among this many entries after its shard's progress.
QUEUE_SCANNED = 1000


@dataclass
class Dashboard:
    """One namespace, seen through one connection. Keeps recent shard snapshots, so that each
    overview shows ops/s over at least a second (see :class:`Rates`), whoever asked before."""

    backend: Backend
    namespace: str
    max_backlog: int
    _rates: Rates = field(default_factory=Rates)

    async def overview(self) -> dict[str, Any]:
        """Shards, workers, dead letters, the hottest keys and the recent failures."""
        record = await record_in_use(self.backend, self.namespace)
        layout = record.live
        statuses = self._rates.of(await snapshot(self.backend, layout))
        roster, posts = await self._live()
        view = as_json(self.namespace, statuses, workers(roster, statuses), record)
        view["hot_keys"] = _hot_keys(posts)
        view["failed"] = _failed(posts)
        view["dead_letters"] = [
            letter.as_json()
            for letter in await deadletters.read(
                self.backend, layout, range(layout.shards), count=SHOWN
            )
        ]
        return view

    async def key(self, key: str) -> dict[str, Any]:
        """A key's state, whether it is paused, its queued ops, its pending timers (soonest
        first) and its recent outcomes."""
        layout = await self._layout()
        shard = shard_for(key, layout.shards)
        keys = layout.keys(shard)
        state = await self.backend.state(keys, key)
        text = None if state is None else state.decode(errors="replace")
        paused = await self.backend.paused_keys(keys)
        return {
            "key": key,
            "shard": shard,
            "state": None if text is None else text[:STATE_SHOWN],
            "state_truncated": text is not None and len(text) > STATE_SHOWN,
            "paused": key.encode() in paused,
            "queued": await self._queued(keys, key),
            "timers": [
                timer.as_json()
                for timer in await timers.pending(self.backend, layout, [shard], key=key)
            ][:SHOWN],
            "recent": await self._recent(key),
        }

    async def replay(self, shard: int, letter_id: str, *, new_ids: bool) -> dict[str, Any]:
        """Replay one dead letter (see ``keyserial dead-letters replay``)."""
        layout = await self._layout()
        letter = await self._letter(shard, letter_id)
        try:
            replayed, skipped = await deadletters.replay(
                self.backend,
                layout,
                letter,
                max_backlog=self.max_backlog,
                new_ids=new_ids,
            )
        except deadletters.ReplayStopped as stopped:
            raise ActionRefused(str(stopped)) from stopped
        return {
            "replayed": [
                {
                    "op_id": op.op_id,
                    "was": op.was,
                    "shard": op.shard,
                    "entry": op.entry,
                    "had_outcome": op.had_outcome,
                }
                for op in replayed
            ],
            "skipped": skipped,
        }

    async def drop(self, shard: int, letter_id: str) -> dict[str, Any]:
        letter = await self._letter(shard, letter_id)
        layout = await self._layout()
        return {"dropped": await deadletters.drop(self.backend, layout, letter)}

    async def pause(self, key: str, *, pausing: bool) -> dict[str, Any]:
        shard, was = await pause(self.backend, self.namespace, key, pausing=pausing)
        return {"key": key, "shard": shard, "paused": pausing, "was_paused": was}

    # -- reads -------------------------------------------------------------------------------

    async def _layout(self) -> Layout:
        return await layout_in_use(self.backend, self.namespace)

    async def _live(self) -> tuple[list[WorkerEntry], list[dict[str, Any]]]:
        """The live workers on the roster, and what they posted of their activity (a post that
        does not parse is left out)."""
        roster, _ = live_entries(await self.backend.roster(self.namespace))
        live = {entry.token.encode() for entry in roster}
        posts = []
        for token, raw in (await self.backend.activities(self.namespace)).items():
            try:
                post = json.loads(raw)
            except ValueError:
                continue
            if token in live and isinstance(post, dict):
                posts.append(post)
        return roster, posts

    async def _queued(self, keys: ShardKeys, key: str) -> list[dict[str, Any]]:
        """The key's ops among the first entries after its shard's progress marker (ops whose
        home is another shard, multi-key ops, wait there instead)."""
        found = []
        for entry_id, fields in await self.backend.queued(keys, QUEUE_SCANNED):
            try:
                envelopes = decode_entry(fields)
            except MalformedEntry:
                continue
            for envelope in envelopes:
                if isinstance(envelope, MalformedEntry) or key not in envelope.keys:
                    continue
                found.append(
                    {
                        "entry": entry_id.decode(),
                        "id": envelope.op_id,
                        "op": envelope.name,
                        "keys": list(envelope.keys),
                        "args": _shown(envelope.args),
                        "kwargs": _shown(envelope.kwargs),
                    }
                )
        return found[:SHOWN]

    async def _recent(self, key: str) -> list[dict[str, Any]]:
        """The key's ops in the workers' posts, newest first, with their stored outcomes: those
        among each worker's last ops, and among its last failed ones, which it keeps longer (a
        key whose failure the overview lists has it here too)."""
        _, posts = await self._live()
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for post in posts:
            for op in (*_newest_first(post, "recent"), *_newest_first(post, "failed")):
                if key in op["keys"]:  # (a run in both lists is shown once, as it ran)
                    run = {name: value for name, value in op.items() if name != "error"}
                    found.setdefault((str(op.get("id")), str(op.get("at"))), run)
        ran = sorted(found.values(), key=lambda op: -int(op.get("at", 0)))[:SHOWN]
        layout = await self._layout()
        by_shard: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for op in ran:
            by_shard[int(op["shard"])].append(op)
        for shard, ops in by_shard.items():
            stored = await self.backend.stored(layout.keys(shard), [op["id"] for op in ops])
            for op, outcome in zip(ops, stored, strict=True):
                op["outcome"] = None if outcome is None else _outcome(outcome)
        return ran

    async def _letter(self, shard: int, letter_id: str) -> deadletters.DeadLetter:
        if not deadletters.LETTER_ID.fullmatch(letter_id):
            raise ActionRefused(f"{letter_id!r} is not a dead-letter id")
        layout = await self._layout()
        found = await deadletters.read(self.backend, layout, [shard], letter_id=letter_id)
        if not found:
            raise ActionRefused(f"no dead letter {letter_id!r} on shard {shard}")
        return found[0]


class ActionRefused(Exception):
    """An action that cannot be done as asked (a letter that is gone, a full backlog)."""


def _hot_keys(posts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ops per second of each key, summed over the workers' latest intervals."""
    rates: defaultdict[str, float] = defaultdict(float)
    now_ms = time.time() * 1000
    for post in posts:
        interval_s = max(int(post.get("interval_ms", 0)), 1) / 1000
        if now_ms - int(post.get("at", 0)) > HOT_FOR_MS:
            continue
        for key, count in _list(post, "hot"):
            rates[str(key)] += int(count) / interval_s
    ranked = sorted(rates.items(), key=lambda item: -item[1])[:SHOWN]
    return [{"key": key, "ops_per_s": round(rate, 1)} for key, rate in ranked]


def _failed(posts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    failed = [op for post in posts for op in _newest_first(post, "failed")]
    return sorted(failed, key=lambda op: -int(op.get("at", 0)))[:SHOWN]


def _list(post: dict[str, Any], name: str) -> list[Any]:
    found = post.get(name)
    return found if isinstance(found, list) else []


def _newest_first(post: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """A post's list of ops (oldest first as posted), newest first."""
    return [op for op in reversed(_list(post, name)) if isinstance(op, dict) and "keys" in op]


def _outcome(raw: bytes) -> dict[str, Any]:
    """A stored outcome as the dashboard shows it: the value (as JSON text) or the error."""
    try:
        outcome = decode_outcome(raw)
    except ValueError:
        return {"error": {"type": "?", "message": raw.decode(errors="replace")[:STATE_SHOWN]}}
    if "error" in outcome:
        return {"error": outcome["error"]}
    return {"ok": _shown(outcome["ok"])}


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 200 else text[:200] + "…"
