"""The one JSON encoding keyserial writes: compact, UTF-8, and no NaN/Infinity (which other
languages cannot read back).

Whatever it returns can be sent to Redis and read back by any JSON reader: text that is not
valid Unicode (a lone surrogate, which a JavaScript string cut inside an emoji carries) and
values nested too deeply to read back are refused with ``ValueError``, like any other value
JSON cannot carry. A worker that wrote such text would fail on the wire instead, with every
op of its batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_ENCODER = json.JSONEncoder(
    separators=(",", ":"), allow_nan=False, ensure_ascii=False, check_circular=False
)
#: What that encoder does with a str (the C function, where CPython has it).
_encode_str = json.encoder.encode_basestring


def _made_encoder() -> Callable[[Any], str]:
    """``_ENCODER.encode``, less what it does at every call: it builds its C encoder anew
    (about half of what a small object costs to encode), which keeps no state between calls, so
    one is made here, once. It checks for no circular value (that check's table of the
    containers being encoded is state, and costs a third of the rest): a value that contains
    itself recurses to Python's depth limit, and is refused as nested too deeply. Where the
    interpreter has no C encoder, ``_ENCODER.encode`` itself."""
    make: Callable[..., Callable[[Any, int], list[str]]] | None
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _ENCODER.encode
    iterencode = make(None, _ENCODER.default, _encode_str, None, ":", ",", False, False, False)

    def encode(value: Any) -> str:
        return "".join(iterencode(value, 0))

    return encode


_encode = _made_encoder()


def dumps(value: Any) -> str:
    """:raises TypeError, ValueError: for values JSON cannot carry."""
    # Ints and strings (balances, counters, op ids) are most of what a busy worker encodes: they
    # skip the encoder's machinery and come out exactly as it would write them.
    kind = type(value)
    if kind is int:
        return int.__repr__(value)
    if kind is str:
        text: str = _encode_str(value)
    else:
        try:
            text = _encode(value)
        except RecursionError:
            raise ValueError(
                "the value is nested too deeply (or contains itself) to encode"
            ) from None
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text that is not valid Unicode (a lone surrogate at {exc.start}) cannot be"
                " stored or sent"
            ) from None
    return text


def encodes(text: str) -> bool:
    """Whether ``text`` can be sent: valid Unicode (no unpaired surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def loads(text: str) -> Any:
    """``json.loads``. A canonical int (all that :func:`dumps` writes for one: a balance, a
    counter) is parsed directly, the same value the decoder would give; other text as
    :func:`parse` does.

    :raises ValueError: if ``text`` is not JSON.
    """
    digits = text[1:] if text[:1] == "-" else text
    if digits.isdigit() and digits.isascii() and (digits[0] != "0" or digits == "0"):
        return int(text)
    return parse(text)


#: The stdlib decoder's scanner (its C one, where CPython has it): what ``json.loads`` runs.
#: (Read with getattr: typeshed does not declare it.)
_scan: Callable[[str, int], tuple[Any, int]] = getattr(json.JSONDecoder(), "scan_once")  # noqa: B009


def parse(text: str | bytes) -> Any:
    """``json.loads(text)``: the same value, or the same error. For a JSON text with no
    whitespace around it (all that keyserial writes), it calls the decoder's scanner directly,
    at about half of what ``json.loads`` costs for a small text (that call's checks and two
    whitespace matches); anything else (whitespace, bytes that are not UTF-8, text that is not
    JSON) is ``json.loads``'s, as it was.

    :raises ValueError: if ``text`` is not JSON (``RecursionError``: nested too deeply).
    """
    try:
        decoded = text if isinstance(text, str) else text.decode()
        value, end = _scan(decoded, 0)
    except (StopIteration, ValueError, RecursionError):  # (UnicodeDecodeError too)
        return json.loads(text)
    if end != len(decoded):
        return json.loads(text)
    return value
