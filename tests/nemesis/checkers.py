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
