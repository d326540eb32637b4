"""The timer workload: delayed ops and timers that ops set, on keys of their own, and what is
read back once they have all had time to fire (judged by ``checkers.check_timers``).

Callers, each sequential and drawing from a stream of its own (``timers:<n>``: adding them left
every other draw of a seed as it was), submit on the keys ``timer:<n>`` (one per shard):

- a delayed op, ``stamp(label)`` (it appends ``[label, the worker's clock]`` to the key's list),
  enqueued or submitted and awaited, with ``delay=`` 0 to 2 s or ``at=`` up to 2 s ahead;
- an op that sets a timer: ``stamp_later(seconds, label)`` (the timer's op is ``stamp(label)``),
  or ``append_later(seconds, label)`` (``append(label)``, inline or in a worker thread; set from
  a worker thread by ``append_later_in_thread``; or set by an op that then raises: none must be
  set), submitted and awaited: its reply is the timer's id;
- a cancel, ``cancel_timer(timer_id)`` (or ``cancel_timer_in_thread``), of one of the last
  timers set on the key whose setting op was acknowledged (so the cancel runs after it).

Each label is the submission's tag, unique in the run. Every record keeps ``time.time()`` just
before sending and just after an acknowledgement: an op's due time is Redis's clock at its push
(or at the commit of the op that set it) plus its delay, and Redis runs on this machine, so it
lies between those two plus the delay. A submit is never retried; one whose caller learned
nothing (a timeout, a fault) may or may not have applied, and its outcome is looked up by id.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio

import keyserial
from keyserial import (
    BackendUnavailable,
    BacklogFull,
    KeyserialError,
    OperationFailed,
    SubmitTimeout,
)
from tests import apps
from tests.helpers import keys_on_shard
from tests.nemesis.schedule import Profile, rng_for
from tests.nemesis.workloads import APPLIED, NOT_APPLIED, UNKNOWN

#: What a timer caller draws, with weights (a cancel with no timer to cancel on its key sends a
#: delayed op instead).
TIMER_KIND_WEIGHTS = {"delayed": 5, "set": 3, "cancel": 2}
#: The longest delay drawn, in seconds.
LONGEST_DELAY = 2.0
#: A cancel picks one of the last this many timers acknowledged on its key.
CANCEL_AMONG = 6
#: The error type a cancelled timer's op is answered with.
TIMER_CANCELLED = keyserial.TimerCancelled.wire_type
#: Once the load has drained, timers are given until the latest due time any of them can have,
#: plus this, to fire and run (outcomes polled meanwhile); then until ``resolve_seconds`` more
#: for an acknowledged one still without an outcome.
SETTLE_GRACE = 2.0

#: A stored outcome: ("ok", value) or ("error", "<error type>: <message>").
Outcome = tuple[str, Any]


@dataclass
class TimerRecord:
    """One submission of the timer workload and what its caller learned."""

    tag: str  # the label its stamp or append writes; its op id too if ``own_id``
    kind: str  # delayed | set | cancel
    key: str
    call: keyserial.Call[Any]
    own_id: bool
    op_id: str | None = None
    #: enqueue (returns once appended) or submit (waits for the outcome).
    how: str = "submit"
    #: Seconds after the push (delayed) or the setting op's commit (set) the op is due.
    delay: float = 0.0
    #: ``at=`` given (Unix seconds), instead of ``delay``.
    at: float | None = None
    #: The timer's op: "stamp" or "append" (set records).
    fires: str = ""
    #: A setting op that raises after setting its timer (none must be set).
    fails: bool = False
    #: The timer a cancel names.
    target: str | None = None
    #: The timer a set record's op set (from its reply, or ``<own op id>#t1``).
    timer_id: str | None = None
    #: Whether the caller was acknowledged: the op appended (enqueue), or its outcome (submit).
    acked: bool = False
    #: applied (a value came back), not-applied (an op error, nothing appended), unknown.
    outcome: str = UNKNOWN
    value: Any = None
    error: str = ""
    #: How the outcome was learned ("reply", "appended") or why not (timeout, unavailable,
    #: append-failed, cancelled, unexpected).
    via: str = ""
    #: ``time.time()`` just before sending, and just after the acknowledgement (None: none).
    sent: float = 0.0
    answered: float | None = None
    #: ``time.time()`` when the call returned or raised.
    ended: float = 0.0

    def __post_init__(self) -> None:
        if self.own_id:
            self.op_id = self.tag

    @property
    def earliest(self) -> float:
        """The earliest its due time can be (Unix seconds; before the ms rounding)."""
        return self.at if self.at is not None else self.sent + self.delay

    @property
    def latest(self) -> float | None:
        """The latest its due time can be if acknowledged (the push, or the setting op's
        commit, came before the reply), else None."""
        if self.answered is None:
            return None
        if self.at is not None:
            return max(self.answered, self.at)
        return self.answered + self.delay

    @property
    def timed(self) -> bool:
        """Whether its op surely waited in the shard's timers: any timer an op set, and a
        delayed op due later than its push (a delay, or an ``at`` past its acknowledgement; an
        op due at its push is appended as any other)."""
        if self.kind == "set":
            return True
        if self.kind != "delayed":
            return False
        if self.at is None:
            return self.delay > 0
        return self.answered is not None and self.at > self.answered


@dataclass
class TimerHistory:
    records: list[TimerRecord] = field(default_factory=list)
    #: Exceptions a submit must never raise (anything outside keyserial's documented set).
    unexpected: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TimerObserved:
    """What the timer checkers judge: the history, each key's final list, and the outcomes
    stored for every op id and timer id known (absent: none stored)."""

    history: TimerHistory
    finals: dict[str, Any]
    outcomes: dict[str, Outcome]
    #: Whether the final lists were read twice, equal, with the outcomes read in between (so
    #: that every stamp in a list has its outcome stored, and none absent has).
    stable: bool = True
    #: When the load began (``time.time()``): evidence gives times as the fault log does.
    began: float = 0.0


def timer_keys(profile: Profile) -> list[str]:
    """One key per shard of the profile's layout."""
    return [
        keys_on_shard(shard, profile.shard_count, 1, "timer")[0]
        for shard in range(profile.shard_count)
    ]


class TimerLoad:
    """Timer callers submitting until ``stop()``; every outcome goes to ``history``."""

    def __init__(self, seed: int, profile: Profile, clients: list[keyserial.Client]) -> None:
        self.seed = seed
        self.profile = profile
        self.clients = clients
        self.keys = timer_keys(profile)
        self.history = TimerHistory()
        #: Key -> the ids of the timers set on it whose setting op was acknowledged.
        self.timers: dict[str, list[str]] = defaultdict(list)
        self._stopping = False
        #: (Made as the run's faults are: their log counts from then.)
        self.began = time.time()

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            for caller in range(self.profile.timer_callers):
                group.start_soon(self._caller, caller)

    async def _caller(self, caller: int) -> None:
        rng = rng_for(self.seed, f"timers:{caller}")
        client = self.clients[caller % len(self.clients)]
        kinds = list(TIMER_KIND_WEIGHTS)
        weights = [TIMER_KIND_WEIGHTS[kind] for kind in kinds]
        number = 0
        while not self._stopping:
            number += 1
            tag = f"{self.seed}-t{caller}-{number}"
            # (A fixed number of draws each time, whatever the run learned: a seed draws the
            # same ops every run.)
            key = rng.choice(self.keys)
            kind = rng.choices(kinds, weights)[0]
            own_id = rng.random() < 0.5
            seconds = round(rng.uniform(0.0, LONGEST_DELAY), 3) if rng.random() < 0.9 else 0.0
            variant = rng.random()
            pick = rng.random()
            cancel_after = rng.uniform(0.001, 0.5) if rng.random() < 0.05 else None
            pause = rng.uniform(0.0, self.profile.timer_pause)
            if not self.profile.callers_cancel:
                cancel_after = None
            candidates = self.timers[key][-CANCEL_AMONG:]
            if kind == "cancel" and not candidates:
                kind = "delayed"
            if kind == "delayed":
                record = self._delayed(tag, key, own_id, seconds, variant)
            elif kind == "set":
                record = self._set(tag, key, own_id, seconds, variant)
            else:
                target = candidates[int(pick * len(candidates))]
                call = (apps.cancel_timer if variant < 0.7 else apps.cancel_timer_in_thread)(target)
                record = TimerRecord(tag, "cancel", key, call, own_id, target=target)
            await self._submit(client, record, None if record.how == "enqueue" else cancel_after)
            if record.kind == "set" and record.outcome == APPLIED and record.timer_id:
                self.timers[key].append(record.timer_id)
            await anyio.sleep(pause)

    def _delayed(
        self, tag: str, key: str, own_id: bool, seconds: float, variant: float
    ) -> TimerRecord:
        how = "enqueue" if variant < 0.5 or 0.85 <= variant < 0.925 else "submit"
        record = TimerRecord(tag, "delayed", key, apps.stamp(tag), own_id, how=how)
        if variant >= 0.85:
            record.at = seconds  # (seconds ahead, made a time when sent)
        else:
            record.delay = seconds
        return record

    def _set(self, tag: str, key: str, own_id: bool, seconds: float, variant: float) -> TimerRecord:
        record = TimerRecord(tag, "set", key, apps.stamp_later(seconds, tag), own_id, delay=seconds)
        record.fires = "append" if variant < 0.6 else "stamp"
        if variant < 0.3:
            record.call = apps.append_later(seconds, tag)
        elif variant < 0.4:
            record.call = apps.append_later(seconds, tag, threaded=True)
        elif variant < 0.5:
            record.call = apps.append_later_in_thread(seconds, tag)
        elif variant < 0.6:
            record.call, record.fails = apps.append_later(seconds, tag, fail=True), True
        return record

    async def _submit(
        self, client: keyserial.Client, record: TimerRecord, cancel_after: float | None
    ) -> None:
        self.history.records.append(record)
        try:
            with anyio.move_on_after(cancel_after) as scope:
                await self._send(client, record)
            if scope.cancelled_caught:
                record.via = "cancelled"
        except OperationFailed as error:  # the op ran (or was refused) and failed
            record.outcome, record.via, record.acked = NOT_APPLIED, "reply", True
            record.error = f"{error.error_type}: {error}"[:300]
            record.op_id = record.op_id or error.op_id
        except BacklogFull as error:  # nothing was appended (a submit); maybe (an enqueue)
            if record.how == "submit":
                record.outcome, record.acked = NOT_APPLIED, True
            record.via, record.error = "backlog", str(error)[:300]
        except (SubmitTimeout, BackendUnavailable) as error:
            record.via = "timeout" if isinstance(error, SubmitTimeout) else "unavailable"
            record.op_id = record.op_id or error.op_id
            record.error = str(error)[:300]
        except KeyserialError as error:  # the append failed mid-way: maybe appended
            record.via, record.error = "append-failed", str(error)[:300]
        except Exception as error:
            record.via, record.error = "unexpected", repr(error)[:300]
            self.history.unexpected.append(
                {"tag": record.tag, "key": record.key, "error": record.error}
            )
        record.ended = time.time()
        if record.kind == "set" and record.timer_id is None and record.op_id:
            record.timer_id = f"{record.op_id}#t1"

    async def _send(self, client: keyserial.Client, record: TimerRecord) -> None:
        """Send the record's op (``sent`` just before), and note its acknowledgement."""
        timeout = self.profile.submit_timeout
        when: dict[str, Any] = {}
        record.sent = time.time()
        if record.kind == "delayed" and record.at is not None:
            record.at += record.sent  # (drawn as seconds ahead)
            when["at"] = datetime.fromtimestamp(record.at, tz=UTC)
        elif record.kind == "delayed":
            when["delay"] = record.delay
        if record.how == "enqueue":
            record.op_id = await client.enqueue(
                record.key, record.call, op_id=record.op_id, timeout=timeout, **when
            )
            record.via = "appended"
        else:
            record.value = await client.submit(
                record.key, record.call, op_id=record.op_id, timeout=timeout, **when
            )
            record.outcome, record.via = APPLIED, "reply"
            if record.kind == "set":
                record.timer_id = record.value
        record.acked, record.answered = True, time.time()

    async def observe(self, client: keyserial.Client) -> TimerObserved:
        """Once the load has drained and every fault healed: poll the outcomes of every op and
        timer id known until each acknowledged one has one and the latest due time any timer
        can have is :data:`SETTLE_GRACE` past (or ``resolve_seconds`` more have passed), then
        read the keys' lists, the outcomes again, and the lists again, until two reads agree."""
        records = self.history.records
        lookups = _lookups(records)
        outcomes: dict[str, Outcome] = {}
        # (A push a held link delivered as it healed, before now, is due by now plus its
        # delay at the latest; a setting op queued behind others commits soon after.)
        now = time.time()
        due = [
            max(now, record.at or 0.0) + record.delay
            for record in records
            if record.kind in ("delayed", "set")
        ]
        settled = max([now, *due]) + SETTLE_GRACE
        give_up = settled + self.profile.resolve_seconds
        awaited = _awaited(records)
        while True:
            await _resolve(client, lookups, outcomes)
            now = time.time()
            if now >= give_up or (now >= settled and awaited <= set(outcomes)):
                break
            await anyio.sleep(0.25)
        finals = await self._read(client)
        stable = False
        for _ in range(5):
            await _resolve(client, lookups, outcomes)
            again = await self._read(client)
            if again == finals:
                stable = True
                break
            finals = again
        return TimerObserved(self.history, finals, outcomes, stable, self.began)

    async def _read(self, client: keyserial.Client) -> dict[str, Any]:
        finals: dict[str, Any] = {}
        for key in self.keys:
            try:
                with anyio.fail_after(self.profile.liveness_bound):
                    finals[key] = await client.read(key)
            except (KeyserialError, TimeoutError) as error:
                finals[key] = {"unread": repr(error)[:200]}
        return finals


def _lookups(records: list[TimerRecord]) -> dict[str, tuple[str, keyserial.Call[Any] | None]]:
    """Every id whose outcome is looked up -> its key, and the op it must be (None: a timer's
    op, which no caller submitted)."""
    lookups: dict[str, tuple[str, keyserial.Call[Any] | None]] = {}
    for record in records:
        if record.op_id:
            lookups[record.op_id] = (record.key, record.call)
        if record.timer_id:
            lookups[record.timer_id] = (record.key, None)
    return lookups


def _awaited(records: list[TimerRecord]) -> set[str]:
    """The ids that must have an outcome by the end: acknowledged delayed ops under a known id,
    and the timers acknowledged setting ops set (cancelled or run, either way an outcome)."""
    awaited = set()
    for record in records:
        if (
            record.kind == "delayed"
            and record.acked
            and record.outcome != NOT_APPLIED
            and record.op_id
        ):
            awaited.add(record.op_id)
        if (
            record.kind == "set"
            and record.outcome == APPLIED
            and not record.fails
            and record.timer_id
        ):
            awaited.add(record.timer_id)
    return awaited


async def _resolve(
    client: keyserial.Client,
    lookups: dict[str, tuple[str, keyserial.Call[Any] | None]],
    outcomes: dict[str, Outcome],
) -> None:
    """Look up every id without a stored outcome yet (one stored never changes)."""
    limiter = anyio.CapacityLimiter(32)

    async def one(op_id: str, key: str, op: keyserial.Call[Any] | None) -> None:
        async with limiter:
            try:
                outcomes[op_id] = ("ok", await client.result(op_id, key=key, op=op))
            except OperationFailed as error:
                outcomes[op_id] = ("error", f"{error.error_type}: {error}"[:300])
            except KeyserialError:  # ResultNotFound: not yet; BackendUnavailable: later
                pass

    async with anyio.create_task_group() as group:
        for op_id, (key, op) in lookups.items():
            if op_id not in outcomes:
                group.start_soon(one, op_id, key, op)


def is_cancelled(outcome: Outcome | None) -> bool:
    return outcome is not None and outcome[0] == "error" and outcome[1].startswith(TIMER_CANCELLED)
