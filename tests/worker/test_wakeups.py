"""Which pushed entries a runner takes in, and when its next step fetches (pure code: the
protocol's Redis side is in tests/client/test_push.py)."""

from __future__ import annotations

import json

from keyserial._wire.codec import Push, parse_push
from keyserial._worker.keystates import KeyStates
from keyserial._worker.wakeups import MAX_WAITING, Wakeups
from tests.entries import envelope


def pushed(place: int, key: str = "k") -> Push:
    """The push ``submit.lua`` publishes for a fresh entry at ``place`` in the inbox."""
    ops = json.dumps([envelope(f"op-{place}", key, "deposit", 1)])
    found = parse_push(f"push {place} 1 fresh\n{ops}".encode())
    assert found is not None
    return found


def holding_every_state() -> KeyStates:
    states = KeyStates(request_step=lambda: None)
    states.load_all({})
    return states


def recorded(taken: int = 0) -> Wakeups:
    """Wakeups after a step that recorded that pushes are taken, ``taken`` items having been
    moved out of the inbox."""
    wakeups = Wakeups()
    wakeups.stepped(fetch=1, fetched=0, recorded=True, taken=taken)  # (caught up)
    wakeups.must_fetch = False
    return wakeups


def taken(wakeups: Wakeups, states: KeyStates | None = None) -> list[int]:
    return [push.place for push in wakeups.take(states or holding_every_state())]


def test_nothing_is_taken_before_a_step_recorded_that_pushes_are() -> None:
    wakeups = Wakeups()
    wakeups.push(pushed(1))
    assert taken(wakeups) == []
    wakeups.stepped(fetch=1, fetched=0, recorded=True, taken=0)
    assert taken(wakeups) == [1]


def test_nothing_is_taken_before_a_step_read_the_inbox_s_taken_count() -> None:
    """Without the count, the owner cannot tell which place follows on from the last item."""
    wakeups = Wakeups()
    wakeups.stepped(fetch=1, fetched=0, recorded=True, taken=None)
    wakeups.push(pushed(1))
    assert taken(wakeups) == []
    wakeups.stepped(fetch=0, fetched=0, recorded=False, taken=1)  # (a fetch moved item 1 in)
    wakeups.push(pushed(2))
    assert taken(wakeups) == [2]


def test_a_chain_of_pushes_is_taken_in_order_and_the_next_step_fetches_nothing() -> None:
    wakeups = recorded()
    for place in (1, 2, 3):
        wakeups.push(pushed(place))
    assert taken(wakeups) == [1, 2, 3]
    assert wakeups.pushed  # (the next step moves them in and raises the horizon to them)
    assert wakeups.next_place == 4
    assert wakeups.fetch_size(64, replaying=False) == 0
    wakeups.stepped(fetch=0, fetched=0, recorded=False, taken=3)
    assert not wakeups.pushed


def test_the_first_push_taken_follows_on_from_the_taken_count_a_step_read() -> None:
    wakeups = recorded(taken=8)
    wakeups.push(pushed(9))
    assert taken(wakeups) == [9]


def test_items_already_moved_in_are_skipped() -> None:
    wakeups = recorded(taken=1)
    wakeups.push(pushed(1))
    wakeups.push(pushed(2))
    assert taken(wakeups) == [2]
    assert wakeups.fetch_size(64, replaying=False) == 0


def test_a_push_that_does_not_follow_on_is_left_to_a_fetch() -> None:
    """An item lies between the last one taken and the push (pushed with a plain RPUSH, or its
    own push was lost): the push is not taken, and the next step fetches."""
    wakeups = recorded()
    wakeups.push(pushed(2))
    assert taken(wakeups) == []
    assert wakeups.fetch_size(64, replaying=False) == 64


def test_a_push_whose_keys_are_not_cached_ends_the_chain() -> None:
    wakeups = recorded()
    wakeups.push(pushed(1, key="cached"))
    wakeups.push(pushed(2, key="unknown"))
    wakeups.push(pushed(3, key="cached"))
    states = KeyStates(request_step=lambda: None)
    states.load("cached", "1")
    assert taken(wakeups, states) == [1]
    assert wakeups.fetch_size(64, replaying=False) == 64


def test_too_many_pushes_waiting_are_dropped_for_a_fetch() -> None:
    wakeups = recorded()
    for place in range(1, MAX_WAITING + 2):
        wakeups.push(pushed(place))
    assert wakeups.fetch_size(64, replaying=False) == 64
    assert taken(wakeups) == []  # (its one push left, the last, does not follow on)


def test_a_step_that_got_all_it_asked_for_fetches_again() -> None:
    wakeups = recorded()
    wakeups.must_fetch = True
    fetch = wakeups.fetch_size(64, replaying=False)
    wakeups.sending(fetch)
    assert wakeups.fetch_size(64, replaying=False) == 0
    wakeups.stepped(fetch, fetched=64, recorded=False, taken=0)
    assert wakeups.fetch_size(64, replaying=False) == 64
    wakeups.sending(64)
    wakeups.stepped(64, fetched=3, recorded=False, taken=0)
    assert wakeups.fetch_size(64, replaying=False) == 0
    assert wakeups.fetch_size(64, replaying=True) == 64


def test_a_step_that_moved_a_full_batch_out_of_the_inbox_fetches_again() -> None:
    """(Delayed items among them went to the shard's timers: the entries it got do not show
    them, the inbox's taken count does.)"""
    wakeups = recorded(taken=10)
    wakeups.sending(64)
    wakeups.stepped(64, fetched=2, recorded=False, taken=74)
    assert wakeups.fetch_size(64, replaying=False) == 64
    wakeups.sending(64)
    wakeups.stepped(64, fetched=0, recorded=False, taken=137)
    assert wakeups.fetch_size(64, replaying=False) == 0, "63 moved: the inbox is empty"


def test_the_next_step_confirms_every_item_taken_from_pushes_since_the_last() -> None:
    wakeups = recorded(taken=4)
    first, second = pushed(5), pushed(6)
    wakeups.push(first)
    wakeups.push(second)
    assert taken(wakeups) == [5, 6]
    place, items = wakeups.to_confirm()
    assert place == "5"
    assert items == [first.item, second.item]
    assert items[0].startswith(b"1 fresh\n") and json.loads(items[0][8:])[0]["id"] == "op-5"
    wakeups.stepped(fetch=0, fetched=0, recorded=False, taken=6)
    assert wakeups.to_confirm() == ("", [])
    wakeups.push(pushed(7))
    assert taken(wakeups) == [7] and wakeups.to_confirm()[0] == "7"


def test_an_op_that_wrote_nothing_keeps_its_keys_uncommitted_until_a_step_took_it() -> None:
    """A grant of a key waits for the outcome of the op before it, not only for its writes."""
    states = holding_every_state()
    states.answered(["k"])
    assert not states.all_committed(["k"]) and states.all_committed(["other"])
    number, writes = states.start_step()
    assert writes == [] and not states.all_committed(["k"])
    states.step_done(number)
    assert states.all_committed(["k"])


def test_no_push_is_taken_while_a_fetch_may_have_left_entries_in_the_stream() -> None:
    """A fetch that got all it asked for may have moved in more than it read: a pushed entry
    taken then would run ahead of them. Pushes are taken again once a fetch reached the end."""
    wakeups = recorded(taken=4)
    wakeups.stepped(fetch=2, fetched=2, recorded=False, taken=6)
    wakeups.push(pushed(7))
    assert taken(wakeups) == []
    wakeups.stepped(fetch=2, fetched=1, recorded=False, taken=6)
    wakeups.push(pushed(7))
    assert taken(wakeups) == [7]
    # A full batch whose last entry is the last item moved out of the inbox left nothing.
    wakeups.stepped(fetch=2, fetched=2, recorded=False, taken=9, last="8")
    wakeups.push(pushed(10))
    assert taken(wakeups) == []
    wakeups.stepped(fetch=2, fetched=2, recorded=False, taken=9, last="9")
    wakeups.push(pushed(10))
    assert taken(wakeups) == [10]
