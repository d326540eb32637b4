"""Error replies as exceptions: what Redis refused, in keyserial's terms.

The boundary (``_backend.transport.classify_reply``) hands every error reply to :func:`refusal`, the
one place its message is read, and raises, or returns as a pipelined call's reply, what it makes of
it. Every other module catches a type, never matches a string, and never sees a redis-py
exception. Each keeps the server's message as its text, so logs read as before.
"""

from __future__ import annotations

from ..errors import KeyserialError


class Refused(KeyserialError):
    """An error reply that no retry cures: a script's own refusal, or a command the server
    rejects. (A "not now" reply, such as BUSY or LOADING, is ``BackendUnavailable`` instead;
    refused credentials or ACL rules are ``ConfigError``.)"""


class Fenced(Refused):
    """A fenced script found another owner's epoch (``FENCED …``): it wrote nothing. A shard
    runner turns it into ``LeaseLost``."""


class BacklogRefused(Refused):
    """The submit script found the shard's backlog at its limit (``BACKLOG <length>``): nothing
    was appended. The client turns it into ``BacklogFull``."""

    def __init__(self, message: str, *, length: int) -> None:
        super().__init__(message)
        #: The entries the shard's stream held past progress.
        self.length = length


class Diverged(Refused):
    """A commit found that what its runner ran on is not what Redis holds, and wrote nothing.
    The runner gives its shard up, to start again from what Redis has."""


class PushUnconfirmed(Diverged):
    """``step`` found that the stream does not hold the entries a runner took in from pushes,
    as pushed (``UNCONFIRMED …``): a forged or garbled push, or a failover lost the entry."""


class Replayed(Diverged):
    """A commit found an outcome it would store already stored (``REPLAYED …``), and is not
    the same commit sent again: an op ran again under an op id that has an outcome (an entry
    appended again as ``fresh``, a replayed push). The next owner answers it from the record."""


class StreamRestarted(Diverged):
    """``step`` committed an entry appended under the largest id, which left no id for the next
    append, and started the stream, progress and horizon again (``RESTARTED …``): the runner
    gives its shard up to start from them. (Unlike the other refusals, the commit was written.)"""


class AttemptAhead(Refused):
    """``resolve`` found a grant request's attempt past the home shard's epoch (``AHEAD …``):
    no coordinator began it, so the request is forged or garbled. Nothing was written, so the
    attempt is not aborted before it begins."""


class OwnedElsewhere(Diverged):
    """``step`` found one of the other shards whose writes it carries for a cross-shard op
    (its ``index``, counted from 1 in the order the step names them) owned by another worker
    now (``ELSEWHERE <index>``): it wrote nothing."""

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index


class MoveRefused(Refused):
    """``move`` or ``flip`` found another reshard under way (``MOVING <record>``), or a live
    layout other than the one the move leaves (``LIVE <generation> <shards>``): it wrote
    nothing."""


class ShardSealed(Refused):
    """``submit`` found the shard sealed by a reshard (``RESHARDED …``): nothing was
    appended. A client reads the namespace's layout again and appends where the op routes now."""


class ScriptMissing(Refused):
    """``EVALSHA`` of a script the server does not hold (a restart, ``SCRIPT FLUSH``): the
    boundary sends the call again as ``EVAL``, so no caller sees this one."""


#: Script refusals that carry nothing but their message.
_BY_CODE: dict[str, type[Refused]] = {
    "FENCED": Fenced,
    "AHEAD": AttemptAhead,
    "UNCONFIRMED": PushUnconfirmed,
    "REPLAYED": Replayed,
    "RESTARTED": StreamRestarted,
    "MOVING": MoveRefused,
    "LIVE": MoveRefused,
    "RESHARDED": ShardSealed,
}


def refusal(message: str, *, script_missing: bool = False) -> Refused:
    """An error reply as keyserial's exception: a script's refusal (each script's header
    documents its own, by the code that starts the message), or any other error reply.
    ``script_missing``: the reply was ``NOSCRIPT``."""
    if script_missing:
        return ScriptMissing(message)
    code, _, detail = message.partition(" ")
    if code in _BY_CODE:
        return _BY_CODE[code](message)
    if code == "BACKLOG" and detail.isdigit():
        return BacklogRefused(message, length=int(detail))
    index = detail.partition(" ")[0]
    if code == "ELSEWHERE" and index.isdigit():
        return OwnedElsewhere(message, index=int(index))
    return Refused(message)
