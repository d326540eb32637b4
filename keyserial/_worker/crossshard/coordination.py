"""What the two sides of a cross-shard op share: the collaborators a shard's runner passes in,
how an op's keys and writes split by shard, and the signing of their messages. The protocol
itself is described in docs/multi-key.md.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from ..._backend.backend import Backend
from ..._scripts.calls import ScriptCall
from ..._settings import Settings
from ..._wire.codec import Envelope
from ..._wire.layout import Layout, shard_name
from ..._wire.messages import GrantRequest
from ..._wire.routing import route
from ..._wire.signing import ReplySigner
from ..commits import AcrossCommit, Record
from ..execution import Run
from ..writes import Replies, WriteChain
from .mailbox import HomeShard, Mailbox

R = TypeVar("R")

#: A shard's writes: [(key, JSON state or '' to delete)].
Writes = list[tuple[str, str]]


class RunFenced(Protocol):
    """The runner's way to run a script fenced by its epoch (``LeaseLost`` when refused)."""

    async def __call__(
        self,
        call: ScriptCall[R],
        *,
        replies: Replies | None = None,
        durably: bool = False,
        also: Sequence[WriteChain] = (),
        builds: bool = True,
    ) -> R: ...


class PipelinedCalls(Protocol):
    """What the cross-shard side uses of the worker's pipeliner (``_worker.pipeline.Pipeliner``):
    a script call sent in the next pipeline of its node, with the other runners' calls, and
    the signer of what that pipeline publishes. The two sides share this much of it, not how
    calls are batched and sent."""

    #: Signs the messages of the calls it runs (None: they go out unsigned).
    signer: ReplySigner | None

    async def run(self, call: ScriptCall[R]) -> R:
        """The script's reply (see ``Pipeliner.run``)."""

    async def run_durably(self, call: ScriptCall[R]) -> R:
        """The reply of an idempotent call, once it is confirmed as durable (see
        ``Pipeliner.run_durably``)."""


class Finish(Protocol):
    """The runner's way to take an op's outcome into its next commit; ``store``: the commit
    stores it (False: it is in Redis already, or must not be kept), bound to ``binding``."""

    def __call__(
        self, run: Run, outcome: str, *, store: bool, replies: list[str], binding: str = ""
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
    fenced: RunFenced
    finish: Finish
    #: Commits a grant or a decision with the runner's next step (``ShardRunner.commit_record``).
    commit_record: Callable[[Record], Awaitable[None]]
    #: Commits a cross-shard op's writes to this worker's other shards with the runner's next
    #: step (``ShardRunner.commit_across``).
    commit_across: Callable[[AcrossCommit], None]
    #: Runs a task in the runner's task group (its errors end the runner); nothing once the
    #: runner has stopped (then it returns False).
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool]

    @property
    def shard_count(self) -> int:
        shards: int = self.layout.shards
        return shards

    @property
    def poll(self) -> float:
        """How often a waiter looks in Redis for a message it may have missed (and a
        participant checks that its coordinator still owns the home shard)."""
        return min(self.settings.idle_poll, self.settings.lease_ttl / 8)


def split_keys(
    envelope: Envelope, here: HomeShard, shard_count: int
) -> tuple[list[str], dict[int, list[str]]]:
    """The op's keys on ``here``, and on each other shard."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for key, shard in zip(envelope.keys, route(envelope, shard_count), strict=True):
        by_shard[shard].append(key)
    local = by_shard.pop(here.shard)
    for keys in by_shard.values():
        for key in keys:
            here.states.forget(key)  # the fetch looked it up here: it is not ours
    return local, by_shard


def writes_by_shard(
    envelope: Envelope,
    states: Mapping[str, str | None],
    new_states: Mapping[str, str | None] | None,
    shard_count: int,
) -> dict[int, Writes]:
    """The keys an op changed, by shard ('' for a deleted state)."""
    writes: dict[int, Writes] = defaultdict(list)
    if new_states is None:
        return writes
    for key, shard in zip(envelope.keys, route(envelope, shard_count), strict=True):
        state = new_states[key]
        if state != states[key]:
            writes[shard].append((key, state or ""))
    return writes


def signed_request(
    services: RunnerServices, shard: int, op_id: str, attempt: int, keys: Sequence[str]
) -> GrantRequest:
    """The grant request of one attempt for ``keys`` on ``shard``, signed by this worker: a
    participant takes no request that a listed worker did not sign (``_worker.intake``). It is
    also tagged for the shard's owner that granted this worker's last request there, if one
    did: that owner checks the tag instead of the signature (any other, the signature)."""
    home = services.home
    target = shard_name(shard, services.layout.generation)
    request = GrantRequest(
        home.shard,
        op_id,
        attempt,
        services.mailbox.channel_for(shard),  # (in its slot: that shard's script publishes)
        target,
        int(time.time() * 1000),
    )
    signer = services.pipeliner.signer
    if signer is None:
        return request
    text = request.signed_text(services.settings.namespace, keys)
    owner = services.mailbox.expected_owner(target)
    return replace(
        request,
        signer=signer.signer_id,
        signature=signer.sign_request(text),
        tag="" if owner is None else signer.tag_request(owner, text),
    )
