"""Which op runs when: one key's ops one after another, different keys' ops side by side.

Ops declared ``inline`` on a free key run at once (no task); an ``async`` op, or a sync op (run
in a worker thread), gets a chain task for its key, and later ops on that key queue behind it; a
key's consecutive sync ops share one trip to a thread. A multi-key op is a :class:`Barrier`
placed in every one of its keys' chains: the last chain to reach it runs it, the others wait, so
it sees and writes all its keys alone. Chains fill in stream order, so two barriers can never
wait for each other. A :class:`Hold` is a barrier that another shard's coordinator runs (a
cross-shard op).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from .._wire.codec import Envelope
from .execution import Executor, Run
from .taskpool import TaskPool


@dataclass(frozen=True, slots=True)
class Split:
    """The keys of an op that involves other shards (or of a grant request), by shard: routed
    once, where the runner takes the op in, for every step of its way."""

    #: Its keys on this shard: the ones its barrier holds here.
    here: tuple[str, ...]
    #: Its keys on each other shard, in the op's order (none for a grant request).
    elsewhere: dict[int, list[str]]


@dataclass(slots=True)
class Barrier:
    """A multi-key op's place in each of its (local) keys' chains: it runs once it heads all of
    them, and those chains move on only after it has run."""

    run: Run
    needed: int
    #: Its keys by shard, if the cross-shard coordination runs it (a grant request, or an op
    #: with keys elsewhere).
    split: Split | None = None
    arrived: int = 0
    #: Set once it has run; created by the first chain that has to wait for that.
    done: anyio.Event | None = None


@dataclass(slots=True, eq=False)
class Hold:
    """Keys held for a cross-shard op that another shard of this worker coordinates: like a
    barrier, but what runs at the head of the chains is that coordinator, elsewhere."""

    keys: tuple[str, ...]
    arrived: int = 0
    #: Queued behind other ops: set once the hold heads every chain, or once the runner stops
    #: (``abandoned``). None: held (or abandoned) from the start.
    held: anyio.Event | None = None
    abandoned: bool = False
    #: Queued: what its chains wait on. None: its keys were free, so it heads chains that no
    #: task runs until it is released.
    released: anyio.Event | None = None


class Coordination(Protocol):
    """Runs the ops that involve other shards (see ``_worker.crossshard.cross_shard``) once their
    local keys are held."""

    def split(self, envelope: Envelope) -> Split | None:
        """The op's keys by shard if the coordination runs it, else None."""
        ...

    async def run(self, run: Run, split: Split) -> None: ...

    def start_now(self, run: Run, split: Split) -> bool:
        """Take the op without a task if it can (see ``Coordinator.start_now``)."""
        ...


class Chains:
    """The queues of a shard's keys, between the runner's :meth:`open` and :meth:`close`."""

    def __init__(self, executor: Executor, coordination: Coordination) -> None:
        #: Where the chains' tasks run while the runner runs; None before and after.
        self._tasks: TaskPool | None = None
        self._executor = executor
        self._coordination = coordination
        self._chains: dict[str, deque[Run | Barrier | Hold]] = {}
        self._holds: set[Hold] = set()

    def schedule(self, run: Run) -> None:
        """Run now if every key is free and nothing needs awaiting; otherwise queue the op on
        each of its keys' chains (a multi-key op as a barrier)."""
        envelope = run.envelope
        # Only an op that involves other shards holds fewer keys here than it names.
        split = self._coordination.split(envelope)
        keys = envelope.keys if split is None else split.here
        chains = self._chains
        if split is None and (
            keys[0] not in chains if len(keys) == 1 else chains.keys().isdisjoint(keys)
        ):
            definition = self._executor.definition(envelope)
            if definition is None or not definition.awaited:
                # Nothing to wait for (or an op that cannot run): no task needed.
                self._executor.execute_now(run, definition)
                return
        if split is not None and self._coordination.start_now(run, split):
            return
        item: Run | Barrier = (
            run if len(keys) == 1 and split is None else Barrier(run, len(keys), split)
        )
        for key in keys:
            self._enqueue(key, item)

    def try_hold(self, keys: tuple[str, ...]) -> Hold | None:
        """Hold ``keys`` now if nothing is queued on them (no task needed), else None."""
        if self._tasks is None or not self._chains.keys().isdisjoint(keys):
            return None
        item = Hold(keys)
        for key in keys:
            self._chains[key] = deque([item])
        return item

    def hold(self, keys: tuple[str, ...]) -> Hold:
        """Queue a hold on ``keys``: its ``held`` is set once every op queued on them before it
        has run; ops queued after it wait until :meth:`release`."""
        item = Hold(keys)
        if self._tasks is None:  # the runner has stopped
            item.abandoned = True
            return item
        if self._chains.keys().isdisjoint(keys):
            # Free keys: held at once, and no chain task until something queues behind it.
            for key in keys:
                self._chains[key] = deque([item])
            return item
        item.held, item.released = anyio.Event(), anyio.Event()
        self._holds.add(item)
        for key in keys:
            self._enqueue(key, item)
        return item

    def release(self, item: Hold) -> None:
        """Let the ops queued behind a hold run."""
        if item.released is not None:
            item.released.set()
            return
        if item.abandoned or self._tasks is None:
            return
        for key in item.keys:
            chain = self._chains[key]
            chain.popleft()
            if chain:
                self._start_chain(key)
            else:
                del self._chains[key]

    def holds_key(self, key: str) -> bool:
        """Whether something is queued on ``key``: an op (running or waiting), a barrier or a
        hold."""
        return key in self._chains

    def open(self, task_group: TaskGroup) -> None:
        """The runner runs: chains start their tasks in ``task_group``."""
        self._tasks = TaskPool(task_group)

    def close(self) -> None:
        """The runner stopped: no chain starts again, and the holds still waiting are
        abandoned (the chains will never reach them)."""
        self._tasks = None
        for item in self._holds:
            item.abandoned = True
            assert item.held is not None, "only queued holds wait"
            item.held.set()
        self._holds.clear()

    def _enqueue(self, key: str, item: Run | Barrier | Hold) -> None:
        chain = self._chains.get(key)
        if chain is None:
            self._chains[key] = deque([item])
            self._start_chain(key)
        else:
            chain.append(item)

    async def _run_chain(self, key: str) -> None:
        """Run a key's queued ops one after another; other keys' chains run meanwhile."""
        chain = self._chains[key]
        while chain:
            item = chain.popleft()
            if isinstance(item, Run):
                if self._executor.in_thread(item.envelope):
                    await self._executor.execute_in_thread(self._trip(item, chain))
                else:
                    await self._executor.execute(item)
                continue
            item.arrived += 1
            if isinstance(item, Hold):
                assert item.held is not None and item.released is not None, "queued"
                if item.arrived == len(item.keys):
                    self._holds.discard(item)
                    item.held.set()
                await item.released.wait()
                continue
            if item.arrived == item.needed:  # the last of its keys to get here runs it
                if item.split is not None:
                    await self._coordination.run(item.run, item.split)
                else:
                    await self._executor.execute(item.run)
                if item.done is not None:
                    item.done.set()
            else:
                if item.done is None:
                    item.done = anyio.Event()
                await item.done.wait()
        del self._chains[key]

    def _trip(self, first: Run, chain: deque[Run | Barrier | Hold]) -> list[Run]:
        """``first`` and the sync ops queued right behind it on its key, taken off the chain:
        they run one after another in one trip to a worker thread."""
        runs = [first]
        while chain:
            head = chain[0]
            if not isinstance(head, Run) or not self._executor.in_thread(head.envelope):
                break
            runs.append(head)
            chain.popleft()
        return runs

    def _start_chain(self, key: str) -> None:
        assert self._tasks is not None, "the runner opens the chains before scheduling"
        self._tasks.start_soon(self._run_chain, key)
