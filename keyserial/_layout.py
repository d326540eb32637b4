"""Redis key and channel names.

Every key of one shard carries the hash tag ``{<namespace>:<shard>}``, so each Lua script touches
exactly one cluster slot (``commit_across``, which spans shards, only runs on a standalone
server). Channels are not keys (PUBLISH works from any script, on any topology).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


def check_namespace(namespace: str) -> str:
    """Reject names that would break the hash tag or the key layout."""
    if not namespace or any(ch in namespace for ch in "{}: \t\r\n"):
        raise ConfigError(
            f"namespace {namespace!r} must be non-empty and free of braces, colons and spaces"
        )
    return namespace


def meta_key(namespace: str) -> str:
    """The namespace's hash of fixed settings (field ``shards``), written on first use."""
    return f"ks:{{{namespace}}}:meta"


def same_slot_key(key: str, name: str) -> str:
    """A key named ``name`` in the hash tag (so the cluster slot) of ``key``."""
    start = key.find("{")
    end = key.find("}", start + 1)
    if start < 0 or end < 0:
        raise ValueError(f"{key!r} has no hash tag")
    return f"{key[: end + 1]}:{name}"


def reply_channel(namespace: str, client_id: str) -> str:
    return f"ks:{namespace}:reply:{client_id}"


def worker_channel(namespace: str, token: str) -> str:
    """A worker's coordination channel: grants and decisions of cross-shard ops."""
    return f"ks:{namespace}:worker:{token}"


@dataclass(frozen=True, slots=True)
class ShardKeys:
    """Names of everything one shard keeps in Redis."""

    namespace: str
    shard: int

    @property
    def tag(self) -> str:
        return f"ks:{{{self.namespace}:{self.shard}}}"

    @property
    def stream(self) -> str:
        """Ops waiting to run, in order; each entry packs one or more op envelopes."""
        return f"{self.tag}:stream"

    @property
    def lease(self) -> str:
        """Owner token, with a TTL; renewed by the owner."""
        return f"{self.tag}:lease"

    @property
    def epoch(self) -> str:
        """Fencing epoch, incremented at every acquisition; every write checks it."""
        return f"{self.tag}:epoch"

    @property
    def progress(self) -> str:
        """Id of the last stream entry whose ops have all committed."""
        return f"{self.tag}:progress"

    @property
    def horizon(self) -> str:
        """Id of the last entry the owner has fetched; above progress after a crash."""
        return f"{self.tag}:horizon"

    @property
    def handover(self) -> str:
        """The horizon a clean release left: the next owner replays up to it without
        suspecting any op."""
        return f"{self.tag}:handover"

    @property
    def last_grant(self) -> str:
        """The last lease grant (JSON ``[attempt id, grant]``), so a lost acquire reply can be
        asked again without a second epoch or strike."""
        return f"{self.tag}:grant"

    @property
    def suspect(self) -> str:
        """Hash {op, strikes}: the op that was running each time an owner died."""
        return f"{self.tag}:suspect"

    @property
    def state(self) -> str:
        """Hash: resource key -> JSON state."""
        return f"{self.tag}:state"

    @property
    def results(self) -> str:
        """Hash: op id -> JSON outcome, for results stored since :attr:`results_since`."""
        return f"{self.tag}:results"

    @property
    def results_old(self) -> str:
        """The previous generation of :attr:`results`, dropped when the current one is a
        retention period old: so a result lives between one and two retention periods."""
        return f"{self.tag}:results:old"

    @property
    def results_since(self) -> str:
        """When (ms, the owner's clock) the current results generation began."""
        return f"{self.tag}:results:since"

    @property
    def dead(self) -> str:
        """Dead-letter stream: malformed entries and poison ops, with the reason."""
        return f"{self.tag}:dead"

    @property
    def barrier(self) -> str:
        """A key written only to be replicated: a WAIT after it covers every write before it
        (the ``durable_replicas`` setting)."""
        return f"{self.tag}:barrier"

    @property
    def wake_channel(self) -> str:
        """Published on every append so an idle owner fetches at once instead of polling."""
        return f"ks:{self.namespace}:wake:{self.shard}"
