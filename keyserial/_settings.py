"""Settings shared by clients and workers."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._wire.layout import check_namespace, check_service
from .errors import ConfigError

_ENV_PREFIX = "KEYSERIAL_"
#: A worker process's metrics port (cli.py): not a setting, clients have no use for it.
METRICS_PORT_VARIABLE = "KEYSERIAL_METRICS_PORT"
#: A worker process's event loop (cli.py): not a setting, a client runs on its caller's loop.
EVENT_LOOP_VARIABLE = "KEYSERIAL_EVENT_LOOP"
#: The port ``keyserial dev`` serves on unless told otherwise.
DEV_PORT = 6390
#: Where a client or command given no URL, and no ``KEYSERIAL_REDIS_URL``, connects: the server
#: ``keyserial dev`` starts, never a Redis on the standard port that may be someone else's
#: (docs/deployment.md#the-default-server).
DEFAULT_URL = f"redis://127.0.0.1:{DEV_PORT}/0"
URL_VARIABLE = "KEYSERIAL_REDIS_URL"
#: Environment variables read elsewhere, not settings.
_ENV_NOT_SETTINGS = frozenset(
    {"KEYSERIAL_REDIS_SERVER", URL_VARIABLE, METRICS_PORT_VARIABLE, EVENT_LOOP_VARIABLE}
)


def default_url() -> str:
    """``KEYSERIAL_REDIS_URL`` (unless empty), else :data:`DEFAULT_URL`, ``keyserial dev``'s."""
    return os.environ.get(URL_VARIABLE) or DEFAULT_URL


@dataclass(frozen=True, slots=True)
class _LowerBound:
    """The least value a numeric setting admits, stated with its field so that a new setting
    cannot be added without its check."""

    least: float
    inclusive: bool
    wording: str

    def admits(self, value: float) -> bool:
        return value >= self.least if self.inclusive else value > self.least


_LOWER_BOUND = "lower_bound"
_POSITIVE = _LowerBound(0, inclusive=False, wording="positive")
_NOT_NEGATIVE = _LowerBound(0, inclusive=True, wording="0 or positive")


_AT_LEAST_ONE = _LowerBound(1, inclusive=True, wording="at least 1")
#: A lease renewed every quarter of its TTL: below this, renewals are all a worker does.
_A_TENTH_OR_MORE = _LowerBound(0.1, inclusive=True, wording="at least 0.1 seconds")


def _bounded(default: Any, bound: _LowerBound) -> Any:
    return dataclasses.field(default=default, metadata={_LOWER_BOUND: bound})


def _positive(default: Any) -> Any:
    return _bounded(default, _POSITIVE)


def _not_negative(default: Any) -> Any:
    return _bounded(default, _NOT_NEGATIVE)


@dataclass(frozen=True, slots=True)
class Durability:
    """What an acknowledgement waits for: ``replicas`` replicas to have the writes (WAIT), and
    with ``fsync`` the master and those replicas to have written them to their AOF (WAITAOF).
    One wait blocks at most ``wait_ms``."""

    replicas: int
    fsync: bool
    wait_ms: int


@dataclass(frozen=True, slots=True)
class Settings:
    """How a namespace is laid out and how its workers behave.

    ``shard_count`` is fixed per namespace and recorded in Redis on first use; ``None`` adopts
    the recorded count (16 for a new namespace).
    """

    namespace: str = "default"
    shard_count: int | None = _bounded(None, _AT_LEAST_ONE)
    #: Seconds a shard lease lives without renewal; a dead owner's shards move after at most this.
    lease_ttl: float = _bounded(10.0, _A_TENTH_OR_MORE)
    #: Seconds an op's result is kept for fetching by op id and for deduplicating resubmits.
    result_ttl: float = _positive(3600.0)
    #: Largest encoded op envelope accepted by ``submit``.
    max_payload_bytes: int = _positive(1 << 20)
    #: Unprocessed entries a shard's stream may hold before ``submit`` raises ``BacklogFull``.
    max_backlog: int = _not_negative(100_000)
    #: Times an op may be running when its worker dies before it is dead-lettered.
    max_strikes: int = _positive(3)
    #: Stream entries a worker fetches per round trip (each entry may pack many ops).
    fetch_batch: int = _positive(64)
    #: Ops a worker holds per shard between fetch and commit.
    max_inflight: int = _positive(4096)
    #: Seconds between an owner's fetches when no wake-up asks for one (a lost one costs this).
    idle_poll: float = _positive(1.0)
    #: A worker taking over a shard with at most this many keys' states (and at most
    #: ``max_cached_states``) loads them all, then reads no state from Redis while none is
    #: evicted (0: never; larger shards' states load as ops need them).
    preload_states: int = _not_negative(10_000)
    #: Keys' states a shard's owner keeps in memory. Past it, the idle ones loaded first (no op
    #: queued, running or uncommitted on them) are dropped, down to 90% of it, and read again
    #: from Redis when an op needs them: a worker's memory is bounded whatever the key count.
    max_cached_states: int = _positive(10_000)
    #: Largest encoded state or result one op may commit; an op over it fails (ValueError) and
    #: writes nothing. (A state is written whole at every commit that changes it.)
    max_state_bytes: int = _positive(16 << 20)
    #: Seconds a submit waits for its reply when the caller passes no ``timeout``.
    submit_timeout: float = _positive(30.0)
    #: Seconds between health checks (a PING) of an idle subscription (replies, wake-ups): one
    #: that a NAT or a load balancer dropped without a word is reconnected within about twice
    #: this. A resubscription gets this long per round trip (three) before it is tried again.
    health_interval: float = _positive(5.0)
    #: Replicas that must have a commit (WAIT) before its replies go out and before a client
    #: takes a stored result as an answer, and a lease before its worker serves the shard; 0:
    #: the master's word is enough. See docs/deployment.md#durability.
    durable_replicas: int = _not_negative(0)
    #: Also wait until the master and those replicas have written the commit to their AOF
    #: (WAITAOF: Redis 7.2+, Valkey 8+, with appendonly on). See docs/deployment.md#durability.
    durable_fsync: bool = False
    #: The client's service, or '': its reply channels are then ``ks:<ns>:reply:<service>.*``,
    #: so that a client ACL user per service, allowed those channels alone, can neither read
    #: nor forge another service's replies. See docs/deployment.md#acl-users-least-privilege.
    service: str = ""
    #: A client takes each op's outcome from the shard's records, a reply message only telling
    #: it to look (one read per message: a hot key does about a fifth fewer ops a second).
    #: False takes the message's outcome as it is: only for a client user no untrusted client
    #: shares, since any client of the user may publish a forged reply. See
    #: docs/deployment.md#acl-users-least-privilege.
    verify_replies: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            bound = field.metadata.get(_LOWER_BOUND)
            value = getattr(self, field.name)
            _check_type(field.name, value, field.type)
            if bound is None or value is None:  # (None: a shard_count not given)
                continue
            if not math.isfinite(value):
                raise ConfigError(f"{field.name} must be a finite number, not {value!r}")
            if not bound.admits(value):
                raise ConfigError(f"{field.name} must be {bound.wording}, not {value!r}")
        check_namespace(self.namespace)
        check_service(self.service)

    @property
    def lease_ttl_ms(self) -> int:
        return max(1, round(self.lease_ttl * 1000))

    @property
    def durability(self) -> Durability | None:
        """What acknowledgements wait for; None: the master's word is enough."""
        if not (self.durable_replicas or self.durable_fsync):
            return None
        return Durability(self.durable_replicas, self.durable_fsync, self.durable_wait_ms)

    @property
    def durable_wait_ms(self) -> int:
        """How long one WAIT for ``durable_replicas`` may block: short against the lease, so
        a missing replica delays replies, never the worker's lease renewals."""
        return max(1, round(min(self.lease_ttl / 4, 1.0) * 1000))

    @property
    def result_ttl_ms(self) -> int:
        return max(1, round(self.result_ttl * 1000))

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
        """Settings from ``explicit`` values, then ``KEYSERIAL_<FIELD>`` variables of
        ``environ`` (default: ``os.environ``), then the defaults. An explicit ``None`` means "not
        given" (the variable or the default applies), as a flag left out does.

        :raises ConfigError: for an unknown ``KEYSERIAL_`` variable or a bad value (naming the
            variable), or an unworkable explicit value.
        :raises TypeError: for an explicit name that is not a setting.
        """
        values = _from_environ(os.environ if environ is None else environ)
        values.update({name: value for name, value in explicit.items() if value is not None})
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read ``KEYSERIAL_<FIELD>`` variables (``KEYSERIAL_LEASE_TTL=2.5``) over the defaults.

        :raises ConfigError: for an unknown ``KEYSERIAL_`` variable or a bad value.
        """
        return cls.resolve(environ)


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """Each ``KEYSERIAL_<FIELD>`` variable's value, checked on its own so that an error names
    the variable that caused it."""
    fields = {field.name: field for field in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(_ENV_PREFIX) or name in _ENV_NOT_SETTINGS:
            continue
        field_name = name[len(_ENV_PREFIX) :].lower()
        if field_name not in fields:
            known = ", ".join(_ENV_PREFIX + each.upper() for each in sorted(fields))
            raise ConfigError(f"unknown setting {name}; known: {known}")
        value = _parse(name, raw, fields[field_name].type)
        try:
            Settings(**{field_name: value})
        except ConfigError as exc:
            raise ConfigError(f"{name}={raw!r}: {exc}") from None
        values[field_name] = value
    return values


#: What each annotation of a setting admits, and how to say so. (A bool is not a number here:
#: ``max_strikes=True`` is a slip, not a 1.)
def _whole(value: Any) -> bool:
    return isinstance(value, int) and type(value) is not bool


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda value: isinstance(value, str)),
    "int": ("a whole number", _whole),
    "int | None": ("a whole number or None", lambda value: value is None or _whole(value)),
    "float": ("a number", lambda value: _whole(value) or isinstance(value, float)),
    "bool": ("True or False", lambda value: type(value) is bool),
}


def _check_type(name: str, value: Any, kind: Any) -> None:
    wording, admits = _KINDS[kind]
    if not admits(value):
        raise ConfigError(f"{name} must be {wording}, not {value!r}")


#: What a variable's text must be, by the setting's annotation.
_VARIABLE_KINDS = {
    "bool": "true or false (1/0, yes/no)",
    "int": "a whole number",
    "int | None": "a whole number",
    "float": "a number",
}

_BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _parse(name: str, raw: str, kind: Any) -> Any:
    try:
        if kind == "bool":
            if raw.lower() not in _BOOLEANS:
                raise ValueError(raw)
            return _BOOLEANS[raw.lower()]
        if kind in ("int", "int | None"):
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {_VARIABLE_KINDS[kind]}") from None
    return raw
