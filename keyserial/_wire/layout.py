"""Redis key and channel names.

Every key of one shard carries the hash tag ``{<namespace>:<shard>}``, so each Lua script touches
exactly one cluster slot (a step that also writes other shards for a cross-shard op only runs
so on a standalone server). Channels are not keys (PUBLISH works from any script, on any topology).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import overload

from ..errors import ConfigError
from .json_text import encodes


def check_namespace(namespace: str) -> str:
    """Reject names that would break the hash tag or the key layout."""
    if (
        not isinstance(namespace, str)
        or not namespace
        or any(ch in namespace for ch in "{}: \t\r\n")
        or not encodes(namespace)
    ):
        raise ConfigError(
            f"namespace {namespace!r} must be a non-empty string free of braces, colons, spaces"
            " and unpaired surrogates"
        )
    return namespace


_SERVICE = re.compile(r"[A-Za-z0-9_-]{0,64}")


def check_service(service: str) -> str:
    """Reject service names that an ACL channel pattern could not tell apart: ``billing.*``
    must match billing's reply channels and no other service's."""
    if not isinstance(service, str) or not _SERVICE.fullmatch(service):
        raise ConfigError(f"service {service!r} must be at most 64 letters, digits, '_' or '-'")
    return service


def meta_key(namespace: str) -> str:
    """The namespace's hash of fixed settings (field ``shards``), written on first use."""
    return f"ks:{{{namespace}}}:meta"


def shard_name(shard: int, generation: int = 0) -> str:
    """How a shard is named in its keys and channels: ``7`` in generation 0 (the layout every
    namespace starts with), ``7@2`` in generation 2 (after two reshards)."""
    return str(shard) if generation == 0 else f"{shard}@{generation}"


def shard_tag(namespace: str, shard: int, generation: int = 0) -> str:
    """The hash tag of every key of one shard: ``ks:{<ns>:<shard name>}``."""
    return f"ks:{{{namespace}:{shard_name(shard, generation)}}}"


def in_shard(channel: str, namespace: str, shard: int, generation: int = 0) -> str:
    """``channel`` (``ks:<ns>:...``) as a shard channel of ``shard`` (``ks:{<ns>:<shard>}:...``):
    in the shard's cluster slot, so a script of the shard publishes on it with SPUBLISH and the
    message stays on the node that serves the shard (sharded pub/sub, Redis 7+, on a cluster)."""
    prefix = f"ks:{namespace}:"
    if not channel.startswith(prefix):
        raise ValueError(f"{channel!r} is not a channel of namespace {namespace!r}")
    return f"{shard_tag(namespace, shard, generation)}:{channel[len(prefix) :]}"


def is_shard_channel(channel: str) -> bool:
    """Whether ``channel`` is a shard channel (:func:`in_shard`): published with SPUBLISH and
    subscribed with SSUBSCRIBE. A namespace has no braces, so no other channel starts so."""
    return channel.startswith("ks:{")


def same_slot_key(key: str, name: str) -> str:
    """A key named ``name`` in the hash tag (so the cluster slot) of ``key``."""
    start = key.find("{")
    end = key.find("}", start + 1)
    if start < 0 or end < 0:
        raise ValueError(f"{key!r} has no hash tag")
    return f"{key[: end + 1]}:{name}"


def reply_channel(namespace: str, client_id: str) -> str:
    """A client's reply channel (a client of a service has the id ``<service>.<random>``)."""
    return f"ks:{namespace}:reply:{client_id}"


def signers_key(namespace: str) -> str:
    """The hash of the workers' reply signers: signer id -> public key (only workers write)."""
    return f"ks:{namespace}:signers"


def pauses_key(namespace: str) -> str:
    """A counter every pause and resume of a key in the namespace increments: a worker that sees
    it change reads its shards' paused keys again (``ShardKeys.paused``)."""
    return f"ks:{namespace}:pauses"


#: The wake-up an operator publishes on a shard's channel once it paused or resumed a key there.
PAUSES_CHANGED = "pauses"


def roster_key(namespace: str) -> str:
    """The hash in which running workers list themselves (see ``_wire.roster``)."""
    return f"ks:{namespace}:workers"


def activity_key(namespace: str) -> str:
    """The hash of what each worker ran lately (field: its token; see ``_worker.activity``),
    read by ``keyserial dashboard``; only workers write it."""
    return f"ks:{namespace}:activity"


def worker_channel(namespace: str, token: str) -> str:
    """The prefix of a worker's coordination channel (grants and decisions of cross-shard ops);
    the channel is ``<prefix>.<the worker's public key>`` (see ``_worker.crossshard.mailbox``)."""
    return f"ks:{namespace}:worker:{token}"


def owner_channel(namespace: str, lease_value: str) -> str:
    """The coordination channel of the worker that holds a shard's lease, from the lease's
    value (``ShardKeys.lease``): a worker's leases hold its channel less the prefix
    ``ks:<ns>:worker:`` (``<token>.<public key>``), so that another worker (a cross-shard op's
    coordinator) finds where to send a shard's owner a message in one GET of the shard's lease,
    with no table of workers to keep in step with who owns what. The lease may change hands
    after it was read: a message then reaches a worker that no longer owns the shard, and is as
    good as lost, which costs a read, never a write (see ``_worker.crossshard.mailbox``)."""
    return worker_channel(namespace, lease_value)


class _ShardKey:
    """A key of one shard, named by its suffix after the shard's hash tag.

    The name is made at the first read and kept in the instance: the descriptor has no
    ``__set__``, so from then on the instance's own attribute answers, with no call (a step
    names twelve keys, a worker makes thousands of steps a second). It cannot go stale: a
    :class:`ShardKeys` is frozen, and its names depend on nothing else."""

    __slots__ = ("attribute", "suffix")

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.attribute = ""

    def __set_name__(self, owner: type[ShardKeys], attribute: str) -> None:
        self.attribute = attribute

    @overload
    def __get__(self, shard: None, owner: type[ShardKeys]) -> _ShardKey: ...
    @overload
    def __get__(self, shard: ShardKeys, owner: type[ShardKeys]) -> str: ...
    def __get__(self, shard: ShardKeys | None, owner: type[ShardKeys]) -> str | _ShardKey:
        if shard is None:
            return self
        name = shard.__dict__[self.attribute] = f"{shard.tag}:{self.suffix}"
        return name


def part_id(op_id: str, home: int, attempt: int) -> str:
    """The name of a participant shard's part in one attempt of a cross-shard op: its hold's
    field in the held hash, and the results field of what became of it (``#`` is reserved in
    op ids for keyserial's records). It names the home shard: two ops homed on different
    shards may share an op id (each home keeps its own results) and an attempt (each home's
    epochs count on their own), and their parts on a shared participant must not."""
    return f"{op_id}#{home}.{attempt}"


def decision_field(op_id: str, attempt: int) -> str:
    """The home shard's results field that records an attempt's decision."""
    return f"{op_id}#{attempt}#d"


def answered_field(op_id: str) -> str:
    """The results field that records an op answered but not stored (see ``acquire.lua``)."""
    return f"{op_id}#u"


@dataclass(frozen=True, order=True)  # (no slots: each name is kept once read, see _ShardKey)
class ShardKeys:
    """Names of everything one shard keeps in Redis (ordered by shard, then generation)."""

    namespace: str
    shard: int
    #: The layout generation the shard belongs to (see :class:`Layout`).
    generation: int = 0
    #: The hash tag every key of the shard carries (made once, as each name is: see _ShardKey).
    tag: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", shard_tag(self.namespace, self.shard, self.generation))

    #: Ops waiting to run, in order; each entry packs one or more op envelopes. Only the shard's
    #: owner writes it, moving in what clients push to :attr:`inbox`.
    stream = _ShardKey("stream")
    #: List: entries clients push (``submit.lua``), each ``<version>[ fresh][ at <ms>]\n<ops>``,
    #: until the owner's next step moves them into :attr:`stream` (a delayed one, ``at`` its
    #: due time, into :attr:`timers`).
    inbox = _ShardKey("inbox")
    #: How many items the owner has moved out of :attr:`inbox` so far: an item's place (its
    #: number in the order of pushes, from 1) is this count plus its index in the inbox.
    inbox_taken = _ShardKey("inbox:taken")
    #: The owner's lease value, with a TTL; renewed by the owner. It is ``<token>.<public key>``:
    #: the owner's coordination channel less ``ks:<ns>:worker:`` (see :func:`owner_channel`).
    lease = _ShardKey("lease")
    #: Fencing epoch, incremented at every acquisition; every write checks it.
    epoch = _ShardKey("epoch")
    #: Id of the last stream entry whose ops have all committed.
    progress = _ShardKey("progress")
    #: Id of the last entry the owner has fetched; above progress after a crash.
    horizon = _ShardKey("horizon")
    #: The horizon a clean release left: the next owner replays up to it without suspecting any op.
    handover = _ShardKey("handover")
    #: The last lease grant (JSON ``[attempt id, grant]``), so a lost acquire reply can be asked
    #: again without a second epoch or strike.
    last_grant = _ShardKey("grant")
    #: Hash {op, strikes}: the op that was running each time an owner died.
    suspect = _ShardKey("suspect")
    #: The epoch of the owner that takes entries pushed with their wake-ups (see ``submit.lua``),
    #: recorded by its first step that may take one: a takeover then counts every entry in the
    #: stream as fetched, since any may have been pushed to it and run.
    pushes = _ShardKey("pushes")
    #: Hash: resource key -> JSON state.
    state = _ShardKey("state")
    #: Hash: op id -> JSON outcome, for results stored since :attr:`results_since`.
    results = _ShardKey("results")
    #: The previous generation of :attr:`results`, dropped when the current one is a retention
    #: period old: so a result lives between one and two retention periods.
    results_old = _ShardKey("results:old")
    #: When (ms, the owner's clock) the current results generation began.
    results_since = _ShardKey("results:since")
    #: Dead-letter stream: malformed entries and poison ops, with the reason.
    dead = _ShardKey("dead")
    #: A key written only to be replicated: a WAIT after it covers every write before it (the
    #: ``durable_replicas`` setting).
    barrier = _ShardKey("barrier")
    #: Hash: resource key -> JSON ``{"at": ms}``, the keys an operator paused (``keyserial
    #: keys pause``): their ops queue and none runs until resumed, whoever owns the shard.
    paused = _ShardKey("paused")
    #: Sorted set: the shard's timers, each an op due later (member: its id, its inbox place 16
    #: digits wide; score: its due time in ms by the server's clock). Only the owner's steps
    #: write it, firing each due one into :attr:`stream` (see ``lib.lua``).
    timers = _ShardKey("timers")
    #: Hash: timer id -> the inbox item (``<version>[ fresh]\n<ops>``) it fires as.
    timed = _ShardKey("timed")
    #: Hash: ``<op id>#<attempt>`` -> JSON grant, the keys this shard holds for other shards'
    #: cross-shard ops, from the step that records a hold to the one that applies or releases
    #: it (see docs/multi-key.md).
    held = _ShardKey("held")

    @property
    def wake_channel(self) -> str:
        """Published on every append so an idle owner fetches at once instead of polling."""
        return f"ks:{self.namespace}:wake:{shard_name(self.shard, self.generation)}"

    def wake(self, sharded: bool) -> str:
        """The wake channel this process publishes on: on a cluster with sharded pub/sub, the
        shard channel ``ks:{<ns>:<shard>}:wake:<shard>`` (workers subscribe to both)."""
        return (
            in_shard(self.wake_channel, self.namespace, self.shard, self.generation)
            if sharded
            else self.wake_channel
        )

    def in_shard(self, channel: str) -> str:
        """``channel`` as a shard channel of this shard (see :func:`in_shard`)."""
        return in_shard(channel, self.namespace, self.shard, self.generation)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a namespace's keys map to shards: ``shards`` shards of layout ``generation``.

    A namespace starts at generation 0 and its ``shards`` recorded on first use; each reshard
    makes the next generation, whose shards have keys of their own (``ks:{<ns>:<shard>@<g>}``),
    so the streams, states and results of two generations never mix."""

    namespace: str
    shards: int
    generation: int = 0
    #: Each shard's :class:`ShardKeys`, made once (a worker names a shard at every grant
    #: request and step, and a ShardKeys makes each name once).
    _keys: dict[int, ShardKeys] = field(default_factory=dict, init=False, repr=False, compare=False)

    def keys(self, shard: int) -> ShardKeys:
        """The names of ``shard``'s keys in this layout."""
        keys = self._keys.get(shard)
        if keys is None:
            keys = self._keys[shard] = ShardKeys(self.namespace, shard, self.generation)
        return keys

    def all_keys(self) -> list[ShardKeys]:
        """The names of every shard's keys, by shard number."""
        return [self.keys(shard) for shard in range(self.shards)]
