import zlib

import pytest

from keyserial import ConfigError, shard_for
from keyserial._wire.routing import parse_shards


def test_shard_is_crc32_of_utf8_key_modulo_count() -> None:
    assert shard_for("account:5", 16) == zlib.crc32(b"account:5") % 16
    assert shard_for("ключ", 7) == zlib.crc32("ключ".encode()) % 7


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0-15", list(range(16))),
        ("0,3,7", [0, 3, 7]),
        ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
        (" 5 ", [5]),
        ("3,1-2,3", [1, 2, 3]),
    ],
)
def test_shard_lists_accept_ranges_and_items(spec: str, expected: list[int]) -> None:
    assert parse_shards(spec, 16) == expected


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("0-16", "shard 16 does not exist"),
        ("5-3", "reversed"),
        ("a", "not a number"),
        ("1,,2", "not a number"),
        ("-1", "not a number"),
    ],
)
def test_bad_shard_lists_are_refused_with_the_reason(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_shards(spec, 16)
