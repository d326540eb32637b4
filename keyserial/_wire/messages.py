"""The messages workers exchange to run an op across shards, typed (their JSON shapes are in
docs/wire-format.md, "Coordination messages"; the short keys keep them small on the wire and
readable by workers of other versions during a rolling deploy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: A coordination message, as it travels: a grant request ("q"), a grant ("g") or a decision
#: notice ("d").
Wire = dict[str, Any]


class MalformedMessage(ValueError):
    """A coordination message or record that does not have its documented shape."""


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """A coordinator asking a participant shard's owner to hold keys for one attempt of a
    cross-shard op. It travels as an item of a coordination message that the coordinator's
    worker signed for the owner's channel: a worker takes a request from no stream and from no
    message that a listed worker did not sign for it."""

    #: The home shard, which coordinates the op.
    home: int
    op_id: str
    #: The attempt: the home shard's epoch when the coordinator began it.
    attempt: int
    #: The participant shard it is for, by name (``7``, or ``7@2`` in layout generation 2): a
    #: request for another shard, or another generation's, is not taken.
    target: str
    #: The keys to hold, all on the participant shard.
    keys: tuple[str, ...]
    #: The coordinator's worker channel, where the grant goes.
    channel: str
    #: When the coordinator made it (ms, its clock): one taken much later is refused, since
    #: what became of its attempt may no longer be on record.
    at: int

    def to_wire(self) -> Wire:
        return {
            "t": "q",
            "op": self.op_id,
            "a": self.attempt,
            "h": self.home,
            "s": self.target,
            "k": list(self.keys),
            "c": self.channel,
            "at": self.at,
        }

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> GrantRequest:
        """:raises MalformedMessage: unless every field has its type, and keys are named."""
        home, op_id, attempt = message.get("h"), message.get("op"), message.get("a")
        target, keys = message.get("s"), message.get("k")
        channel, at = message.get("c"), message.get("at")
        if not (
            type(home) is int
            and home >= 0
            and isinstance(op_id, str)
            and op_id
            and type(attempt) is int
            and isinstance(target, str)
            and isinstance(keys, list)
            and keys
            and all(isinstance(key, str) for key in keys)
            and isinstance(channel, str)
            and type(at) is int
        ):
            raise MalformedMessage(f"bad grant request {dict(message)!r}"[:300])
        return cls(home, op_id, attempt, target, tuple(keys), channel, at)


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
    #: The op's home shard (-1 from a worker that sends none): a takeover of the participant
    #: shard reads its attempt's decision there.
    home: int = -1
    #: A *lent* grant's (on a standalone server): the participant owner's epoch, which fences
    #: the home's step that writes the keys itself. None: the participant recorded a hold and
    #: applies the decision with its own step (a cluster).
    epoch: int | None = None

    def to_wire(self) -> Wire:
        wire: Wire = {
            "t": "g",
            "op": self.op_id,
            "a": self.attempt,
            "s": self.shard,
            "st": self.states,
            "f": self.fence,
            "c": self.channel,
            "h": self.home,
        }
        if self.epoch is not None:
            wire["e"] = self.epoch
        return wire

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> KeyGrant:
        try:
            fence, home, epoch = message.get("f"), message.get("h", -1), message.get("e")
            return cls(
                str(message["op"]),
                int(message["a"]),
                int(message["s"]),
                [(str(key), state) for key, state in message["st"]],
                fence if isinstance(fence, int) else None,
                str(message["c"]),
                home if type(home) is int else -1,
                epoch if type(epoch) is int else None,
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
    #: shard -> the fence of its lent grant (see :attr:`KeyGrant.epoch`): the shards whose
    #: writes the home's step wrote itself, each naming the grant it wrote them under.
    lent: dict[int, int] = field(default_factory=dict)

    def writes_of(self, shard: int) -> list[tuple[str, str]]:
        return self.writes.get(shard, [])

    def to_wire(self) -> Wire:
        if self.aborted is not None:
            return {"abort": self.aborted}
        wire: Wire = {"w": {str(shard): writes for shard, writes in self.writes.items()}}
        if self.lent:
            wire["l"] = {str(shard): fence for shard, fence in self.lent.items()}
        return wire

    @classmethod
    def from_wire(cls, record: Mapping[str, Any]) -> Decision:
        try:
            if "abort" in record:
                return cls({}, str(record["abort"]))
            return cls(
                {
                    int(shard): [(str(key), str(state)) for key, state in writes]
                    for shard, writes in record.get("w", {}).items()
                },
                lent={int(shard): int(fence) for shard, fence in record.get("l", {}).items()},
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"bad decision {dict(record)!r}") from exc


@dataclass(frozen=True, slots=True)
class DecisionNotice:
    """The coordinator telling a participant the decision of an attempt."""

    op_id: str
    attempt: int
    decision: Decision
    #: The op's home shard, which coordinates it.
    home: int = -1

    def to_wire(self) -> Wire:
        decision = self.decision.to_wire()
        return {"t": "d", "op": self.op_id, "a": self.attempt, "h": self.home, "d": decision}

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> DecisionNotice:
        try:
            home = message.get("h", -1)
            return cls(
                str(message["op"]),
                int(message["a"]),
                Decision.from_wire(message["d"]),
                home if type(home) is int else -1,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedMessage(f"bad decision notice {dict(message)!r}") from exc


#: What one coordination message carries.
Item = GrantRequest | KeyGrant | DecisionNotice


def batch(items: Sequence[str]) -> str:
    """One message carrying ``items`` (encoded requests, grants and decision notices), all for
    the same worker channel: signed once, published once. A lone item travels as it is."""
    if len(items) == 1:
        return items[0]
    return '{"t":"b","m":[' + ",".join(items) + "]}"


def messages_from_wire(message: Mapping[str, Any]) -> list[Item]:
    """The items of a message: one, or a batch's (:func:`batch`).

    :raises MalformedMessage: a message, or an item of a batch, of neither kind."""
    if isinstance(message, Mapping) and message.get("t") == "b":
        items = message.get("m")
        if not isinstance(items, list) or not items:
            raise MalformedMessage(f"not a batch of coordination messages: {message!r}"[:200])
        return [from_wire(item) for item in items]
    return [from_wire(message)]


def from_wire(message: Mapping[str, Any]) -> Item:
    """:raises MalformedMessage: a message of no known kind."""
    kind = message.get("t") if isinstance(message, Mapping) else None
    if kind == "q":
        return GrantRequest.from_wire(message)
    if kind == "g":
        return KeyGrant.from_wire(message)
    if kind == "d":
        return DecisionNotice.from_wire(message)
    raise MalformedMessage(f"not a coordination message: {message!r}"[:200])
