"""Checkers run on a finished, healed run: the history, the resolved outcomes, the final states.

An op whose caller learned its outcome must match it: applied exactly once, or (an op error,
nothing appended) not at all. An op whose outcome stayed unknown was polled for its stored
result after healing (never resubmitted); if it has one, it is held to that one; if not, it may
have applied at most once, and consistently (all of a multi-key op's keys, or none).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.nemesis.tap import Appended
from tests.nemesis.timers import TimerObserved, TimerRecord, is_cancelled
from tests.nemesis.workloads import (
    APPLIED,
    NOT_APPLIED,
    OPENING_BALANCE,
    UNKNOWN,
    History,
    OpRecord,
)

#: A stored outcome polled after healing: ("ok", value) or ("error", message).
Resolved = tuple[str, Any]


@dataclass
class Violation:
    checker: str
    what: str
    evidence: dict[str, Any]

    def describe(self) -> str:
        return f"[{self.checker}] {self.what}: {self.evidence}"


@dataclass
class Observed:
    history: History
    resolved: dict[str, Resolved]
    appended: dict[str, Appended]
    finals: dict[str, Any]
    #: When the load (and the fault schedule's clock) started.
    t0: float = 0.0
    #: Op ids the tap saw appended of which no entry is left in the stream at the end.
    gone: frozenset[str] = frozenset()
    #: Shard -> when (monotonic) a replica took its slot over from the master (a failover).
    promotions: Mapping[int, list[float]] = field(default_factory=dict)
    #: The timer workload's history and what was read back (None: the profile runs none).
    timers: TimerObserved | None = None


def effective(record: OpRecord, observed: Observed) -> tuple[str, Any]:
    """What the op must have done: the caller's outcome, else its stored one, else unknown."""
    if record.outcome != UNKNOWN:
        return record.outcome, record.value
    for op_id in op_ids_of(record, observed):
        if op_id in observed.resolved:
            status, value = observed.resolved[op_id]
            return (APPLIED, value) if status == "ok" else (NOT_APPLIED, value)
    return UNKNOWN, None


def op_ids_of(record: OpRecord, observed: Observed) -> list[str]:
    ids = [record.op_id] if record.op_id else []
    return ids + [
        seen.op_id
        for seen in observed.appended.values()
        if seen.tag == record.tag and seen.op_id not in ids
    ]


def check_all(observed: Observed) -> list[Violation]:
    violations = check_appends(observed)
    violations += check_bank(observed)
    violations += check_sessions(observed.history)
    violations += check_appended_were_applied(observed)
    violations += check_refusals(observed)
    violations += [
        Violation("client-errors", "a submit raised outside keyserial's errors", item)
        for item in observed.history.unexpected
    ]
    if observed.timers is not None:
        violations += check_timers(observed.timers)
    return violations


def _checker_of(key: str) -> str:
    return {"ctr": "counters", "lst": "lists", "ryw": "read-your-writes"}[key.split(":")[0]]


def check_appends(observed: Observed) -> list[Violation]:
    """Counters, lists and sessions: every key's final list holds each applied tag once, no
    other tag, and every list an op returned is a prefix of it (one order, Elle's list-append
    idea: no reordering, no gap, no duplicate)."""
    by_key: dict[str, list[OpRecord]] = defaultdict(list)
    for record in observed.history.records:
        if record.kind != "bank":
            by_key[record.keys[0]].append(record)
    violations: list[Violation] = []
    for key, records in sorted(by_key.items()):
        final = observed.finals.get(key) or []
        checker = _checker_of(key)
        if not isinstance(final, list):
            violations.append(
                Violation(
                    checker,
                    "the final state is not a list",
                    {"key": key, "state": repr(final)[:200]},
                )
            )
            continue
        violations += _exactly_once(checker, key, final, records, observed)
        violations += _prefixes(key, final, records, observed)
    return violations


def _exactly_once(
    checker: str, key: str, final: list[Any], records: list[OpRecord], observed: Observed
) -> list[Violation]:
    violations = []
    records_by_tag = {record.tag: record for record in records}
    for tag, times in Counter(final).items():
        if times > 1:
            evidence = {"key": key, "tag": tag, "times": times}
            if tag in records_by_tag:
                evidence = _evidence(records_by_tag[tag], observed, **evidence)
            violations.append(Violation(checker, "an op applied twice", evidence))
    submitted = set(records_by_tag)
    stray = [tag for tag in final if tag not in submitted]
    if stray:
        violations.append(
            Violation(
                checker, "applied but never submitted on this key", {"key": key, "tags": stray}
            )
        )
    present = set(final)
    for record in records:
        outcome, _ = effective(record, observed)
        evidence = _evidence(record, observed, key=key)
        if outcome == APPLIED and record.tag not in present:
            what = (
                "acknowledged op lost"
                if record.via == "reply"
                else "stored result says applied, state lacks it"
            )
            violations.append(Violation(checker, what, evidence))
        if outcome == NOT_APPLIED and record.tag in present:
            violations.append(Violation(checker, "an op reported failed was applied", evidence))
    return violations


def _prefixes(
    key: str, final: list[Any], records: list[OpRecord], observed: Observed
) -> list[Violation]:
    violations = []
    for record in records:
        outcome, value = effective(record, observed)
        if outcome != APPLIED or not isinstance(value, list):
            continue
        if not value or value[-1] != record.tag:
            violations.append(
                Violation(
                    "lists-order",
                    "an op's returned list does not end with its own value",
                    {**_evidence(record, observed, key=key), "returned_tail": value[-5:]},
                )
            )
        elif final[: len(value)] != value:
            at = next(
                (n for n, (a, b) in enumerate(zip(value, final, strict=False)) if a != b),
                min(len(value), len(final)),
            )
            violations.append(
                Violation(
                    "lists-order",
                    "a returned list is not a prefix of the key's final list",
                    {
                        **_evidence(record, observed, key=key),
                        "differs_at": at,
                        "returned_near": value[max(0, at - 2) : at + 3],
                        "final_near": final[max(0, at - 2) : at + 3],
                    },
                )
            )
    return violations


def check_bank(observed: Observed) -> list[Violation]:
    """Money conserved, nothing negative, each account's log exactly the ops that applied to
    it, each once, and a payment applied on all of its accounts or none."""
    records = [record for record in observed.history.records if record.kind == "bank"]
    accounts = sorted(
        {key for record in records for key in record.keys}
        | {key for key in observed.finals if key.startswith("acct:")}
    )
    logs: dict[str, list[str]] = {}
    balances: dict[str, int] = {}
    violations = _accounts(accounts, observed.finals, logs, balances)
    if violations:
        _twice_evidence(violations, observed)
        return violations
    violations += _payments(records, logs, observed)
    expected = dict.fromkeys(accounts, OPENING_BALANCE)
    for record in records:
        if record.tag in logs[record.keys[0]]:
            expected[record.keys[0]] -= record.amount * (len(record.keys) - 1)
            for key in record.keys[1:]:
                expected[key] += record.amount
    if balances != expected:
        wrong = {
            key: {"balance": balances[key], "from_logs": expected[key]}
            for key in accounts
            if balances[key] != expected[key]
        }
        violations.append(Violation("bank", "balances differ from the applied payments", wrong))
    if sum(balances.values()) != OPENING_BALANCE * len(accounts):
        violations.append(
            Violation(
                "bank",
                "money not conserved",
                {"total": sum(balances.values()), "opening": OPENING_BALANCE * len(accounts)},
            )
        )
    negative = {key: value for key, value in balances.items() if value < 0}
    if negative:
        violations.append(Violation("bank", "a negative balance", negative))
    return violations


def _accounts(
    accounts: list[str],
    finals: dict[str, Any],
    logs: dict[str, list[str]],
    balances: dict[str, int],
) -> list[Violation]:
    """Fill ``logs`` and ``balances`` from the final states; a log holding a tag twice is a
    violation."""
    violations = []
    for account in accounts:
        state = finals.get(account)
        if not isinstance(state, dict):
            violations.append(
                Violation(
                    "bank", "an account has no state", {"key": account, "state": repr(state)[:200]}
                )
            )
            continue
        logs[account], balances[account] = list(state["ops"]), int(state["balance"])
        applied: Counter[str] = Counter(state["ops"])
        twice = [tag for tag, times in applied.items() if times > 1]
        if twice:
            violations.append(
                Violation("bank", "a payment applied twice", {"key": account, "tags": twice})
            )
    return violations


def _twice_evidence(violations: list[Violation], observed: Observed) -> None:
    """Name the op ids and entries of each payment a log holds twice."""
    records = observed.history.by_tag()
    for violation in violations:
        for tag in violation.evidence.get("tags", []):
            if tag in records:
                violation.evidence[tag] = _evidence(records[tag], observed)


def _payments(
    records: list[OpRecord], logs: dict[str, list[str]], observed: Observed
) -> list[Violation]:
    violations = []
    touching: dict[str, set[str]] = defaultdict(set)
    for record in records:
        for key in record.keys:
            touching[key].add(record.tag)
        on = [key for key in record.keys if record.tag in logs[key]]
        outcome, _ = effective(record, observed)
        evidence = {**_evidence(record, observed), "applied_on": on}
        if on and len(on) < len(record.keys):
            violations.append(
                Violation("bank", "a payment applied on some of its keys only", evidence)
            )
        elif outcome == APPLIED and not on:
            violations.append(
                Violation(
                    "bank",
                    "acknowledged payment lost"
                    if record.via == "reply"
                    else "stored result says applied, no account logs it",
                    evidence,
                )
            )
        elif outcome == NOT_APPLIED and on:
            violations.append(Violation("bank", "a payment reported failed was applied", evidence))
    for account, log in logs.items():
        stray = [tag for tag in log if tag not in touching[account] and not tag.startswith("open-")]
        if stray:
            violations.append(
                Violation(
                    "bank",
                    "applied but never submitted on this account",
                    {"key": account, "tags": stray},
                )
            )
    return violations


def check_sessions(history: History) -> list[Violation]:
    return [
        Violation("read-your-writes", "a caller did not see its own acknowledged write", breach)
        for breach in history.session_breaches
    ]


def check_refusals(observed: Observed) -> list[Violation]:
    """No op of the load was answered with ``MalformedOperation``, the refusal of a malformed
    or misrouted op (or of an op id another op holds): the load submits none. One is a refusal
    that a worker gave an op the byzantine client appended under the caller's op id (to another
    shard, or to a shard of an older layout, under the caller's own entry id), taken as the
    caller's outcome, or stored where the caller's op looks it up."""
    violations = []
    for record in observed.history.records:
        outcome, value = effective(record, observed)
        said = record.error if record.outcome != UNKNOWN else value
        if outcome == NOT_APPLIED and "MalformedOperation" in str(said):
            violations.append(
                Violation(
                    "forged-refusal",
                    "an op of the load was answered with the refusal of a malformed or"
                    " misrouted op",
                    _evidence(record, observed, refusal=str(said)[:300]),
                )
            )
    return violations


def check_appended_were_applied(observed: Observed) -> list[Violation]:
    """Every op the tap saw appended has a stored outcome by the end (after healing): an
    appended op is run or refused, never dropped (but see :func:`lost_by_a_failover`)."""
    records = observed.history.by_tag()
    violations = []
    for op_id, seen in sorted(observed.appended.items()):
        record = records.get(seen.tag)
        if record is None or record.via == "reply" or op_id in observed.resolved:
            continue
        if lost_by_a_failover(record, seen, observed):
            continue
        violations.append(
            Violation(
                "appended-never-applied",
                "an appended op has no outcome after healing",
                {
                    **_evidence(record, observed),
                    "op_id": op_id,
                    "shard": seen.shard,
                    "entries": seen.entries,
                },
            )
        )
    return violations


#: How soon a client that still waits for an op appends it again once a failover lost its
#: entry: its sweep looks every ``idle_poll`` (1 s) at ops overdue by as much, and learning the
#: cluster's new master takes up to a second more.
REAPPEND_GRACE = 3.0


def lost_by_a_failover(record: OpRecord, seen: Appended, observed: Observed) -> bool:
    """Whether an op with no outcome is an append that a failover lost after its caller
    stopped waiting: no entry of it is left in the stream, its caller timed out or cancelled,
    and its shard's master was replaced after it was submitted and less than
    :data:`REAPPEND_GRACE` before (or after) the caller gave up. The client appends a lost
    entry again only while the submit waits; after that the docs tell the caller to resubmit
    under its op id (docs/guarantees.md, Durability), which the nemesis never does. A caller
    that went on waiting past the grace without appending again is still a violation."""
    if record.via not in ("timeout", "cancelled") or seen.op_id not in observed.gone:
        return False
    return any(
        at >= record.started and at >= record.ended - REAPPEND_GRACE
        for at in observed.promotions.get(seen.shard, [])
    )


def _evidence(record: OpRecord, observed: Observed, **extra: Any) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "tag": record.tag,
        "keys": list(record.keys),
        "op_ids": op_ids_of(record, observed),
        "own_op_id": record.own_id,
        "caller_saw": record.via or "cancelled by the run's end",
        "submitted_at": round(record.started - observed.t0, 2),
        "entries": [
            entry
            for seen in observed.appended.values()
            if seen.tag == record.tag
            for entry in seen.entries
        ],
    }
    if record.error:
        evidence["error"] = record.error[:160]
    return {**extra, **evidence}


_ACQUIRED = re.compile(
    r"^(\S+ \S+) INFO keyserial.worker: shard (\d+(?:@\d+)?): acquired \(epoch (\d+)\)",
    re.MULTILINE,
)


def check_epochs(worker_logs: Mapping[str, str]) -> list[Violation]:
    """No two owners of a shard under one fencing epoch (worker log name -> its text): fencing
    could not tell them apart, and each would commit on its own view of the shard. Every write
    of the runs persists (``appendfsync always``), so only a failover that loses an epoch bump
    could hand an epoch out twice."""
    owners: defaultdict[tuple[str, int], list[str]] = defaultdict(list)
    for name, text in sorted(worker_logs.items()):
        for when, shard, epoch in _ACQUIRED.findall(text):  # (shard: "3", or "3@2" after a
            owners[(shard, int(epoch))].append(f"{name} at {when}")  # reshard)
    return [
        Violation(
            "epochs",
            "two owners of a shard under one epoch",
            {"shard": shard, "epoch": epoch, "owners": holders},
        )
        for (shard, epoch), holders in sorted(owners.items())
        if len(holders) > 1
    ]


#: How far before the due time this process computed a stamp's clock may read (5 ms): Redis
#: floors its clock to the millisecond before adding the delay (which the client rounds up), and
#: Redis, the workers and this process read one machine's clock, so 1 ms would do; the rest is
#: room for float rounding, never for a timer run early.
TIMER_CLOCK_SLACK = 0.005
#: Two timers are held to their order in the key's list only when the earlier one's latest
#: possible due time comes this much (50 ms) before the later one's earliest (each due time
#: known between the push, or the setting op's commit, and its acknowledgement, plus the delay).
TIMER_ORDER_MARGIN = 0.05
#: At most this many order violations are reported per key (then their count).
_ORDER_REPORTED = 5


@dataclass
class _Fired:
    """One entry of a timer key's list: its position, label and clock (None: an append)."""

    index: int
    label: str
    clock: float | None


def check_timers(observed: TimerObserved) -> list[Violation]:
    """The timer workload (``timers.TimerLoad``), key by key, once every timer has had time to
    fire (docs/guarantees.md, Delayed ops):

    - fired once: each label at most once in its key's list; an acknowledged delayed op, and an
      acknowledged timer that no cancel which may have applied names, exactly once; an op or
      timer whose stored outcome is a value in it once (its stamp's clock that value), and one
      with no stored outcome not in it (a state write commits with its outcome); nothing from a
      setting op that failed, nor from a delayed op answered with an error;
    - never early: a stamp's clock is at least its earliest possible due time, less
      :data:`TIMER_CLOCK_SLACK`;
    - cancelled never fired: a timer answered ``keyserial.TimerCancelled`` is not in the list,
      and only a cancel which may have applied makes it so; after an acknowledged cancel of a
      timer whose setting op ran, the timer has an outcome (ran, or cancelled), and one that ran
      (a stamp) ran before the cancel was acknowledged;
    - per-key order: of two acknowledged ops that waited in the timers, the one due earlier
      (its latest possible due time :data:`TIMER_ORDER_MARGIN` before the other's earliest) is
      earlier in the list.
    """
    violations = [
        Violation(
            "client-errors", "a timer workload submit raised outside keyserial's errors", item
        )
        for item in observed.history.unexpected
    ]
    if not observed.stable:
        violations.append(
            Violation(
                "harness",
                "the timer keys' lists kept changing after every timer was due",
                {"keys": sorted(observed.finals)},
            )
        )
    by_key: dict[str, list[TimerRecord]] = defaultdict(list)
    for record in observed.history.records:
        by_key[record.key].append(record)
    for key, records in sorted(by_key.items()):
        violations += _check_timer_key(key, records, observed)
    return violations


def _check_timer_key(
    key: str, records: list[TimerRecord], observed: TimerObserved
) -> list[Violation]:
    final = observed.finals.get(key) or []
    if isinstance(final, dict) and "unread" in final:  # (see ``TimerLoad._read``)
        return [Violation("harness", "a timer key could not be read", {"key": key, **final})]
    fired, malformed = _timer_entries(final)
    if not isinstance(final, list) or malformed:
        return [
            Violation(
                "timers-once",
                "a timer key's state is not a list of stamps and labels",
                {"key": key, "state": repr(final)[:300], "malformed": malformed[:5]},
            )
        ]
    violations = []
    by_label: dict[str, list[_Fired]] = defaultdict(list)
    for entry in fired:
        by_label[entry.label].append(entry)
    stray = sorted(set(by_label) - {record.tag for record in records})
    if stray:
        violations.append(
            Violation(
                "timers-once",
                "a label no caller submitted on this key",
                {"key": key, "labels": stray[:10]},
            )
        )
    cancels: dict[str, list[TimerRecord]] = defaultdict(list)
    for record in records:
        if record.kind == "cancel" and record.target:
            cancels[record.target].append(record)
    for record in records:
        entries = by_label.get(record.tag, [])
        if record.kind == "delayed":
            violations += _check_delayed(record, entries, observed)
        elif record.kind == "set":
            timer = _Timer(record, entries, cancels.get(record.timer_id or "", []), observed)
            violations += timer.check()
    violations += _check_timer_order(key, records, by_label, observed)
    return violations


def _timer_entries(final: Any) -> tuple[list[_Fired], list[Any]]:
    """A timer key's list as its entries: ``[label, clock]`` (a stamp) or ``label`` (an
    append); and the entries of neither form."""
    if not isinstance(final, list):
        return [], []
    fired, malformed = [], []
    for index, entry in enumerate(final):
        if isinstance(entry, str):
            fired.append(_Fired(index, entry, None))
        elif (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], (int, float))
        ):
            fired.append(_Fired(index, entry[0], float(entry[1])))
        else:
            malformed.append(entry)
    return fired, malformed


def _timer_outcome(record: TimerRecord, observed: TimerObserved) -> tuple[str, Any]:
    """What the record's op did: its caller's outcome, else the one stored under its id, else
    unknown (as :func:`effective` for the other workloads)."""
    if record.outcome != UNKNOWN:
        return record.outcome, record.value if record.outcome == APPLIED else record.error
    stored = observed.outcomes.get(record.op_id or "")
    if stored is None:
        return UNKNOWN, None
    return (APPLIED, stored[1]) if stored[0] == "ok" else (NOT_APPLIED, stored[1])


def _timer_evidence(record: TimerRecord, observed: TimerObserved, **extra: Any) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "key": record.key,
        "label": record.tag,
        "kind": record.kind,
        "call": f"{record.call.name}{tuple(record.call.args)}",
        "how": record.how,
        "op_id": record.op_id,
        "caller_saw": record.via or "nothing (the run ended first)",
        "sent": _at(observed, record.sent),
        "answered": _at(observed, record.answered),
        "due_between": [_at(observed, record.earliest), _at(observed, record.latest)],
        "stored": observed.outcomes.get(record.op_id or ""),
    }
    if record.kind == "set":
        evidence["timer_id"] = record.timer_id
        evidence["timer_outcome"] = observed.outcomes.get(record.timer_id or "")
    if record.error:
        evidence["error"] = record.error[:200]
    return {**extra, **evidence}


def _check_delayed(
    record: TimerRecord, entries: list[_Fired], observed: TimerObserved
) -> list[Violation]:
    violations = []
    outcome, value = _timer_outcome(record, observed)
    ran = [entry.index for entry in entries]
    if len(entries) > 1:
        violations.append(
            Violation(
                "timers-once", "a delayed op ran twice", _timer_evidence(record, observed, at=ran)
            )
        )
    if not entries and ((record.acked and outcome != NOT_APPLIED) or outcome == APPLIED):
        what = (
            "an acknowledged delayed op never ran"
            if record.acked
            else "a delayed op's stored outcome says it ran, the key's list lacks it"
        )
        violations.append(Violation("timers-once", what, _timer_evidence(record, observed)))
    if entries and outcome == NOT_APPLIED:
        violations.append(
            Violation(
                "timers-once",
                "a delayed op answered with an error ran",
                _timer_evidence(record, observed, at=ran),
            )
        )
    if entries and outcome == APPLIED and entries[0].clock != value:
        violations.append(
            Violation(
                "timers-once",
                "a delayed op's outcome is not the stamp in the key's list",
                _timer_evidence(
                    record, observed, outcome=value, stamp=_at(observed, entries[0].clock)
                ),
            )
        )
    if entries and record.op_id and record.op_id not in observed.outcomes:
        violations.append(
            Violation(
                "timers-once",
                "a delayed op in the key's list has no stored outcome",
                _timer_evidence(record, observed, at=ran),
            )
        )
    violations += _check_early(record, entries, record.earliest, observed)
    return violations


def _check_early(
    record: TimerRecord, entries: list[_Fired], earliest: float, observed: TimerObserved
) -> list[Violation]:
    return [
        Violation(
            "timers-early",
            "an op ran before its due time",
            _timer_evidence(
                record,
                observed,
                stamp=_at(observed, entry.clock),
                early_by=round(earliest - entry.clock, 4),
            ),
        )
        for entry in entries
        if entry.clock is not None and entry.clock < earliest - TIMER_CLOCK_SLACK
    ]


class _Timer:
    """A timer an op set (a set record), what its key's list holds of it, and the cancels that
    name it."""

    def __init__(
        self,
        record: TimerRecord,
        entries: list[_Fired],
        cancels: list[TimerRecord],
        observed: TimerObserved,
    ) -> None:
        self.record, self.entries, self.cancels, self.observed = record, entries, cancels, observed
        self.setter = _timer_outcome(record, observed)[0]
        self.stored = observed.outcomes.get(record.timer_id) if record.timer_id else None
        #: Cancels that may have applied: acknowledged, or unknown, or stored as ok.
        self.cancelling = [
            cancel for cancel in cancels if _timer_outcome(cancel, observed)[0] != NOT_APPLIED
        ]
        self.violations: list[Violation] = []

    def check(self) -> list[Violation]:
        self._once()
        self._cancelled()
        self.violations += _check_early(
            self.record, self.entries, self.record.earliest, self.observed
        )
        return self.violations

    def flag(self, checker: str, what: str, **extra: Any) -> None:
        evidence = _timer_evidence(self.record, self.observed, **extra)
        if self.entries:
            evidence["at"] = [entry.index for entry in self.entries]
        if self.cancels:
            evidence["cancels"] = [
                {
                    "label": cancel.tag,
                    "caller_saw": cancel.via,
                    "stored": self.observed.outcomes.get(cancel.op_id or ""),
                    "sent": _at(self.observed, cancel.sent),
                    "answered": _at(self.observed, cancel.answered),
                }
                for cancel in self.cancels
            ]
        self.violations.append(Violation(checker, what, evidence))

    def _once(self) -> None:
        entries, stored, record = self.entries, self.stored, self.record
        ran = stored is not None and stored[0] == "ok"
        value = stored[1] if stored is not None else None
        if len(entries) > 1:
            self.flag("timers-once", "a timer fired twice")
        if (record.fails or self.setter == NOT_APPLIED) and (entries or stored is not None):
            self.flag("timers-once", "a timer set by an op that failed ran, or has an outcome")
        if entries and record.timer_id and stored is None:
            self.flag("timers-once", "a timer in the key's list has no stored outcome")
        if ran and not entries:
            self.flag(
                "timers-once", "a timer's stored outcome says it ran, the key's list lacks it"
            )
        if ran and entries and entries[0].clock is not None and value != entries[0].clock:
            self.flag(
                "timers-once",
                "a timer's outcome is not the stamp in the key's list",
                stamp=_at(self.observed, entries[0].clock),
            )
        if (
            self.setter == APPLIED
            and not record.fails
            and not self.cancelling
            and (not entries or stored is None)
        ):
            self.flag(
                "timers-once",
                "an acknowledged timer never fired"
                if record.outcome == APPLIED
                else "a timer whose setting op's stored outcome says it ran never fired",
            )

    def _cancelled(self) -> None:
        stored = self.stored
        if is_cancelled(stored) and self.entries:
            self.flag("timers-cancel", "a timer answered as cancelled ran")
        if is_cancelled(stored) and self.setter == APPLIED and not self.cancelling:
            self.flag(
                "timers-cancel", "a timer answered as cancelled that no cancel may have applied to"
            )
        if self.setter != APPLIED:
            return
        for cancel in self.cancels:
            if cancel.outcome != APPLIED or cancel.answered is None:
                continue
            if stored is None:
                self.flag(
                    "timers-cancel",
                    "an acknowledged cancel left its timer without an outcome",
                    cancel=cancel.tag,
                )
                continue
            clock = self.entries[0].clock if self.entries else None
            if (
                stored[0] == "ok"
                and clock is not None
                and clock > cancel.answered + TIMER_CLOCK_SLACK
            ):
                self.flag(
                    "timers-cancel",
                    "a timer ran after the op that cancelled it was acknowledged",
                    cancel=cancel.tag,
                    stamp=_at(self.observed, clock),
                    cancel_answered=_at(self.observed, cancel.answered),
                )


def _check_timer_order(
    key: str,
    records: list[TimerRecord],
    by_label: dict[str, list[_Fired]],
    observed: TimerObserved,
) -> list[Violation]:
    """Pairs of acknowledged ops that waited in the timers, each once in the list, the first
    due clearly before the second (by :data:`TIMER_ORDER_MARGIN`) yet after it in the list."""
    placed = []
    for record in records:
        entries = by_label.get(record.tag, [])
        latest = record.latest
        if not record.timed or len(entries) != 1 or latest is None:
            continue
        if record.kind == "set" and (record.outcome != APPLIED or record.fails):
            continue
        placed.append((record, entries[0], record.earliest, latest))
    inverted = [
        (first, second)
        for first in placed
        for second in placed
        if first[3] + TIMER_ORDER_MARGIN < second[2] and first[1].index > second[1].index
    ]
    violations = []
    for first, second in inverted[:_ORDER_REPORTED]:
        violations.append(
            Violation(
                "timers-order",
                "an op due earlier ran after one due later on its key",
                {
                    "key": key,
                    "due_first": _placed(first, observed),
                    "due_later_ran_first": _placed(second, observed),
                    "apart_at_least": round(second[2] - first[3], 3),
                },
            )
        )
    if len(inverted) > _ORDER_REPORTED:
        violations.append(
            Violation(
                "timers-order",
                "more ops due earlier ran after ones due later on this key",
                {"key": key, "pairs": len(inverted)},
            )
        )
    return violations


def _placed(
    placed: tuple[TimerRecord, _Fired, float, float], observed: TimerObserved
) -> dict[str, Any]:
    record, entry, earliest, latest = placed
    return {
        "label": record.tag,
        "kind": record.kind,
        "call": f"{record.call.name}{tuple(record.call.args)}",
        "how": record.how,
        "index": entry.index,
        "due_between": [_at(observed, earliest), _at(observed, latest)],
        "ran": _at(observed, entry.clock),
        "sent": _at(observed, record.sent),
        "answered": _at(observed, record.answered),
    }


def _at(observed: TimerObserved, wall: float | None) -> str | None:
    """A wall-clock time as the fault log shows times: seconds since the load began."""
    return None if wall is None else f"t={wall - observed.began:.3f}s"
