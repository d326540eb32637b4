"""Wire format v1: what goes into a shard's stream, what comes back. Never pickle.

Documented for other languages in ``docs/wire-format.md``. In short:

* a stream entry has fields ``v`` = ``"1"`` and ``ops`` = a JSON array of envelopes
  ``{"id", "key", "op", "args"?, "kwargs"?, "reply"?}`` (a multi-key op has ``"keys": [...]``
  instead of ``"key"``);
* an outcome is ``{"ok": value}`` or ``{"error": {"type", "message", "data"?}}``, and, as a
  worker stores an op's, ``"b"``: the op's binding (see :func:`binding`);
* a reply, published on the envelope's ``reply`` channel, is ``{"v": 1, "r": [[id, outcome], …]}``,
  each outcome with the shard (``s``), layout generation (``g``) and entries (``e``) it answers.
"""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MalformedOperation, UnknownOperation
from .call import Call
from .json_text import dumps, encodes, parse
from .layout import ShardKeys

WIRE_VERSION = "1"
#: The largest stream id there is (XADD takes it by hand): nothing can follow it, and a range
#: that starts after it is an error in Redis, not an empty range.
LARGEST_ID = "18446744073709551615-18446744073709551615"
#: A JSON escape of a UTF-16 surrogate: an entry with one may decode to invalid text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(slots=True)
class Envelope:
    """One op as it travels in a stream entry. (Not frozen: a worker decodes one per op, and a
    frozen dataclass takes four times as long to build.)"""

    op_id: str
    keys: tuple[str, ...]
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    reply: str | None
    #: Sent with ``keys`` (a multi-key op), not ``key``.
    multi: bool = False
    #: Each key's shard, once the worker has routed a multi-key op (see ``_wire.routing.route``):
    #: routed once, not at every step of its way.
    shards: tuple[int, ...] = ()
    #: The W3C trace context of the submit that sent it (``tc``), if the client traced it.
    trace: dict[str, str] | None = None

    @property
    def key(self) -> str:
        """The op's key (a multi-key op's first key)."""
        return self.keys[0]


def parse_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id, ``<ms>-<seq>``, as numbers (ordered as the stream orders them); a
    cursor that never moved may read ``0``."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class MalformedEntry(Exception):
    """A stream entry (or one op in it) that cannot be decoded; ``reason`` says why."""

    def __init__(
        self, reason: str, *, op_id: str | None = None, reply: str | None = None, raw: str = ""
    ) -> None:
        self.reason = reason
        self.op_id = op_id
        self.reply = reply
        self.raw = raw
        super().__init__(reason)


def encode_envelope(
    op_id: str,
    key: str | Sequence[str],
    call: Call[Any],
    reply: str | None,
    trace: Mapping[str, str] | None = None,
) -> str:
    """``key`` is one key, or the keys of a multi-key op; ``trace``, the W3C trace context of
    the submit (OpenTelemetry's ``traceparent`` and ``tracestate``).

    :raises TypeError, ValueError: when an argument is not JSON-serializable (the message names
        the op and the argument).
    """
    envelope: dict[str, Any] = {"id": op_id}
    if isinstance(key, str):
        envelope["key"] = key
    else:
        envelope["keys"] = list(key)
    envelope["op"] = call.name
    if call.args:
        envelope["args"] = list(call.args)
    if call.kwargs:
        envelope["kwargs"] = dict(call.kwargs)
    if reply is not None:
        envelope["reply"] = reply
    if trace:
        envelope["tc"] = dict(trace)
    try:
        return dumps(envelope)
    except (TypeError, ValueError) as exc:
        raise _not_json_argument(call, exc) from None


def reencoded(envelope: Envelope) -> str:
    """``envelope`` as JSON again, for an append elsewhere (an op forwarded by a sealed shard,
    see ``_wire.resharding``)."""
    encoded: dict[str, Any] = {"id": envelope.op_id}
    if envelope.multi:
        encoded["keys"] = list(envelope.keys)
    else:
        encoded["key"] = envelope.key
    encoded["op"] = envelope.name
    if envelope.args:
        encoded["args"] = envelope.args
    if envelope.kwargs:
        encoded["kwargs"] = envelope.kwargs
    if envelope.reply is not None:
        encoded["reply"] = envelope.reply
    if envelope.trace:
        encoded["tc"] = envelope.trace
    return dumps(encoded)


def with_reply(encoded: str, reply: str) -> str:
    """An encoded envelope with its replies on ``reply`` instead (after a reshard, the client
    listens where the op's new home publishes); one sent without a reply, an enqueue's, stays
    without."""
    envelope = parse(encoded)
    if "reply" in envelope:
        envelope["reply"] = reply
    return dumps(envelope)


def _not_json_argument(call: Call[Any], exc: TypeError | ValueError) -> TypeError | ValueError:
    """The encoding error, saying which argument of which op JSON cannot carry (a datetime, a
    set, NaN), and what it can."""
    named = [(f"argument {index}", value) for index, value in enumerate(call.args)]
    named += [(f"argument {name!r}", value) for name, value in call.kwargs.items()]
    where = "an argument"
    for label, value in named:
        try:
            dumps(value)
        except (TypeError, ValueError):
            where = f"{label} ({type(value).__name__} {_short(value)})"
            break
    message = (
        f"op {call.name!r}: {where} is not JSON ({exc}); op arguments must be JSON values:"
        " str, int, float (not NaN or infinity), bool, None, lists, and dicts with str keys"
    )
    return type(exc)(message)


def _short(value: Any) -> str:
    return _clipped(reprlib.repr(value))  # (bounded in depth and length: it may nest deeply)


def _clipped(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def pack_entry(envelopes: Sequence[str]) -> str:
    """The ``ops`` field of one stream entry: already-encoded envelopes joined as an array."""
    return "[" + ",".join(envelopes) + "]"


def decode_entry(fields: Mapping[bytes, bytes]) -> list[Envelope | MalformedEntry]:
    """Decode one stream entry. An op that cannot be decoded comes back as a
    :class:`MalformedEntry` in its place, so the rest of the entry still runs.

    :raises MalformedEntry: when the entry as a whole is unreadable.
    """
    version = fields.get(b"v")
    if version != WIRE_VERSION.encode():
        shown = "none" if version is None else repr(version.decode(errors="replace"))
        raise MalformedEntry(f"unsupported wire version {shown} (this worker reads '1')")
    raw = fields.get(b"ops")
    if raw is None:
        raise MalformedEntry("entry has no 'ops' field")
    try:
        ops = parse(raw.decode())  # (given bytes, json first sniffs their encoding)
    except ValueError as exc:  # UnicodeDecodeError included
        raise MalformedEntry(f"'ops' is not valid JSON: {exc}") from None
    except RecursionError:
        raise MalformedEntry("'ops' is nested too deeply to decode") from None
    if not isinstance(ops, list) or not ops:
        raise MalformedEntry("'ops' must be a non-empty JSON array of envelopes")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then is every envelope's text checked
        return [_decode_checked(item) for item in ops]
    return [_decode_envelope(item) for item in ops]


def decode_entry_leniently(fields: Mapping[bytes, bytes]) -> list[Envelope]:
    """The well-formed envelopes of an entry (none if the entry itself is malformed)."""
    try:
        items = decode_entry(fields)
    except MalformedEntry:
        return []
    return [item for item in items if isinstance(item, Envelope)]


def salvage_replies(fields: Mapping[bytes, bytes]) -> list[tuple[str, str | None]]:
    """``(op id, reply channel)`` of every envelope still readable in an unreadable entry, so
    their submitters hear why instead of waiting for a timeout."""
    try:
        ops = json.loads(fields.get(b"ops", b""))
    except (ValueError, RecursionError):
        return []
    if not isinstance(ops, list):
        return []
    found = []
    for item in ops:
        if isinstance(item, dict) and _is_text(item.get("id")) and item["id"]:
            reply = item.get("reply")
            found.append((item["id"], reply if _is_text(reply) else None))
    return found


def _is_text(value: Any) -> bool:
    """A string that can be written back to Redis (valid Unicode)."""
    return isinstance(value, str) and encodes(value)


def _decode_checked(item: Any) -> Envelope | MalformedEntry:
    """:func:`_decode_envelope` for an envelope that may hold a lone surrogate: such text can
    be neither stored nor replied, so the op is refused (anonymously if its id is the bad
    text)."""
    try:
        dumps(item)
    except ValueError:
        if not isinstance(item, dict) or not _is_text(item.get("id")) or not item["id"]:
            return MalformedEntry("op envelope holds text that is not valid Unicode")
        reply = item.get("reply")
        return MalformedEntry(
            "op envelope holds text that is not valid Unicode (a lone surrogate)",
            op_id=item["id"],
            reply=reply if _is_text(reply) else None,
        )
    return _decode_envelope(item)


def _decode_envelope(item: Any) -> Envelope | MalformedEntry:
    if not isinstance(item, dict):
        return MalformedEntry("op envelope is not a JSON object", raw=_raw_json(item))
    op_id, reply = item.get("id"), item.get("reply")
    if not isinstance(op_id, str) or not op_id:
        return MalformedEntry("op envelope has no string 'id'", raw=_raw_json(item))
    reply = reply if isinstance(reply, str) else None
    multi = "keys" in item
    keys: list[Any] = item["keys"] if multi else [item.get("key")]
    name = item.get("op")
    args, kwargs = item.get("args", []), item.get("kwargs", {})
    problem = None
    if multi and not _distinct_keys(keys):
        problem = "'keys' must be a non-empty array of distinct non-empty strings"
    elif not multi and (not isinstance(keys[0], str) or not keys[0]):
        problem = "'key' must be a non-empty string"
    elif not isinstance(name, str) or not name:
        problem = "'op' must be a non-empty string"
    elif not isinstance(args, list):
        problem = "'args' must be a JSON array"
    elif not isinstance(kwargs, dict):
        problem = "'kwargs' must be a JSON object"
    if problem is not None:
        return MalformedEntry(problem, op_id=op_id, reply=reply)
    assert isinstance(name, str)
    # (Every key is a string by now: checked above.)
    envelope = Envelope(op_id, tuple(keys), name, args, kwargs, reply, multi)
    if "tc" in item:
        envelope.trace = _trace_context(item["tc"])
    return envelope


def _trace_context(value: Any) -> dict[str, str] | None:
    """A trace context as sent (an object of strings, at most a few short headers), else None:
    a bad one is dropped, never a reason to refuse the op."""
    if not isinstance(value, dict) or len(value) > 4:
        return None
    for header, text in value.items():
        if not isinstance(header, str) or not isinstance(text, str) or len(text) > 512:
            return None
    return value


def dead_letter_envelopes(raw: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The op envelopes in a dead letter's ``raw`` that can be appended again, and why each
    other element cannot. ``raw`` is a poison op's envelope (re-encoded by the server's Lua
    ``cjson``, which writes an empty array as ``{}``), an unreadable entry's fields
    (``{"v": ..., "ops": "<text>"}``), or an element of an entry that is no envelope."""
    try:
        value = json.loads(raw)
    except ValueError:
        return [], ["raw is not JSON"]
    items: list[Any] = [value]
    if isinstance(value, dict) and "id" not in value and isinstance(value.get("ops"), str):
        try:
            ops = json.loads(value["ops"])  # an unreadable entry's fields
        except ValueError:
            return [], ["the entry's ops are not JSON"]
        items = ops if isinstance(ops, list) else [ops]
    found, skipped = [], []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            skipped.append(f"no op id: {_clipped(json.dumps(item))}")
        elif item.get("args") == {}:  # cjson writes an empty Lua table as an object
            found.append({**item, "args": []})
        else:
            found.append(item)
    return found, skipped


def keys_named(item: Any) -> list[str] | None:
    """The keys a parsed envelope names, by the decoder's rule (``keys`` if it has them, else
    ``[key]``), or None unless each is a non-empty string: for the tools that route an
    envelope they do not run (dead letters, timers, the mover)."""
    if not isinstance(item, dict):
        return None
    keys = item["keys"] if "keys" in item else [item.get("key")]
    if not isinstance(keys, list) or not keys:
        return None
    return keys if all(isinstance(key, str) and key for key in keys) else None


def _distinct_keys(keys: Any) -> bool:
    # (A list, not a generator: one call fewer per key on every multi-key op's path.)
    return (
        isinstance(keys, list)
        and bool(keys)
        and all([isinstance(key, str) and key for key in keys])
        and len(set(keys)) == len(keys)
    )


def _raw_json(item: Any) -> str:
    try:
        return dumps(item)
    except (TypeError, ValueError):
        return repr(item)


#: The op ids a keyserial client generates: its client id (32 hex digits, after a service
#: name and a dot), a dash, a counter and 64 random bits, in hex.
_GENERATED_ID = re.compile(r"(?:[A-Za-z0-9_-]{1,64}\.)?[0-9a-f]{32}-[0-9a-f]{17,}")


def binding(envelope: Envelope) -> str:
    """What an op id is bound to: a digest of the op's name, keys and arguments, as read
    (arguments encoded otherwise, such as object members in another order, make another op);
    '' for an id in the form keyserial's clients generate, which no one can guess and a client
    never gives another op (binding every op cost the hot workload a tenth of its throughput).
    An outcome is stored with its binding, and the same op id appended with another op is
    refused, never answered with that outcome (an id reused by mistake, or taken ahead)."""
    if _GENERATED_ID.fullmatch(envelope.op_id):
        return ""
    # (repr: the cheapest stable text of JSON values, about half a JSON encoding's cost.)
    try:
        what = repr((envelope.name, envelope.keys, envelope.args, envelope.kwargs))
    except RecursionError:  # (nested nearly too deeply to read: the op fails anyway)
        what = repr((envelope.name, envelope.keys))
    return hashlib.blake2b(what.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def call_binding(op_id: str, key: str | Sequence[str], call: Call[Any]) -> str:
    """:func:`binding` of ``call`` submitted under ``op_id`` on ``key`` (one key, or a multi-key
    op's keys), read as a worker would read its envelope.

    :raises TypeError, ValueError: when an argument is not JSON-serializable.
    """
    return envelope_binding(encode_envelope(op_id, key, call, None))


def bound(outcome: str, to: str) -> str:
    """An encoded outcome (a JSON object) with the binding ``to`` as its member ``b`` (as it
    is, for no binding)."""
    return outcome[:-1] + ',"b":"' + to + '"}' if to else outcome


def envelope_binding(encoded: str) -> str:
    """:func:`binding` of an encoded envelope (as a client sent it): what a stored outcome
    must carry to be this op's."""
    envelope = _decode_envelope(parse(encoded))
    return "" if isinstance(envelope, MalformedEntry) else binding(envelope)


def taken_outcome(op_id: str) -> str:
    """The refusal of an op appended under an op id that another op (another key, op or
    arguments) holds: never answered with that op's outcome, nor run. Not stored."""
    return encode_error(
        MalformedOperation.wire_type,
        f"op id {op_id!r} belongs to another op (another key, op or arguments); an op id names"
        " one op: submit this one under a new op id",
    )


def answered_record(outcome: str, entry_ids: Sequence[str]) -> str:
    """The record of an op answered but not stored (``<op id>#u``): its outcome, with the
    entries it answered as the member ``e``. A caller takes it only for the entry it appended:
    a resubmit of the same op id is a new entry, and must wait for its own outcome."""
    return outcome[:-1] + ',"e":' + dumps(list(entry_ids)) + "}"


def binding_of(outcome: str) -> str | None:
    """The binding a stored outcome carries, or None (one stored without: a dead letter's)."""
    try:
        found = parse(outcome).get("b")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def encode_ok(value: Any) -> str:
    """:raises TypeError, ValueError: when the op returned something JSON cannot carry."""
    return '{"ok":' + dumps(value) + "}"


def encode_error(
    error_type: str,
    message: str,
    data: Mapping[str, Any] | None = None,
    traceback: str | None = None,
) -> str:
    """An error outcome. It always encodes: data JSON cannot carry is dropped, and text that
    is not valid Unicode is escaped. ``traceback``: where the op raised, as the worker saw it."""
    error: dict[str, Any] = {"type": error_type, "message": message}
    if data:
        error["data"] = dict(data)
    if traceback:
        error["traceback"] = traceback
    try:
        return dumps({"error": error})
    except (TypeError, ValueError):
        error = {"type": _printable(error_type), "message": _printable(message)}
        if traceback:
            error["traceback"] = _printable(traceback)
        return dumps({"error": error})


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def decode_outcome(raw: str | bytes) -> dict[str, Any]:
    """An outcome as a dict with exactly one of ``ok`` / ``error``."""
    outcome = parse(raw)
    if not isinstance(outcome, dict) or not ("ok" in outcome or "error" in outcome):
        raise ValueError(f"not a keyserial outcome: {raw!r}")
    return outcome


def error_type(outcome: str) -> str | None:
    """The error type of an error outcome (``?`` if it names none); None for a value."""
    if outcome.startswith('{"ok"'):  # what the worker itself writes for a value
        return None
    try:
        decoded = parse(outcome)  # (rare: errors, and outcomes a Lua script wrote)
    except ValueError:
        return "?"
    if not isinstance(decoded, dict) or "ok" in decoded:
        return None
    error = decoded.get("error")
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else "?"


def reply_outcome(outcome: str, shard: ShardKeys, entry_ids: Sequence[str]) -> str:
    """An outcome as a reply carries it: with the op's shard (``s``), that shard's layout
    generation (``g``) and the stream entries it answers (``e``; none for an op of an entry
    that could not be read), so that a client takes a signed reply's outcome only for the very
    op it appended (see ``_wire.signing``). Entry ids name an entry of one stream only, and
    shard numbers repeat in every generation: without ``g``, a client user could have an old
    shard answer, under a new shard's entry id, an op waiting in the new layout."""
    entries = '["' + '","'.join(entry_ids) + '"]' if entry_ids else "[]"
    return f'{outcome[:-1]},"s":{shard.shard},"g":{shard.generation},"e":{entries}}}'


def encode_reply(outcomes: Iterable[tuple[str, str]]) -> str:
    """A reply message from ``(op_id, encoded outcome)`` pairs, without re-encoding outcomes.
    (A list, not a generator, for ``join``: a generator is resumed once per outcome.)"""
    body = ",".join(["[" + dumps(op_id) + "," + outcome + "]" for op_id, outcome in outcomes])
    return '{"v":1,"r":[' + body + "]}"


def decode_reply(raw: str | bytes) -> list[tuple[str, dict[str, Any]]]:
    """A reply message's ``(op id, outcome)`` pairs, each outcome as :func:`decode_outcome`
    would give it (with an ``error`` that is an object).

    :raises ValueError, KeyError, TypeError: for a message that is not a reply.
    """
    message = parse(raw)
    replies = [(op_id, outcome) for op_id, outcome in message["r"]]
    for op_id, outcome in replies:
        if not (
            isinstance(op_id, str)
            and isinstance(outcome, dict)
            and ("ok" in outcome or isinstance(outcome.get("error"), dict))
        ):
            raise ValueError(f"not a reply: {raw!r}")
    return replies


def replied_op_ids(raw: str | bytes) -> list[tuple[str, bool]]:
    """The op ids a reply message names, each with whether it says UnknownOperation (a
    refusal recorded apart, see ``answered_record``). The outcomes themselves are a hint: a
    client reads them from the records.

    :raises ValueError, KeyError, TypeError: for a message that is not a reply.
    """
    message = parse(raw)
    return [
        (op_id, says_unknown(outcome)) for op_id, outcome in message["r"] if isinstance(op_id, str)
    ]


def says_unknown(outcome: Any) -> bool:
    """Whether ``outcome`` is the refusal of an op no worker knows (recorded apart)."""
    error = outcome.get("error") if isinstance(outcome, dict) else None
    return isinstance(error, dict) and error.get("type") == UnknownOperation.wire_type


#: The op name of a grant request; served by every worker, never by an app.
GRANT_OP = "keyserial.grant"


_PUSH = re.compile(rb"push (\d+) ")


@dataclass(frozen=True, slots=True)
class Push:
    """A fresh entry handed to the owner with its wake-up (see ``submit.lua``): the owner may
    take it in without fetching it, but only where it is the next item of the shard's inbox."""

    #: Its place: its number in the order of the inbox's pushes, from 1.
    place: int
    #: The inbox item as pushed, which the owner's step confirms byte for byte.
    item: bytes
    #: The stream entry's fields it becomes (without its place, ``p``).
    fields: Mapping[bytes, bytes]


def parse_push(message: bytes) -> Push | None:
    """The entry a wake-up message pushes, or None: a plain wake-up (a place, or anything
    that is not a well-formed push)."""
    head = _PUSH.match(message)
    if head is None:
        return None
    item = message[head.end() :]
    fields = item_fields(item)
    if fields is None:
        return None
    return Push(int(head.group(1)), item, fields)


def item_fields(item: bytes) -> dict[bytes, bytes] | None:
    """The stream entry's fields an inbox item becomes when its owner moves it in (see
    ``lib.lua``'s ``inbox_entry``, which this follows rule for rule): ``<version>\\n<ops>`` or
    ``<version> fresh\\n<ops>``; None for an item of another form (it becomes an entry of its
    raw text, which its owner dead-letters)."""
    header, newline, ops = item.partition(b"\n")
    version, space, flags = header.partition(b" ")
    if not newline or not version or (space and flags != b"fresh"):
        return None
    if space:
        return {b"v": version, b"ops": ops, b"fresh": b"1"}
    return {b"v": version, b"ops": ops}


def inbox_item(ops: str, *, fresh: bool) -> str:
    """The inbox item of an entry of packed ``ops`` (``submit.lua`` makes it so)."""
    return f"{WIRE_VERSION}{' fresh' if fresh else ''}\n{ops}"
