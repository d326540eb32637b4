"""What a step commits: the finished ops' results and writes, how far progress moves, which
entries leave the stream, and when results start a new generation.

Progress only passes an entry once all its ops have committed (an op that committed ahead of
it is skipped on replay because its result exists). A stuck op must hold its own entry only,
so entries whose ops have all committed behind it are deleted from the stream on their own.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .._scripts.commit import StepCommit
from .._wire.codec import answered_record, bound, reply_outcome
from .._wire.layout import ShardKeys, answered_field
from .execution import Entry, Run, cancelled_outcome
from .timers import TimerChanges
from .writes import WriteChain

#: Committed entries a busy shard leaves in its stream at most before a step trims them.
TRIM_EVERY = 32

#: A dead letter: the entry id, why, and the raw entry as JSON.
DeadLetter = tuple[str, str, str]


@dataclass(slots=True)
class Finished:
    """An op's outcome waiting for the next commit."""

    op_id: str
    outcome: str
    entries: list[Entry]
    replies: list[str]
    store: bool = True
    #: Not stored, but recorded as answered (``<op id>#u``): an op refused because no worker
    #: knows it yet, whose id must stay free for a resubmit once it is deployed. A takeover
    #: then never counts it among the ops that may have killed the owner.
    answered: bool = False
    #: The binding of the op that ran (``_wire.codec.binding``), stored with its outcome; '' for
    #: none (a refusal, a grant request's answer).
    binding: str = ""
    #: A grant request's answer: the hold it ends, its field in the shard's held hash ('' for
    #: none), deleted by the step that commits the answer.
    releases: str = ""
    #: The timers the op set and cancelled, which commit with its outcome (None: none).
    timers: TimerChanges | None = None
    #: The run this is the outcome of, which leaves this owner's memory once it commits. None:
    #: an answer to an entry that only names an op id (a copy refused as another op's or as a
    #: record's name, answered with a stored or running op's outcome, salvaged), which leaves
    #: any run of that id be.
    run: Run | None = None


@dataclass(slots=True, eq=False)
class Record:
    """A cross-shard record that commits with the owner's next step (docs/multi-key.md): a
    hold of this shard's keys (skipped if its attempt's part here is over already), or the
    decision of an attempt this owner coordinates (written once). Riding the step, it
    commits after every earlier write of the shard and costs no script call of its own; its
    messages go out once it has committed (the output gate)."""

    #: Its field: in the shard's held hash (``<op id>#<attempt>``), or in its results hash
    #: (a decision, ``<op id>#<attempt>#d``); '' for none: a lent grant that only waits for
    #: the step to commit its keys' earlier writes.
    name: str
    value: str
    #: What to publish once committed: (channel, coordination message), unsigned (the
    #: pipeliner signs and batches them per channel).
    messages: list[tuple[str, str]]
    #: A hold (False: a decision).
    hold: bool = False
    #: Called once the step that carried it has committed (see :attr:`error`).
    on_committed: Callable[[Record], None] | None = None
    #: Why it cannot be counted on although its step returned (not confirmed as durable).
    error: Exception | None = None
    #: A hold its step did not record: its attempt has an outcome on the shard already (the
    #: request came again after the answer), so nothing is held for it.
    skipped: bool = False


@dataclass(frozen=True, slots=True)
class OtherWrites:
    """A cross-shard op's writes to another shard that its home's owner owns too."""

    keys: ShardKeys
    #: That shard's owner's epoch: the step writes nothing if it has moved on.
    epoch: int
    #: (key, JSON state or '' to delete).
    writes: Sequence[tuple[str, str]]


@dataclass(slots=True, eq=False)
class AcrossCommit:
    """The writes of a cross-shard op to the other shards of its home's owner, on a standalone
    server: they ride the home's next step with the op's result and home writes, one script
    fenced by every shard's epoch, so the op needs no grant or decision records."""

    writes: list[OtherWrites]
    #: The other shards' owners' write chains (the step builds on their cached states).
    write_chains: list[WriteChain]
    #: Told once the step is back: True if it committed, False if it wrote nothing, None if
    #: that is not known (the runner stopped while it was in flight).
    settle: Callable[[bool | None], None]


@dataclass(frozen=True, slots=True)
class Commit:
    """The commit part of one step."""

    #: The last entry whose ops have all finished, or '' to keep progress where it is.
    progress: str
    #: What the step script commits, or None when there is nothing.
    payload: StepCommit | None
    #: The outcomes to reply once committed: channel -> [(op id, outcome)].
    replies: Mapping[str, Sequence[tuple[str, str]]]
    #: The last committed entry to trim through ('' for none), and whether to trim it now (else
    #: only if the fetch finds nothing new).
    trim_to: str
    trim_now: bool
    #: Whether it commits states or results (what later ops build on, or callers are told).
    builds: bool
    #: The records' messages, to publish once committed with the replies.
    messages: list[tuple[str, str]]
    #: The other shards whose writes the payload's "o" carries, in its order.
    others: list[ShardKeys] = field(default_factory=list)


class CommitPlanner:
    """Tracks a runner's fetched entries and plans each step's commit.

    Committed entries leave the stream every ``TRIM_EVERY`` of them, and when a step fetches
    nothing new; but while entries come pushed (see ``submit.lua``), at most once every
    ``trim_interval`` seconds: nearly every step then fetches nothing, and a trim each time
    would cost a command per step."""

    def __init__(self, shard: ShardKeys, trim_interval: float) -> None:
        #: The shard its replies name (the generation too: see ``_wire.codec.reply_outcome``).
        self._shard = shard
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        #: The last committed entry still in the stream ('' if none), and how many such entries.
        self._untrimmed = ""
        self._untrimmed_entries = 0
        self._trim_interval = trim_interval
        self._trimmed_at = time.monotonic()
        #: Whether an entry came pushed since the last trim.
        self._pushed = False
        #: The fewest fetched entries held since :meth:`_passed_by_ops` last looked.
        self._fewest = 0

    def track(self, entry: Entry) -> None:
        self._entries[entry.entry_id] = entry

    def plan(
        self,
        batch: Sequence[Finished],
        dead: Sequence[DeadLetter],
        writes: list[tuple[str, str]],
        records: Sequence[Record] = (),
        others: Sequence[OtherWrites] = (),
        *,
        pushed: bool = False,
    ) -> Commit:
        """The commit of ``batch``, ``dead`` letters, the pending ``writes``, the cross-shard
        ``records`` and the cross-shard ops' writes to ``others``; ``pushed``: an entry came
        pushed since the last step."""
        self._pushed |= pushed
        results: list[tuple[str, str]] = []
        answered: list[tuple[str, str]] = []
        released: list[str] = []
        timers: list[TimerChanges] = []
        replies: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for finished in batch:
            for entry in finished.entries:
                entry.remaining -= 1
            if finished.timers is not None:
                timers.append(finished.timers)
            if finished.releases:
                released.append(finished.releases)
            if finished.store:
                results.append((finished.op_id, bound(finished.outcome, finished.binding)))
            elif finished.answered:
                places = [entry.place for entry in finished.entries]
                answered.append(
                    (answered_field(finished.op_id), answered_record(finished.outcome, places))
                )
            self._reply(finished, replies)
        progress = self._advance_progress()
        passed = self._passed_by_ops()
        if progress:
            self._untrimmed = progress
        trim_now = self._untrimmed_entries >= TRIM_EVERY
        due = (
            trim_now
            or not self._pushed
            or time.monotonic() - self._trimmed_at >= self._trim_interval
        )
        payload, shards = None, list[ShardKeys]()
        if (
            writes
            or results
            or answered
            or released
            or dead
            or passed
            or records
            or others
            or timers
        ):
            payload, shards = _payload(
                writes, results, answered, released, dead, passed, records, others, timers
            )
        return Commit(
            progress,
            payload,
            replies,
            self._untrimmed if due else "",
            trim_now,
            builds=bool(writes or results or answered or released or records or others),
            messages=[message for record in records for message in record.messages],
            others=shards,
        )

    def _reply(self, finished: Finished, replies: dict[str, list[tuple[str, str]]]) -> None:
        """Add ``finished``'s outcome to the replies of its callers' channels."""
        if finished.replies:
            answer = reply_outcome(
                finished.outcome, self._shard, [entry.place for entry in finished.entries]
            )
            for channel in finished.replies:
                replies[channel].append((finished.op_id, answer))

    def trimmed(self) -> None:
        """The step trimmed the stream through :attr:`Commit.trim_to`."""
        self._untrimmed, self._untrimmed_entries = "", 0
        self._trimmed_at, self._pushed = time.monotonic(), False

    def _advance_progress(self) -> str:
        """Id of the last entry of the fetched prefix whose ops have all finished ('' if none)."""
        progress = ""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.remaining > 0:
                break
            progress = first.entry_id
            self._entries.popitem(last=False)
            self._untrimmed_entries += 1
        return progress

    def _passed_by_ops(self) -> list[str]:
        """Entries whose ops have all committed, but that progress cannot pass yet (an
        unfinished op in an earlier entry): removed from the stream, so that a stuck op keeps
        its own entry only, not the shard's backlog. (Looked for once it holds ``TRIM_EVERY``
        more entries than the fewest it held since the last look.)"""
        self._fewest = min(self._fewest, len(self._entries))
        if len(self._entries) < self._fewest + TRIM_EVERY:
            return []
        passed = [entry_id for entry_id, entry in self._entries.items() if entry.remaining == 0]
        for entry_id in passed:
            del self._entries[entry_id]
        self._fewest = len(self._entries)
        return passed


def _payload(
    writes: list[tuple[str, str]],
    results: list[tuple[str, str]],
    answered: list[tuple[str, str]],
    released: list[str],
    dead: Sequence[DeadLetter],
    passed: list[str],
    records: Sequence[Record],
    others: Sequence[OtherWrites],
    timers: Sequence[TimerChanges] = (),
) -> tuple[StepCommit, list[ShardKeys]]:
    """What the step script commits, and the other shards it writes."""
    shards: list[ShardKeys] = []
    by_shard: list[tuple[int, int, list[tuple[str, str]]]] = []
    if others:
        shards, by_shard = _by_shard(others)
    payload = StepCommit.of(
        writes,
        results,
        answered=answered,
        decisions=[(r.name, r.value) for r in records if r.name and not r.hold],
        holds=[(r.name, r.value) for r in records if r.hold],
        released=released,
        dead=dead,
        passed=passed,
        timers=[timer for changes in timers for timer in changes.set],
        cancelled=[
            (timer_id, cancelled_outcome(timer_id))
            for changes in timers
            for timer_id in changes.cancelled
        ],
        others=by_shard,
    )
    return payload, shards


def _by_shard(
    others: Sequence[OtherWrites],
) -> tuple[list[ShardKeys], list[tuple[int, int, list[tuple[str, str]]]]]:
    """The shards ``others`` write, in order, and their writes, one item per shard: (j, epoch,
    writes), j its place in that order, from 1."""
    merged: dict[tuple[ShardKeys, int], list[tuple[str, str]]] = {}
    for other in others:
        merged.setdefault((other.keys, other.epoch), []).extend(other.writes)
    shards = [keys for keys, _ in merged]
    items = [(j, epoch, writes) for j, ((_, epoch), writes) in enumerate(merged.items(), 1)]
    return shards, items


class ResultGenerations:
    """When to ask for a new results generation: by this owner's clock, once the current one
    is a retention period old (or there is none). The step script decides by the server's
    clock, and not while a result of the generation it would drop may still be needed by a
    replay: results live at least one period, and until progress passes their entry. (A clock
    off either way only makes it ask early or late.)"""

    def __init__(self, since_ms: int | None, retention_ms: int) -> None:
        self._since = since_ms
        self._retention = retention_ms

    def rotate(self, now_ms: int) -> bool:
        """Whether this step should ask for a new generation."""
        if not self.due(now_ms):
            return False
        self._since = now_ms
        return True

    def due(self, now_ms: int) -> bool:
        """Whether the next step would ask for one."""
        return self._since is None or now_ms >= self._since + self._retention
