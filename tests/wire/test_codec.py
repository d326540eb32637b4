import json
import re
import uuid
from typing import Any

import pytest

from keyserial import call
from keyserial._client.asyncio_client import _OpIds
from keyserial._wire import json_text
from keyserial._wire.codec import (
    Envelope,
    MalformedEntry,
    binding,
    bound,
    decode_entry,
    decode_outcome,
    decode_reply,
    encode_envelope,
    encode_error,
    encode_ok,
    encode_reply,
    keys_named,
    pack_entry,
    salvage_replies,
    with_reply,
)
from keyserial._wire.json_text import dumps, loads, parse


def test_an_entry_round_trips_its_envelopes() -> None:
    first = encode_envelope("id1", "account:5", call("deposit", 100), "reply-chan")
    second = encode_envelope("id2", "account:6", call("move", 1, to="x"), None)
    decoded = decode_entry({b"v": b"1", b"ops": pack_entry([first, second]).encode()})
    assert decoded == [
        Envelope("id1", ("account:5",), "deposit", [100], {}, "reply-chan"),
        Envelope("id2", ("account:6",), "move", [1], {"to": "x"}, None),
    ]


def test_envelopes_are_plain_json_for_other_languages() -> None:
    raw = encode_envelope("id1", "k", call("deposit", 5), "c")
    assert json.loads(raw) == {"id": "id1", "key": "k", "op": "deposit", "args": [5], "reply": "c"}


def test_an_envelope_moved_to_another_reply_channel_keeps_the_rest() -> None:
    waited = encode_envelope("id1", ["a", "b"], call("move", 1, to="x"), "old", {"tp": "t"})
    enqueued = encode_envelope("id2", "k", call("deposit", 5), None)
    assert json.loads(with_reply(waited, "new")) == {**json.loads(waited), "reply": "new"}
    assert with_reply(enqueued, "new") == enqueued


def test_arguments_json_cannot_carry_are_refused_before_sending() -> None:
    with pytest.raises(TypeError):
        encode_envelope("id", "k", call("deposit", object()), None)
    with pytest.raises(ValueError):
        encode_envelope("id", "k", call("deposit", float("nan")), None)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"ops": b"[]"}, "wire version"),
        ({b"v": b"2", b"ops": b"[]"}, "wire version"),
        ({b"v": b"1"}, "no 'ops'"),
        ({b"v": b"1", b"ops": b"{nope"}, "not valid JSON"),
        ({b"v": b"1", b"ops": b"[]"}, "non-empty JSON array"),
    ],
)
def test_unreadable_entries_say_why(fields: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(MalformedEntry, match=reason):
        decode_entry(fields)


def test_one_bad_envelope_does_not_spoil_its_entry() -> None:
    good = encode_envelope("ok", "k", call("deposit", 1), None)
    decoded = decode_entry({b"v": b"1", b"ops": f'[{good},{{"id":"bad","key":5}}, 7]'.encode()})
    assert isinstance(decoded[0], Envelope)
    assert isinstance(decoded[1], MalformedEntry) and decoded[1].op_id == "bad"
    assert isinstance(decoded[2], MalformedEntry) and decoded[2].op_id is None


def test_replies_carry_outcomes_verbatim() -> None:
    message = encode_reply([("a", encode_ok({"x": 1})), ("b", encode_error("ValueError", "no"))])
    assert decode_reply(message) == [
        ("a", {"ok": {"x": 1}}),
        ("b", {"error": {"type": "ValueError", "message": "no"}}),
    ]


@pytest.mark.parametrize(
    "pairs",
    [
        [["a", 5]],
        [["a", {"error": 5}]],
        [["a", {"neither": 1}]],
        [[5, {"ok": 1}]],
        [["a"]],
        7,
    ],
)
def test_a_reply_whose_outcomes_are_not_outcomes_is_refused_whole(pairs: object) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode_reply(json.dumps({"v": 1, "r": pairs}))


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False)


@pytest.mark.parametrize(
    "value",
    [
        0,
        -5,
        10**30,
        True,
        None,
        1.5,
        "",
        "plain",
        'a"b\\c\n\t\x00\x1f\x7f',
        "\u2028é😀",
        [1, "x"],
        {"k": [None]},
        {"s": [["acct:1", "12"]], "r": [], "d": [], "x": {"n": -1.5e300, "t": True}},
        [["é\u2028", {"1": 2, "k": [0.1, 10**30, [], {}]}]],
    ],
)
def test_dumps_shortcuts_write_exactly_what_the_encoder_writes(value: object) -> None:
    """Ints and strings skip the encoder (a busy worker's most common values), and containers
    go to an encoder made once: same text as the stdlib's encoder writes."""
    assert dumps(value) == _ENCODER.encode(value)


def test_without_a_c_encoder_dumps_uses_the_stdlib_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    encode = json_text._made_encoder()
    assert encode == json_text._ENCODER.encode
    assert encode({"k": [1, "é"]}) == '{"k":[1,"é"]}'


def test_dumps_still_refuses_what_json_cannot_carry() -> None:
    for value in (float("nan"), float("inf"), {1, 2}):
        with pytest.raises((TypeError, ValueError)):
            dumps(value)


def _nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def _circular() -> dict[str, object]:
    value: dict[str, object] = {}
    value["self"] = [value]
    return value


@pytest.mark.parametrize("value", ["\ud83d", ["ok", {"k": "x\udc00"}], _nested(5000), _circular()])
def test_dumps_refuses_what_redis_or_a_reader_could_not_take_back(value: object) -> None:
    """A lone surrogate cannot be sent as UTF-8, and a value nested thousands deep (or one that
    contains itself) cannot be read back: all are ValueError, like NaN, never an error on the
    wire."""
    with pytest.raises(ValueError):
        dumps(value)


def test_an_envelope_with_a_lone_surrogate_is_refused_alone() -> None:
    ops = (
        '[{"id":"a","key":"k","op":"append","args":["\\ud83d"]},'
        '{"id":"\\ud83d","key":"k","op":"append"},{"id":"b","key":"k","op":"append",'
        '"args":["\\ud83d\\ude00"]}]'
    )
    first, anonymous, fine = decode_entry({b"v": b"1", b"ops": ops.encode()})
    assert isinstance(first, MalformedEntry) and first.op_id == "a"
    assert "not valid Unicode" in first.reason
    assert isinstance(anonymous, MalformedEntry) and anonymous.op_id is None
    assert isinstance(fine, Envelope) and fine.args == ["😀"]


def test_an_entry_nested_too_deeply_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedEntry, match="nested too deeply"):
        decode_entry({b"v": b"1", b"ops": b"[" * 3000 + b"]" * 3000})
    assert salvage_replies({b"v": b"1", b"ops": b"[" * 3000}) == []


def test_an_error_outcome_always_encodes() -> None:
    outcome = decode_outcome(encode_error("ValueError", "bad \ud83d", {"x": {1}}))
    assert outcome == {"error": {"type": "ValueError", "message": "bad \\ud83d"}}


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "-0",
        "7",
        "-12",
        "123456789012345678901234567890",
        "01",
        "-01",
        "",
        "-",
        "1.5",
        "1e3",
        " 1",
        "1 ",
        "\u0661",
        "²",
        "true",
        "null",
        "[1]",
        '"x"',
        "-1.0",
    ],
)
def test_loads_shortcut_for_ints_reads_exactly_what_json_reads(text: str) -> None:
    """Canonical ints are parsed directly; anything else (or not JSON at all) is json's."""
    try:
        expected: object = ("ok", json.loads(text), type(json.loads(text)))
    except ValueError:
        expected = "refused"
    try:
        got: object = ("ok", loads(text), type(loads(text)))
    except ValueError:
        got = "refused"
    assert got == expected


def test_an_op_id_is_bound_to_its_op_unless_a_client_generated_it() -> None:
    """A chosen id is bound to the op's name, keys and arguments (16 hex digits); an id in the
    form keyserial's clients generate is not: no one can guess one (and binding every op cost a
    hot key a tenth of its throughput)."""

    def envelope(op_id: str, *args: object) -> Envelope:
        return Envelope(op_id, ("account:5",), "deposit", list(args), {}, None)

    bound_ids = ("order-7", "c" * 32 + "-" + "f" * 16, uuid.uuid4().hex)
    for op_id in bound_ids:
        assert re.fullmatch(r"[0-9a-f]{16}", binding(envelope(op_id, 10)))
        assert binding(envelope(op_id, 10)) != binding(envelope(op_id, 11))
    for service in ("", "billing."):
        generated = next(_OpIds(service + uuid.uuid4().hex))
        assert binding(envelope(generated, 10)) == ""
    assert bound('{"ok":1}', "") == '{"ok":1}'
    assert bound('{"ok":1}', "0123456789abcdef") == '{"ok":1,"b":"0123456789abcdef"}'


@pytest.mark.parametrize(
    "text",
    [
        '{"v":1,"r":[["id",{"ok":5}]]}',
        '[{"id":"a","key":"k","op":"x","args":[1.5,null,true]}]',
        '"\\ud83d"',
        "NaN",
        "123456789012345678901234567890",
        ' {"a":1}',
        '{"a":1} ',
        "\ufeff[1]",
        "[1]]",
        "[1] x",
        "",
        "[",
        '{"a":1,}',
        "[" * 3000 + "]" * 3000,
        b'{"ok":"\xc3\xa9"}',
        b'"\xed\xa0\xbd"',
        b"\xff",
        b"\xef\xbb\xbf[1]",
        '[1, "x"]'.encode("utf-16"),
        b"[1] ",
    ],
)
def test_parse_reads_exactly_what_json_loads_reads(text: str | bytes) -> None:
    """The scanner called directly: the same value, or the same error, as ``json.loads``."""

    def outcome(read: object) -> object:
        try:
            value = read(text)  # type: ignore[operator]
        except RecursionError:
            return "too deep"
        except ValueError as exc:
            return ("refused", type(exc), str(exc))
        return ("ok", value, type(value))

    assert outcome(parse) == outcome(json.loads)


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({"id": "1", "key": "a"}, ["a"]),
        ({"id": "1", "keys": ["a", "b"]}, ["a", "b"]),
        ({"id": "1", "keys": ["a", "b"], "key": "c"}, ["a", "b"]),
        ({"id": "1", "keys": "a", "key": "a"}, None),
        ({"id": "1", "keys": []}, None),
        ({"id": "1", "keys": ["a", 1]}, None),
        ({"id": "1", "keys": ["a", ""]}, None),
        ({"id": "1", "key": ""}, None),
        ({"id": "1"}, None),
        (["a"], None),
    ],
)
def test_the_keys_an_envelope_names_follow_the_decoder_s_rule(item: Any, named: Any) -> None:
    assert keys_named(item) == named
    op = {"op": "o", **item} if isinstance(item, dict) else item
    (decoded,) = decode_entry({b"v": b"1", b"ops": dumps([op]).encode()})
    if named is None:
        assert isinstance(decoded, MalformedEntry)
    else:
        assert isinstance(decoded, Envelope) and list(decoded.keys) == named
