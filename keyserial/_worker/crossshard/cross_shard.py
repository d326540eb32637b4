"""Multi-key ops across shards, as one shard's runner sees them.

An op whose keys sit on several shards is appended to its *home* shard, the lowest of them,
whose owner coordinates it (:mod:`.coordinator`); each other shard holds and grants its keys
through a grant request, an internal op (:mod:`.participant`). Messages between workers go
through the :mod:`.mailbox`; their shapes are in :mod:`keyserial._wire.messages`. Why this is
atomic and can never deadlock is written up in docs/multi-key.md.
"""

from __future__ import annotations

from collections import defaultdict

from ..._wire.codec import GRANT_OP, Envelope
from ..._wire.messages import GrantRequest
from ..._wire.routing import route
from ..chains import Split
from ..execution import Run
from .coordination import RunnerServices
from .coordinator import Coordinator
from .participant import Participant


class CrossShard:
    """The runner's :class:`~keyserial._worker.chains.Coordination`: what runs once an op's
    local keys are held, for a grant request or an op with keys on other shards."""

    def __init__(self, services: RunnerServices) -> None:
        self._services = services
        self._coordinator = Coordinator(services)
        self._participant = Participant(services)

    def split(self, envelope: Envelope) -> Split | None:
        """For a grant request or an op with keys on other shards, its keys by shard (those on
        this shard are the ones its barrier holds here); None for any other op. The states the
        fetch read here of the op's keys elsewhere are forgotten: this shard's owner keeps
        only its own."""
        if envelope.name == GRANT_OP:
            return Split(envelope.keys, {})
        if not envelope.multi:
            return None
        home = self._services.home
        here = home.shard
        shards = route(envelope, self._services.shard_count)
        if shards.count(here) == len(shards):
            return None
        local: list[str] = []
        elsewhere: defaultdict[int, list[str]] = defaultdict(list)
        for key, shard in zip(envelope.keys, shards, strict=True):
            if shard == here:
                local.append(key)
            else:
                elsewhere[shard].append(key)
                home.states.forget(key)
        return Split(tuple(local), elsewhere)

    def start_now(self, run: Run, split: Split) -> bool:
        """Take the op (or the grant request) with no task, if it can: see
        :meth:`Coordinator.start_now` and :meth:`Participant.start_now`."""
        if run.envelope.name == GRANT_OP:
            return self._participant.start_now(run)
        return self._coordinator.start_now(run, split)

    def request_again(self, run: Run, request: GrantRequest) -> None:
        """A grant request came for an attempt's part whose run holds (or waits for) the
        keys."""
        self._participant.grant_again(run, request)

    async def run(self, run: Run, split: Split) -> None:
        """Run a grant request or coordinate an op, once its barrier holds the local keys."""
        if run.envelope.name == GRANT_OP:
            await self._participant.grant(run)
        else:
            await self._coordinator.coordinate(run, split)
