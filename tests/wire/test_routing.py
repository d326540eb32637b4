import zlib

import pytest

from keyserial import ConfigError, shard_for
from keyserial._wire.layout import Layout
from keyserial._wire.routing import parse_shards, scale_shards


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


def test_a_layout_generation_names_shards_apart_and_generation_0_keeps_the_first_names() -> None:
    """Generation 0 is every namespace's first layout and keeps its names; a later one (after
    a reshard) names its shards ``<shard>@<generation>``, in keys, hash tags and channels, so
    two generations' streams, states and results never mix, and each shard keeps one slot."""
    first, second = Layout("ns", 4), Layout("ns", 16, generation=1)
    assert first.keys(3).stream == "ks:{ns:3}:stream"
    assert first.keys(3).wake_channel == "ks:ns:wake:3"
    assert second.keys(3).stream == "ks:{ns:3@1}:stream"
    assert second.keys(3).wake_channel == "ks:ns:wake:3@1"
    assert second.keys(3).wake(True) == "ks:{ns:3@1}:wake:3@1"
    assert second.keys(3).in_shard("ks:ns:reply:c1") == "ks:{ns:3@1}:reply:c1"
    assert first.keys(3) != second.keys(3)
    assert [keys.shard for keys in second.all_keys()] == list(range(16))


@pytest.mark.parametrize(("of", "to"), [(4, 16), (16, 4), (16, 24), (64, 8), (8, 8)])
def test_a_shard_list_covers_the_same_fraction_of_a_new_shard_count(of: int, to: int) -> None:
    """Ranges that cover every old shard cover every new one, each once: ``0-1`` of 4 is
    ``0-7`` of 16."""
    halves = [list(range(of // 2)), list(range(of // 2, of))]
    scaled = [scale_shards(half, of, to) for half in halves]
    assert sorted(scaled[0] + scaled[1]) == list(range(to))
    assert scale_shards([0, 1], 4, 16) == list(range(8))
