"""A shard owner's writes as they go into the pipeline: the replies each one publishes once it
has committed, and the write chain it builds on.

The runner, its commits and the cross-shard side build writes; the pipeliner
(``_worker.pipeline``) sends them and breaks the write chains it cannot confirm. These are the
names both sides share, kept apart from the pipeliner so that naming a write does not mean
depending on how writes are batched and sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Outcomes to reply once a call has committed them: channel -> [(op id, outcome JSON)].
Replies = Mapping[str, Sequence[tuple[str, str]]]


@dataclass(slots=True, eq=False)
class WriteChain:
    """The writes of one shard owner, each built on those before it (the owner caches what they
    wrote). Broken once its cache may not be what Redis has: a pipeline that carried a write
    that commits states or results is not confirmed as durable (a failover may have lost that
    write while the cache keeps it), a pushed entry is not in the stream as pushed, or a commit
    across shards went out and its coordinator stopped before learning whether it landed. No
    later call of the write chain goes out (each fails with :class:`WriteChainBroken`)."""

    broken: bool = False


class WriteChainBroken(Exception):
    """A write not sent: its owner's :class:`WriteChain` is broken (the owner must give its shard
    up, cleanly: the unfinished ops are not to blame)."""
