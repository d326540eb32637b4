"""Every error keyserial raises, under one root.

::

    KeyserialError
    ├── ConfigError (ValueError)            unworkable settings: bad range, unknown variable
    │   └── ShardCountMismatch              the namespace records another shard count
    ├── BackendUnavailable (ConnectionError) Redis/Valkey cannot be reached; names the URL
    ├── PayloadTooLarge (ValueError)        an op's encoded envelope is over the limit; nothing sent
    ├── BacklogFull                         the shard's stream holds too many unprocessed entries
    ├── SubmitTimeout (TimeoutError)        no reply in time; the op may still apply later
    ├── OutcomeUnknown                      waited past result_ttl: lost, or applied and expired
    ├── ResultNotFound (LookupError)        no stored result for an op id (not applied, or expired)
    ├── LeaseLost                           a worker lost a shard's lease; its writes are fenced off
    └── OperationFailed                     the op ran (or could not run) and failed; carries the
        │                                   remote error's type and message
        ├── UnknownOperation                no op of that name is registered on the worker
        ├── MalformedOperation              the envelope could not be decoded or was misrouted
        ├── PoisonOperation                 the op killed its worker repeatedly; dead-lettered
        └── InsufficientFunds               a ledger withdraw/transfer would make a balance negative

Errors raised inside an op travel as ``{"type", "message", "data"}`` (see ``docs/wire-format.md``);
the client rebuilds keyserial's own types from ``type`` and wraps any other in ``OperationFailed``.

An error's message reaches logs and error trackers, so it shows what it names with care: a long
key cut short, a Redis URL without its credentials (:func:`redact`, the one helper every log
line and banner that names a URL goes through too).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

#: Longest text of a key (or op id) an error message shows whole; a longer one is cut short,
#: saying how long it is: a 10 MB key must not land in every log line and error tracker.
_SHOWN = 200


def _shown(text: str) -> str:
    """``repr(text)``, cut short if long."""
    quoted = repr(text)
    if len(quoted) <= _SHOWN:
        return quoted
    return f"{quoted[: _SHOWN - 20]}…' ({len(text)} characters)"


def _shown_keys(keys: Sequence[str]) -> str:
    return _shown(keys[0]) if len(keys) == 1 else "[" + ", ".join(map(_shown, keys)) + "]"


#: Query parameters redis-py accepts as credentials (``?password=``, ``?ssl_password=``).
_SECRET_PARAMETER = re.compile(r"(^|&)([^=&]*password[^=&]*)=[^&]*", re.IGNORECASE)


def redact(url: str) -> str:
    """``redis://app:s3cret@host:6379/0`` -> ``redis://app:***@host:6379/0`` (and any
    ``password`` query parameter's value -> ``***``). A URL that cannot be parsed is not shown."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a Redis URL that cannot be parsed)"
    # Replaced in place (urlunsplit would turn "unix:///path" into "unix:/path").
    shown = url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        shown = shown.replace(parts.netloc, f"{userinfo.split(':', 1)[0]}:***@{hostport}", 1)
    if parts.query:
        query = _SECRET_PARAMETER.sub(r"\1\2=***", parts.query)
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown


class KeyserialError(Exception):
    """Root of every keyserial error."""


class ConfigError(KeyserialError, ValueError):
    """Settings that cannot work together (caught before anything is misrouted)."""


class ShardCountMismatch(ConfigError):
    """The namespace's shard count recorded in Redis differs from the configured one; routing
    with another count would send ops to the wrong shard. ``setting`` names what configured it
    (``shards=`` in Python, ``--shard-count`` on the command line), for the advice."""

    def __init__(
        self, *, namespace: str, recorded: int, configured: int, setting: str = "shards="
    ) -> None:
        self.namespace = namespace
        self.recorded = recorded
        self.configured = configured
        self.setting = setting
        separator = "" if setting.endswith("=") else " "
        super().__init__(
            f"namespace {namespace!r} has {recorded} shards recorded in Redis, but this process"
            f" was configured with {configured}; routing with a different count would send ops"
            f" to the wrong shard. Use {setting}{separator}{recorded} (or a new namespace)."
        )

    def configured_by(self, setting: str) -> ShardCountMismatch:
        """The same error, advising ``setting`` (``--shard-count``, ``KEYSERIAL_SHARD_COUNT=``)."""
        return ShardCountMismatch(
            namespace=self.namespace,
            recorded=self.recorded,
            configured=self.configured,
            setting=setting,
        )


class ReshardRefused(KeyserialError):
    """``keyserial.reshard`` (``keyserial reshard``) could not start the move asked for: another
    move of the namespace is under way (finish it first: run it again with its count), or the
    layout changed meanwhile. Nothing was written."""


class BackendUnavailable(KeyserialError, ConnectionError):
    """Redis/Valkey at ``url`` could not be reached (after the configured retries); ``url`` is
    shown with its password hidden."""

    def __init__(
        self,
        url: str,
        cause: BaseException | str,
        *,
        op_id: str | None = None,
        keys: Sequence[str] = (),
    ) -> None:
        #: The URL with its password hidden: this error reaches logs.
        self.url = redact(url)
        self.op_id = op_id
        #: Every key of the op (pass them as ``ks.result(op_id, key=keys)``).
        self.keys = tuple(keys)
        #: Why, without the URL (one error wrapping another says it once).
        self.reason: str = cause.reason if isinstance(cause, BackendUnavailable) else str(cause)
        detail = f"cannot reach Redis at {self.url}: {self.reason}"
        if op_id is not None:
            detail += (
                f" (op {op_id!r} may or may not have been appended; resubmit with the same"
                " op_id to apply it exactly once)"
            )
        super().__init__(detail)


class PayloadTooLarge(KeyserialError, ValueError):
    """An op's encoded envelope exceeds ``max_payload_bytes``; nothing was sent."""

    def __init__(self, *, key: str, size: int, limit: int) -> None:
        self.key = key
        self.size = size
        self.limit = limit
        super().__init__(
            f"op on key {_shown(key)} encodes to {size} bytes, over the limit of {limit} bytes"
            " (raise max_payload_bytes, or store the blob elsewhere and pass a reference)"
        )


class BacklogFull(KeyserialError):
    """The shard's stream holds ``limit`` or more entries its owner has not committed yet."""

    def __init__(self, *, shard: int, limit: int) -> None:
        self.shard = shard
        self.limit = limit
        super().__init__(
            f"shard {shard} has {limit} or more unprocessed entries; is a worker serving it?"
            " Nothing was appended."
        )


class SubmitTimeout(KeyserialError, TimeoutError):
    """No reply within the timeout. The op may still apply (unless it was never sent).

    ``keys`` holds every key of the op, so ``ks.result(op_id, key=keys)`` looks in the op's home
    shard; ``vacant`` lists the op's shards that no worker held when the timeout fired, and
    ``server`` the Redis it waited on (its URL, password hidden), which the message then names;
    ``paused`` lists the op's keys that an operator had paused (``keyserial keys pause``): the
    message then says so, and how to resume them.
    """

    def __init__(
        self,
        *,
        key: str,
        op_id: str,
        timeout: float,
        keys: Sequence[str] = (),
        namespace: str | None = None,
        vacant: Sequence[int] = (),
        server: str | None = None,
        paused: Sequence[str] = (),
    ) -> None:
        self.key = key
        self.op_id = op_id
        self.timeout = timeout
        self.keys = tuple(keys) or (key,)
        self.namespace = namespace
        self.vacant = tuple(vacant)
        self.server = None if server is None else redact(server)
        self.paused = tuple(paused)
        where = _shown_keys(self.keys)
        reasons = []
        if self.vacant:
            shards = ", ".join(str(shard) for shard in self.vacant)
            at = "" if self.server is None else f" at {self.server}"
            there = "" if self.server is None else " there"
            reasons.append(
                f"no worker holds shard {shards} of namespace {namespace!r}{at} (its lease is"
                f" vacant; is a worker serving this namespace{there}?)"
            )
        if self.paused:
            reasons.append(_paused_reason(self.paused, namespace))
        why = f": {'; '.join(reasons)}" if reasons else ""
        super().__init__(
            f"no reply for op {_shown(op_id)} on key{'s' if len(self.keys) > 1 else ''} {where}"
            f" within {timeout:g}s{why}; it may still apply. Fetch its outcome with"
            f" `ks.result({_shown(op_id)}, key={where})`, or resubmit with op_id={_shown(op_id)}"
            " (it never runs twice)."
        )


def _paused_reason(paused: Sequence[str], namespace: str | None) -> str:
    """Why an op on ``paused`` keys waits, and the command that lets it run."""
    if len(paused) == 1:
        named, them = f"key {_shown(paused[0])} is", "it"
        command = f"keyserial keys resume {_argument(paused[0], 'KEY')}"
    else:
        named, them = f"keys {', '.join(map(_shown, paused))} are", "each"
        command = "keyserial keys resume KEY"
    if namespace is not None:
        command += f" --namespace {_argument(namespace, 'NAMESPACE')}"
    return (
        f"{named} paused (`keyserial keys pause`): the op waits until an operator resumes"
        f" {them} with `{command}`"
    )


def _argument(text: str, placeholder: str) -> str:
    """``text`` as a shell argument, or ``placeholder`` where a message should not print it
    raw (a control character, or too long to paste)."""
    if not text.isprintable() or len(text) > _SHOWN:
        return placeholder
    return shlex.quote(text)


class OutcomeUnknown(KeyserialError):
    """An op waited longer than ``result_ttl``, and its entry is gone with no outcome stored:
    either a failover lost it before it ran, or it applied and its outcome expired. The two
    cannot be told apart, and appending it again could apply it twice, so it is not."""

    def __init__(self, *, key: str, op_id: str, waited: float, result_ttl: float) -> None:
        super().__init__(
            f"op {_shown(op_id)} on key {_shown(key)} waited {waited:.0f}s, longer than result_ttl"
            f" ({result_ttl:g}s), and its entry is gone with no outcome stored: it may or may"
            " not have applied. It was not appended again; check the key's state before you"
            " resubmit."
        )
        self.key, self.op_id = key, op_id


class ResultNotFound(KeyserialError, LookupError):
    """No stored result for ``op_id``: not applied yet, or older than the result retention."""

    def __init__(self, *, key: str, op_id: str) -> None:
        super().__init__(
            f"no result stored for op {_shown(op_id)} on key {_shown(key)}: it has not been"
            " applied yet,"
            " or its result expired"
        )
        self.key, self.op_id = key, op_id


class LeaseLost(KeyserialError):
    """This worker no longer owns ``shard``; whatever it had not committed is discarded."""

    def __init__(self, shard: int, reason: str) -> None:
        self.shard = shard
        super().__init__(f"lost the lease on shard {shard}: {reason}")


class OperationFailed(KeyserialError):
    """The op failed on the worker; ``error_type`` and ``message`` describe the remote error."""

    wire_type: ClassVar[str] = ""

    def __init__(
        self,
        message: str,
        *,
        error_type: str | None = None,
        key: str | None = None,
        op_id: str | None = None,
        data: dict[str, Any] | None = None,
        keys: Sequence[str] = (),
    ) -> None:
        # A remote error's type leads the message ("ValueError: only 3 left"); this class's
        # own type is already the exception's name, so it is not repeated.
        remote = error_type is not None and error_type != self.wire_type
        self.error_type = error_type or self.wire_type or type(self).__name__
        self.message = message
        self.key = key
        self.op_id = op_id
        self.data = data or {}
        #: Every key of the op (``key`` is the first): ``ks.result(op_id, key=keys)`` finds it.
        self.keys = tuple(keys) or ((key,) if key is not None else ())
        #: Where the op raised, as the worker saw it (its traceback, at most 8 KiB), or None:
        #: keyserial's own refusals and errors an op raises on purpose (``OperationFailed``
        #: and its subclasses) carry none.
        self.remote_traceback: str | None = None
        plural = "s" if len(self.keys) > 1 else ""
        on = f"key{plural} {_shown_keys(self.keys)}" if self.keys else f"key {key!r}"
        where = f" (op {_shown(op_id)} on {on})" if op_id is not None else ""
        super().__init__(f"{self.error_type}: {message}{where}" if remote else f"{message}{where}")

    @classmethod
    def from_wire(
        cls,
        error: dict[str, Any],
        *,
        key: str | None,
        op_id: str | None,
        keys: Sequence[str] = (),
    ) -> OperationFailed:
        """Rebuild the error a worker reported, as keyserial's own type when it is one, with
        the op's traceback on the worker as a note (Python prints it with the error's own)."""
        error_type = str(error.get("type", "Error"))
        message = str(error.get("message", ""))
        data = error.get("data")
        data = data if isinstance(data, dict) else {}
        kind = _WIRE_TYPES.get(error_type, OperationFailed)
        failed = kind._rebuild(_Reported(message, error_type, key, op_id, data, tuple(keys)))
        remote = error.get("traceback")
        if isinstance(remote, str) and remote:
            failed.remote_traceback = remote
            failed.add_note(f"Traceback on the worker:\n{remote.rstrip()}")
        return failed

    @classmethod
    def _rebuild(cls, reported: _Reported) -> OperationFailed:
        return cls(
            reported.message,
            error_type=reported.error_type,
            key=reported.key,
            op_id=reported.op_id,
            data=reported.data,
            keys=reported.keys,
        )


@dataclass(frozen=True)
class _Reported:
    """An op's error as a worker reported it, with where the client submitted the op."""

    message: str
    error_type: str
    key: str | None
    op_id: str | None
    data: dict[str, Any]
    keys: tuple[str, ...]


class UnknownOperation(OperationFailed):
    """No op of that name is registered on the worker that served the shard."""

    wire_type = "keyserial.UnknownOperation"


class MalformedOperation(OperationFailed):
    """The envelope could not be decoded, or its key does not route to the shard it was sent to."""

    wire_type = "keyserial.MalformedOperation"


class PoisonOperation(OperationFailed):
    """The op killed its worker repeatedly and was moved to the shard's dead-letter stream."""

    wire_type = "keyserial.PoisonOperation"


class TimerCancelled(OperationFailed):
    """The op was a timer (a delayed op, or one an op set with ``ctx.after``) cancelled before
    it ran: by an op's ``ctx.cancel``, or an operator's ``keyserial timers cancel``."""

    wire_type = "keyserial.TimerCancelled"


class InsufficientFunds(OperationFailed):
    """A withdrawal or transfer larger than the balance; the balance is left untouched."""

    wire_type = "keyserial.InsufficientFunds"

    def __init__(
        self,
        *,
        balance: int,
        amount: int,
        key: str | None = None,
        op_id: str | None = None,
        keys: Sequence[str] = (),
    ) -> None:
        self.balance = balance
        self.amount = amount
        super().__init__(
            f"balance {balance} is less than {amount}",
            key=key,
            op_id=op_id,
            data={"balance": balance, "amount": amount},
            keys=keys,
        )

    @classmethod
    def _rebuild(cls, reported: _Reported) -> OperationFailed:
        balance, amount = reported.data.get("balance"), reported.data.get("amount")
        if isinstance(balance, int) and isinstance(amount, int):
            return cls(
                balance=balance,
                amount=amount,
                key=reported.key,
                op_id=reported.op_id,
                keys=reported.keys,
            )
        return OperationFailed._rebuild(reported)


_WIRE_TYPES: dict[str, type[OperationFailed]] = {
    kind.wire_type: kind
    for kind in (
        UnknownOperation,
        MalformedOperation,
        PoisonOperation,
        TimerCancelled,
        InsufficientFunds,
    )
}
