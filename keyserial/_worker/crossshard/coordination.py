"""What the two sides of a cross-shard op share: what a shard's runner hands them
(:class:`RunnerServices`), and the shapes of the runner's calls in it. How an op splits by shard
is the coordinator's alone (``.coordinator``). The protocol itself is described in
docs/multi-key.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..._backend.backend import Backend
from ..._scripts.calls import ScriptCall
from ..._settings import Settings
from ..._wire.layout import Layout
from ..commits import AcrossCommit, Record
from ..execution import Run
from .mailbox import HomeShard, Mailbox

R = TypeVar("R")


class PipelinedCalls(Protocol):
    """What the cross-shard side uses of the worker's pipeliner (``_worker.pipeline.Pipeliner``):
    a message signed for its receiver and batched with the others it owes that worker, and a
    script call sent in the next pipeline of its node, with the other runners' calls. The two
    sides share this much of it, not how calls are batched and sent."""

    def publish(self, channel: str, message: str) -> None:
        """Publish a coordination message that waits for no commit (see
        ``Pipeliner.publish``)."""

    async def run_durably(self, call: ScriptCall[R]) -> R:
        """The reply of an idempotent call, once it is confirmed as durable (see
        ``Pipeliner.run_durably``)."""


class Finish(Protocol):
    """The runner's way to take an op's outcome into its next commit; ``store``: the commit
    stores it (False: it is in Redis already, or must not be kept), bound to ``binding``;
    ``releases``: the hold (its held field) the commit deletes."""

    def __call__(
        self,
        run: Run,
        outcome: str,
        *,
        store: bool,
        replies: list[str],
        binding: str = "",
        releases: str = "",
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class RunnerServices:
    """What a shard's runner gives the cross-shard side of that shard."""

    home: HomeShard
    pipeliner: PipelinedCalls
    backend: Backend
    mailbox: Mailbox
    settings: Settings
    layout: Layout
    finish: Finish
    #: Commits a grant or a decision with the runner's next step (``ShardRunner.commit_record``).
    commit_record: Callable[[Record], Awaitable[None]]
    #: Commits a record with the runner's next step, with no wait: the step calls the record's
    #: ``on_committed`` (``ShardRunner.record_with_step``).
    record_with_step: Callable[[Record], None]
    #: Calls a function from the runner's step loop, in its task (``ShardRunner.in_step_loop``).
    in_step_loop: Callable[[Callable[[], None]], None]
    #: Commits a cross-shard op's writes to this worker's other shards with the runner's next
    #: step (``ShardRunner.commit_across``).
    commit_across: Callable[[AcrossCommit], None]
    #: Ends a lent grant's request, which has nothing to commit (``ShardRunner.end_request``).
    end_request: Callable[[Run], None]
    #: Runs a task in the runner's task group (its errors end the runner); nothing once the
    #: runner has stopped (then it returns False).
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool]

    def fail(self, error: Exception) -> None:
        """End the runner with ``error``, as a task of it raising it would (from a callback,
        which has no task to raise it in)."""

        async def fail() -> None:
            raise error

        self.spawn(fail)

    @property
    def shard_count(self) -> int:
        shards: int = self.layout.shards
        return shards

    @property
    def poll(self) -> float:
        """How often a waiter looks in Redis for a message it may have missed (and a
        participant checks that its coordinator still owns the home shard)."""
        return min(self.settings.idle_poll, self.settings.lease_ttl / 8)
