"""The worker's intake of a fired timer's entry: an op id with '#' runs only as a timer's op
(``<op id>#t<n>``), and only from an entry its timer fired (marked ``timer`` by the step that
fired it, which no client can make: a client never writes the stream)."""

from __future__ import annotations

import json

import pytest

from keyserial._ops import is_timer_id
from keyserial._worker.intake import accept
from tests.entries import envelope


def _accepted(op_id: str, *, marked: bool) -> bool:
    fields = {b"v": b"1", b"ops": json.dumps([envelope(op_id, "k", "deposit", 1)]).encode()}
    if marked:
        fields[b"timer"] = b"1"
    taken = accept("1-1", fields, place="x", shard=0, shard_count=1, done={}, running={})
    return bool(taken.runs)


@pytest.mark.parametrize("op_id", ["a#t1", "a#t12", "a#t1#t3"])
def test_a_timer_s_op_runs_from_the_entry_its_timer_fired(op_id: str) -> None:
    assert _accepted(op_id, marked=True)


@pytest.mark.parametrize("op_id", ["a#t1", "a#t1#t3"])
def test_a_timer_s_op_id_in_an_entry_no_timer_fired_is_refused(op_id: str) -> None:
    assert not _accepted(op_id, marked=False)


@pytest.mark.parametrize("op_id", ["a#u", "a#1.3", "a#1#d", "a#t0", "a#t", "#t1", "a#t1#u"])
def test_a_fired_entry_runs_no_other_op_id_with_a_hash(op_id: str) -> None:
    assert not is_timer_id(op_id)
    assert not _accepted(op_id, marked=True)
