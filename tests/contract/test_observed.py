"""FirstSeen (contract/observed.py): ages by the reader's own clock, whatever the writers stamped."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.observed import FirstSeen


def test_an_entry_ages_from_when_this_reader_first_saw_it():
    seen = FirstSeen()
    assert seen.ages("doc", {"a": 1}, 100.0) == {"a": 0.0}
    assert seen.ages("doc", {"a": 1, "b": 1}, 130.0) == {"a": 30.0, "b": 0.0}


def test_a_new_stamp_makes_an_entry_new_and_a_vanished_entry_is_forgotten():
    seen = FirstSeen()
    seen.ages("doc", {"a": 1, "b": 1}, 0.0)
    assert seen.ages("doc", {"a": 2}, 50.0) == {"a": 0.0}  # rewritten; b gone
    assert seen.ages("doc", {"a": 2, "b": 1}, 60.0) == {"a": 10.0, "b": 0.0}  # b back: new to us


def test_documents_are_apart_and_their_number_is_bounded():
    seen = FirstSeen(max_documents=2)
    seen.ages("x", {"a": 1}, 0.0)
    seen.ages("y", {"a": 1}, 5.0)
    seen.ages("z", {"a": 1}, 6.0)
    assert len(seen) == 2
    assert seen.ages("y", {"a": 1}, 10.0) == {"a": 5.0}
    assert seen.ages("x", {"a": 1}, 10.0) == {"a": 0.0}  # forgotten first: new again, counts longer, never shorter


def test_a_clock_that_goes_backwards_gives_no_negative_age():
    seen = FirstSeen()
    seen.ages("doc", {"a": 1}, 10.0)
    assert seen.ages("doc", {"a": 1}, 5.0) == {"a": 0.0}


def test_no_room_is_refused():
    with pytest.raises(ValueError, match="max_documents=0: must be >= 1"):
        FirstSeen(max_documents=0)
