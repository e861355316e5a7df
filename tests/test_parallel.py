"""tests/_parallel.py's Turns, the lock that lets an `alone` test's call run by itself while the workers run tests side
by side. flock locks belong to an open file, so threads that each open the files stand in for the worker processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests._parallel import Turns

WAIT_S = 0.3  # how long a thread that must wait is watched still waiting


def test_an_alone_call_waits_for_the_running_tests_and_holds_back_new_ones(tmp_path: Path) -> None:
    events: list[str] = []
    a, b, c = Turns(tmp_path), Turns(tmp_path), Turns(tmp_path)
    b_in, b_may_end, a_in_turn = threading.Event(), threading.Event(), threading.Event()

    def worker_b() -> None:  # a test running when A's alone call comes
        with b.turn():
            b_in.set()
            b_may_end.wait(10)
            events.append("b ends")

    def worker_a() -> None:  # its setup beside B's test, then its call alone
        with a.turn():
            events.append("a setup")
            a_in_turn.set()
            with a.alone():
                events.append("a call")
                time.sleep(WAIT_S)
                events.append("a call ends")
            events.append("a teardown")

    def worker_c() -> None:  # a test that starts while A waits for the room
        with c.turn():
            events.append("c")

    tb = threading.Thread(target=worker_b, daemon=True)
    tb.start()
    assert b_in.wait(10)
    ta = threading.Thread(target=worker_a, daemon=True)
    ta.start()
    assert a_in_turn.wait(10)  # A's setup did not wait for B's test
    time.sleep(WAIT_S)
    tc = threading.Thread(target=worker_c, daemon=True)
    tc.start()
    time.sleep(WAIT_S)
    assert events == ["a setup"], events  # A's call waits for B; C waits behind A (the turnstile)
    b_may_end.set()
    for t in (ta, tb, tc):
        t.join(10)
        assert not t.is_alive()
    assert events[:4] == ["a setup", "b ends", "a call", "a call ends"], events  # C not during A's call
    assert sorted(events[4:]) == ["a teardown", "c"], events


def test_two_alone_calls_at_once_take_turns(tmp_path: Path) -> None:
    """Two workers whose tests both reach an `alone` call while both hold their turns: neither waits for the other
    for ever, and the calls do not overlap."""
    inside: list[int] = []
    overlaps: list[int] = []
    ready = threading.Barrier(2)

    def worker(n: int) -> None:
        turns = Turns(tmp_path)
        with turns.turn():
            ready.wait(10)
            with turns.alone():
                inside.append(n)
                overlaps.append(len(inside))
                time.sleep(0.1)
                inside.remove(n)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "deadlock: two alone calls waited for each other"
    assert overlaps == [1, 1]
