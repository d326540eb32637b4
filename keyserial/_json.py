"""The one JSON encoding keyserial writes: compact, UTF-8, and no NaN/Infinity (which other
languages cannot read back)."""

from __future__ import annotations

import json
from typing import Any

_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode


def dumps(value: Any) -> str:
    """:raises TypeError, ValueError: for values JSON cannot carry."""
    return _encode(value)
