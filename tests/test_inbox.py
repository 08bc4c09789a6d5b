"""The job's inbox: log chunks wait while the queued ones hold the budget; other messages do not."""

from __future__ import annotations

import queue
import signal
import threading
import time

import pytest

from clusterrun.core.protocol import LogChunk
from clusterrun.run.follower import Link
from clusterrun.run.inbox import Inbox


def chunk(chars: int, offset: int = 0) -> LogChunk:
    data = ("x" * 99 + "\n") * (chars // 100)
    return LogChunk(offset=offset, next=offset + len(data), data=data)


def test_a_chunk_over_the_budget_waits_until_the_consumer_takes_one() -> None:
    inbox = Inbox(budget=1000)
    inbox.put((0, chunk(800)))
    with pytest.raises(queue.Full):
        inbox.put((1, chunk(300)), block=False)
    inbox.put((1, Link(up=False)), block=False)  # no log data: only the count bounds it
    assert inbox.held == 800
    put = threading.Thread(target=inbox.put, args=((1, chunk(300, 300)),))
    put.start()
    assert inbox.get(timeout=5)[0] == 0  # frees the budget: the waiting chunk goes in
    put.join(timeout=10)
    assert not put.is_alive()
    assert [inbox.get(timeout=5)[1] for _ in range(2)] == [Link(up=False), chunk(300, 300)]
    assert inbox.held == 0


def test_every_chunk_that_fits_once_a_large_one_left_goes_in() -> None:
    """Two chunks wait for the budget; the one that held it leaves: both go in, not only the first woken."""
    inbox = Inbox(budget=1000)
    inbox.put((0, chunk(900)))
    puts = [threading.Thread(target=inbox.put, args=((rank, chunk(300)),)) for rank in (1, 2)]
    for put in puts:
        put.start()
    while inbox._budget_waits < 2:  # both wait for the budget
        threading.Event().wait(0.01)
    assert inbox.get(timeout=5)[0] == 0
    for put in puts:
        put.join(timeout=10)
    assert not any(put.is_alive() for put in puts)
    assert sorted(inbox.get(timeout=5)[0] for _ in range(2)) == [1, 2]


def test_a_place_freed_in_a_full_inbox_wakes_one_waiting_put_not_every_one() -> None:
    """64 followers waiting on a full inbox: each message taken lets one in; waking them all each
    time kept the job's loop from the inbox behind them."""
    inbox = Inbox(maxsize=2)
    for offset in (0, 100):
        inbox.put((0, chunk(100, offset)))
    woken_all = []
    notify_all = inbox.not_full.notify_all
    inbox.not_full.notify_all = lambda: (woken_all.append(1), notify_all())  # type: ignore[method-assign]
    puts = [threading.Thread(target=inbox.put, args=((rank, chunk(100)),)) for rank in range(1, 6)]
    for put in puts:
        put.start()
    while len(inbox.not_full._waiters) < 5:  # type: ignore[attr-defined]  # all five wait for a place
        threading.Event().wait(0.01)
    taken = [inbox.get(timeout=5)[0] for _ in range(7)]
    for put in puts:
        put.join(timeout=10)
    assert not any(put.is_alive() for put in puts)
    assert sorted(taken) == [0, 0, 1, 2, 3, 4, 5] and woken_all == []


def test_an_empty_inbox_takes_a_chunk_larger_than_the_budget() -> None:
    inbox = Inbox(budget=100)
    inbox.put((0, chunk(5000)), block=False)
    assert inbox.held == 5000
    with pytest.raises(queue.Full):
        inbox.put((0, chunk(100)), timeout=0.01)
    inbox.get(timeout=5)
    inbox.put((0, chunk(100)), block=False)


def test_the_count_still_bounds_messages_without_data() -> None:
    inbox = Inbox(maxsize=2)
    inbox.put((0, Link(up=True)))
    inbox.put((0, Link(up=True)))
    with pytest.raises(queue.Full):
        inbox.put((0, Link(up=True)), block=False)


def woken(inbox: Inbox) -> bool:
    """``inbox.wait(None)``: True if it returned before a watchdog's message (30 s) would wake it."""
    watchdog = threading.Timer(30, inbox.put, args=((9, Link(up=False)),))
    watchdog.start()
    inbox.wait(None)
    watchdog.cancel()
    return inbox.empty()


def test_wait_returns_for_a_message_or_a_ring_and_takes_their_tokens() -> None:
    inbox = Inbox()
    inbox.wait(0)  # nothing: returns after its timeout
    inbox.put((0, Link(up=True)))
    inbox.wait(None)  # something queued: at once
    inbox.get_nowait()
    threading.Timer(0.05, inbox.ring).start()
    assert woken(inbox)
    assert inbox._bell.empty()  # the tokens taken: the next wait sleeps


def test_a_signal_handler_that_rings_wakes_the_wait_it_interrupted() -> None:
    """A stop from a signal handler in the loop's own thread: ``ring`` takes no lock the
    interrupted ``wait`` may hold, and the wait returns."""
    inbox = Inbox()
    previous = signal.signal(signal.SIGUSR1, lambda *_: inbox.ring())
    try:
        threading.Timer(0.05, signal.pthread_kill, args=(threading.get_ident(), signal.SIGUSR1)).start()
        assert woken(inbox)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_settle_waits_its_time_while_messages_are_queued() -> None:
    """Queued messages do not end it (a wait's would): the loop then takes them together."""
    inbox = Inbox()
    inbox.put((0, Link(up=True)))
    until = time.monotonic() + 0.05
    inbox.settle(until)
    assert time.monotonic() >= until


def test_a_ring_ends_a_settle_now_or_before_it_and_only_that_one() -> None:
    inbox = Inbox()
    threading.Timer(0.05, inbox.ring).start()
    until = time.monotonic() + 30
    inbox.settle(until)
    assert time.monotonic() < until  # the ring, not the 30 s
    inbox.ring()  # before the settle: a stop asked while the loop handled messages
    until = time.monotonic() + 30
    inbox.settle(until)
    assert time.monotonic() < until
    until = time.monotonic() + 0.05  # the rings were taken: the next settle waits its time
    inbox.settle(until)
    assert time.monotonic() >= until


def test_a_signal_handler_that_rings_ends_the_settle_it_interrupted() -> None:
    inbox = Inbox()
    previous = signal.signal(signal.SIGUSR1, lambda *_: inbox.ring())
    try:
        threading.Timer(0.05, signal.pthread_kill, args=(threading.get_ident(), signal.SIGUSR1)).start()
        until = time.monotonic() + 30
        inbox.settle(until)
        assert time.monotonic() < until
    finally:
        signal.signal(signal.SIGUSR1, previous)
