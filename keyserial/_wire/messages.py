"""The messages workers exchange to run an op across shards, typed (their JSON shapes are in
docs/wire-format.md, "Coordination messages"; the short keys keep them small on the wire and
readable by workers of other versions during a rolling deploy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .json_text import dumps

#: A coordination message, as it travels: a grant ("g") or a decision notice ("d").
Wire = dict[str, Any]


class MalformedMessage(ValueError):
    """A coordination message or record that does not have its documented shape."""


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """What a ``keyserial.grant`` op asks a participant shard (the op's ``kwargs``), signed by
    the coordinator's worker (see ``_wire.signing``): a participant takes no other."""

    #: The home shard, which coordinates the op.
    home: int
    op_id: str
    #: The attempt: the home shard's epoch when the coordinator began it.
    attempt: int
    #: The coordinator's worker channel, where the grant goes.
    channel: str
    #: The participant shard it is for, by name (``7``, or ``7@2`` in layout generation 2): a
    #: request copied to another shard, or to another generation's, is not for it.
    target: str = ""
    #: When the coordinator signed it (ms, its clock): a copy appended much later is refused.
    at: int = 0
    #: The signer id of the coordinator's worker and its signature (see :meth:`signed_text`).
    signer: str = ""
    signature: str = ""
    #: The signed text's tag for the participant shard's owner the coordinator expects (see
    #: ``ReplySigner.tag_request``), which that owner checks instead of the signature; '' if
    #: the coordinator expects none yet.
    tag: str = ""

    def signed_text(self, namespace: str, keys: Sequence[str]) -> str:
        """What the signature covers: every field but the signature, the requested keys and
        the namespace."""
        fields = [namespace, self.target, self.home, self.op_id, self.attempt, self.channel]
        return dumps([*fields, self.at, list(keys)])

    def to_wire(self) -> Wire:
        wire: Wire = {
            "home": self.home,
            "op": self.op_id,
            "attempt": self.attempt,
            "channel": self.channel,
            "to": self.target,
            "at": self.at,
            "k": self.signer,
            "sig": self.signature,
        }
        if self.tag:
            wire["tag"] = self.tag
        return wire

    @classmethod
    def from_wire(cls, kwargs: Mapping[str, Any], *, below: int) -> GrantRequest:
        """:raises MalformedMessage: unless the home is a shard under ``below`` (a participant
        is always above its home) and every field has its type (the signature's fields may be
        missing: such a request is unsigned; the tag too: then only the signature is checked)."""
        home, op_id = kwargs.get("home"), kwargs.get("op")
        attempt, channel = kwargs.get("attempt"), kwargs.get("channel")
        target, at = kwargs.get("to", ""), kwargs.get("at", 0)
        signer, signature = kwargs.get("k", ""), kwargs.get("sig", "")
        tag = kwargs.get("tag", "")
        if not (
            type(home) is int
            and 0 <= home < below
            and isinstance(op_id, str)
            and type(attempt) is int
            and isinstance(channel, str)
            and isinstance(target, str)
            and type(at) is int
            and isinstance(signer, str)
            and isinstance(signature, str)
            and isinstance(tag, str)
        ):
            raise MalformedMessage(f"bad grant request {dict(kwargs)!r}"[:300])
        return cls(home, op_id, attempt, channel, target, at, signer, signature, tag)


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """A participant's answer: it holds the keys, here are their committed states."""

    op_id: str
    attempt: int
    shard: int
    states: list[tuple[str, str | None]]
    #: The granted keys' fencing token (None from a worker that sends none).
    fence: int | None
    #: The participant's worker channel, where the decision goes.
    channel: str

    def to_wire(self) -> Wire:
        return {
            "t": "g",
            "op": self.op_id,
            "a": self.attempt,
            "s": self.shard,
            "st": self.states,
            "f": self.fence,
            "c": self.channel,
        }

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> KeyGrant:
        try:
            fence = message.get("f")
            return cls(
                str(message["op"]),
                int(message["a"]),
                int(message["s"]),
                [(str(key), state) for key, state in message["st"]],
                fence if isinstance(fence, int) else None,
                str(message["c"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"bad grant {dict(message)!r}") from exc


@dataclass(frozen=True, slots=True)
class Decision:
    """What became of an attempt: each participant shard's writes, or an abort."""

    #: shard -> [(key, JSON state or '' to delete)]; empty when aborted.
    writes: dict[int, list[tuple[str, str]]]
    #: Why the attempt was aborted (None: it committed).
    aborted: str | None = None

    def writes_of(self, shard: int) -> list[tuple[str, str]]:
        return self.writes.get(shard, [])

    def to_wire(self) -> Wire:
        if self.aborted is not None:
            return {"abort": self.aborted}
        return {"w": {str(shard): writes for shard, writes in self.writes.items()}}

    @classmethod
    def from_wire(cls, record: Mapping[str, Any]) -> Decision:
        try:
            if "abort" in record:
                return cls({}, str(record["abort"]))
            return cls(
                {
                    int(shard): [(str(key), str(state)) for key, state in writes]
                    for shard, writes in record.get("w", {}).items()
                }
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"bad decision {dict(record)!r}") from exc


@dataclass(frozen=True, slots=True)
class DecisionNotice:
    """The coordinator telling a participant the decision of an attempt."""

    op_id: str
    attempt: int
    decision: Decision

    def to_wire(self) -> Wire:
        return {"t": "d", "op": self.op_id, "a": self.attempt, "d": self.decision.to_wire()}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> DecisionNotice:
        try:
            return cls(str(message["op"]), int(message["a"]), Decision.from_wire(message["d"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"bad decision notice {dict(message)!r}") from exc


def batch(items: Sequence[str]) -> str:
    """One message carrying ``items`` (encoded grants and decision notices), all for the same
    worker channel: signed once, published once. A lone item travels as it is."""
    if len(items) == 1:
        return items[0]
    return '{"t":"b","m":[' + ",".join(items) + "]}"


def messages_from_wire(message: Mapping[str, Any]) -> list[KeyGrant | DecisionNotice]:
    """The items of a message: one, or a batch's (:func:`batch`).

    :raises MalformedMessage: a message, or an item of a batch, of neither kind."""
    if isinstance(message, Mapping) and message.get("t") == "b":
        items = message.get("m")
        if not isinstance(items, list) or not items:
            raise MalformedMessage(f"not a batch of coordination messages: {message!r}"[:200])
        return [from_wire(item) for item in items]
    return [from_wire(message)]


def from_wire(message: Mapping[str, Any]) -> KeyGrant | DecisionNotice:
    """:raises MalformedMessage: a message of neither kind."""
    kind = message.get("t") if isinstance(message, Mapping) else None
    if kind == "g":
        return KeyGrant.from_wire(message)
    if kind == "d":
        return DecisionNotice.from_wire(message)
    raise MalformedMessage(f"not a coordination message: {message!r}"[:200])
