"""Which pushed entries a runner takes in, and when its next step fetches (pure code: the
protocol's Redis side is in tests/client/test_push.py)."""

from __future__ import annotations

import json

from keyserial._wire.codec import Push
from keyserial._worker.keystates import KeyStates
from keyserial._worker.wakeups import MAX_WAITING, Wakeups
from tests.entries import envelope


def pushed(after: str, entry_id: str, key: str = "k") -> Push:
    ops = json.dumps([envelope(f"op-{entry_id}", key, "deposit", 1)]).encode()
    return Push(after, entry_id, {b"v": b"1", b"ops": ops, b"fresh": b"1"})


def holding_every_state() -> KeyStates:
    states = KeyStates(request_step=lambda: None)
    states.load_all({})
    return states


def recorded() -> Wakeups:
    wakeups = Wakeups()
    wakeups.stepped(fetch=0, fetched=0, recorded=True)
    wakeups.must_fetch = False
    return wakeups


def taken(wakeups: Wakeups, cursor: str, states: KeyStates | None = None) -> list[str]:
    reply = wakeups.take(cursor, states or holding_every_state())
    return [] if reply is None else [entry_id for entry_id, _ in reply.entries]


def test_nothing_is_taken_before_a_step_recorded_that_pushes_are() -> None:
    wakeups = Wakeups()
    wakeups.push(pushed("1-0", "2-0"))
    assert taken(wakeups, "1-0") == []
    wakeups.stepped(fetch=0, fetched=0, recorded=True)
    assert taken(wakeups, "1-0") == ["2-0"]


def test_a_chain_of_pushes_is_taken_in_order_and_the_next_step_fetches_nothing() -> None:
    wakeups = recorded()
    for after, entry_id in (("1-0", "2-0"), ("2-0", "3-0"), ("3-0", "3-1")):
        wakeups.push(pushed(after, entry_id))
    assert taken(wakeups, "1-0") == ["2-0", "3-0", "3-1"]
    assert wakeups.pushed_to == "3-1"  # (the next step raises the horizon to it)
    assert wakeups.fetch_size(64, replaying=False) == 0
    wakeups.stepped(fetch=0, fetched=0, recorded=False)
    assert wakeups.pushed_to == ""


def test_a_push_into_an_empty_stream_is_taken_wherever_the_cursor_is_behind_it() -> None:
    wakeups = recorded()
    wakeups.push(pushed("-", "9-0"))
    assert taken(wakeups, "5-0") == ["9-0"]


def test_entries_already_fetched_are_skipped() -> None:
    wakeups = recorded()
    wakeups.push(pushed("1-0", "2-0"))
    wakeups.push(pushed("2-0", "3-0"))
    assert taken(wakeups, "2-0") == ["3-0"]
    assert wakeups.fetch_size(64, replaying=False) == 0


def test_a_push_that_does_not_follow_on_is_left_to_a_fetch() -> None:
    """An entry lies between the cursor and the push (appended with a plain XADD, or its own
    push was lost): the push is not taken, and the next step fetches."""
    wakeups = recorded()
    wakeups.push(pushed("2-0", "3-0"))
    assert taken(wakeups, "1-0") == []
    assert wakeups.fetch_size(64, replaying=False) == 64


def test_a_push_whose_keys_are_not_cached_ends_the_chain() -> None:
    wakeups = recorded()
    wakeups.push(pushed("1-0", "2-0", key="cached"))
    wakeups.push(pushed("2-0", "3-0", key="unknown"))
    wakeups.push(pushed("3-0", "4-0", key="cached"))
    states = KeyStates(request_step=lambda: None)
    states.load("cached", "1")
    assert taken(wakeups, "1-0", states) == ["2-0"]
    assert wakeups.fetch_size(64, replaying=False) == 64


def test_too_many_pushes_waiting_are_dropped_for_a_fetch() -> None:
    wakeups = recorded()
    for seq in range(MAX_WAITING + 1):
        wakeups.push(pushed(f"1-{seq}", f"1-{seq + 1}"))
    assert wakeups.fetch_size(64, replaying=False) == 64
    assert taken(wakeups, "1-0") == []  # (its one push does not follow on from 1-0)


def test_a_step_that_got_all_it_asked_for_fetches_again() -> None:
    wakeups = recorded()
    wakeups.must_fetch = True
    fetch = wakeups.fetch_size(64, replaying=False)
    wakeups.sending(fetch)
    assert wakeups.fetch_size(64, replaying=False) == 0
    wakeups.stepped(fetch, fetched=64, recorded=False)
    assert wakeups.fetch_size(64, replaying=False) == 64
    wakeups.sending(64)
    wakeups.stepped(64, fetched=3, recorded=False)
    assert wakeups.fetch_size(64, replaying=False) == 0
    assert wakeups.fetch_size(64, replaying=True) == 64


def test_the_next_step_confirms_every_entry_taken_from_pushes_since_the_last() -> None:
    wakeups = recorded()
    wakeups.push(pushed("1-0", "2-0"))
    wakeups.push(pushed("2-0", "3-0"))
    assert taken(wakeups, "1-0") == ["2-0", "3-0"]
    after, values = wakeups.to_confirm()
    assert after == "1-0"
    assert values[:8] == ["2-0", "6", b"v", b"1", b"ops", values[5], b"fresh", b"1"]
    assert values[8:10] == ["3-0", "6"] and len(values) == 16
    assert (
        json.loads(values[5])[0]["id"] == "op-2-0" and json.loads(values[13])[0]["id"] == "op-3-0"
    )
    wakeups.stepped(fetch=0, fetched=0, recorded=False)
    assert wakeups.to_confirm() == ("", [])


def test_an_op_that_wrote_nothing_keeps_its_keys_uncommitted_until_a_step_took_it() -> None:
    """A grant of a key waits for the outcome of the op before it, not only for its writes."""
    states = holding_every_state()
    states.answered(["k"])
    assert not states.all_committed(["k"]) and states.all_committed(["other"])
    number, writes = states.start_step()
    assert writes == [] and not states.all_committed(["k"])
    states.step_done(number)
    assert states.all_committed(["k"])
