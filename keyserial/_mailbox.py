"""A worker's channel for coordination messages: grants to the ops it coordinates, decisions to
the grants it holds. A message nobody waits for is dropped; every waiter also polls Redis, so a
lost message costs latency, never correctness.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio

from ._messages import DecisionNotice, KeyGrant, MalformedMessage, from_wire

if TYPE_CHECKING:
    from ._chains import Hold
    from ._execution import Executor
    from ._keystates import KeyStates
    from ._layout import ShardKeys
    from ._pipeline import Lineage

log = logging.getLogger("keyserial.worker")

#: What a waiter waits for: ("g", op id, attempt, shard) or ("d", op id, attempt).
Topic = tuple[str, str, int] | tuple[str, str, int, int]


class LocalShard(Protocol):
    """A shard this worker owns, as a cross-shard op of another of its shards uses it."""

    shard: int
    epoch: int
    keys: ShardKeys
    states: KeyStates
    executor: Executor
    #: The owner's writes, for a commit that writes this shard's keys (see ``Lineage``).
    lineage: Lineage

    def entries_waiting(self) -> None:
        """New entries were appended to the shard (its next step fetches them)."""

    def hold(
        self, keys: tuple[str, ...]
    ) -> AbstractAsyncContextManager[dict[str, str | None] | None]:
        """Hold ``keys``; yields their committed states, or None if the shard stopped first."""

    def try_hold(self, keys: tuple[str, ...]) -> Hold | None:
        """Hold ``keys`` at once if they are idle (committed, cached, nothing queued), or None."""

    def release(self, hold: Hold) -> None:
        """End a hold :meth:`try_hold` took."""


@dataclass(slots=True)
class Letter:
    """Waits for one message: a grant from one shard, or an attempt's decision."""

    event: anyio.Event
    message: KeyGrant | DecisionNotice | None = None

    async def within(self, seconds: float) -> KeyGrant | DecisionNotice | None:
        """The message, if it has come or comes within ``seconds``; None: time to look for
        its record in Redis instead."""
        with anyio.move_on_after(seconds):
            await self.event.wait()
        return self.message


class Mailbox:
    """Hands each coordination message to whoever waits for it."""

    def __init__(self, channel: str, local_shard: Callable[[int], LocalShard | None]) -> None:
        self.channel = channel
        #: This worker's runner of a shard, or None if the worker does not own the shard.
        self.local_shard = local_shard
        self._waiting: dict[Topic, list[Letter]] = defaultdict(list)

    @contextmanager
    def expect_grant(self, op_id: str, attempt: int, shard: int) -> Iterator[Letter]:
        """Register interest before asking, so the grant cannot arrive unseen."""
        with self._expect(("g", op_id, attempt, shard)) as letter:
            yield letter

    @contextmanager
    def expect_decision(self, op_id: str, attempt: int) -> Iterator[Letter]:
        with self._expect(("d", op_id, attempt)) as letter:
            yield letter

    @contextmanager
    def _expect(self, topic: Topic) -> Iterator[Letter]:
        letter = Letter(anyio.Event())
        self._waiting[topic].append(letter)
        try:
            yield letter
        finally:
            letters = self._waiting[topic]
            letters.remove(letter)
            if not letters:
                del self._waiting[topic]

    def receive(self, data: bytes) -> None:
        """A message from the worker channel."""
        try:
            message = from_wire(json.loads(data))
        except (ValueError, MalformedMessage):
            log.error("ignoring a malformed coordination message: %r", data[:200])
            return
        self.deliver(message)

    def deliver(self, message: KeyGrant | DecisionNotice) -> None:
        """Hand a message over (one from this worker itself skips the trip through Redis)."""
        topic: Topic
        if isinstance(message, KeyGrant):
            topic = ("g", message.op_id, message.attempt, message.shard)
        else:
            topic = ("d", message.op_id, message.attempt)
        for letter in self._waiting.get(topic, ()):
            letter.message = message
            letter.event.set()
