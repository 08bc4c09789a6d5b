"""Ctrl-C while the main thread waits for work on the hosts (``clusterrun.core.parallel``), and a
local host's agent that starts after its transport was closed (``up``'s Ctrl-C while connecting)."""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import HostSpec
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, TransportError
from clusterrun.transports.local import LocalTransport


class Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted


def test_a_signal_another_thread_took_ends_the_main_threads_wait() -> None:
    """The kernel may hand a signal for the process to any thread; Python runs its handler in the
    main thread, which a plain ``Future.result()`` never woke (Ctrl-C lost while a host hung)."""
    gate, finished, never = threading.Lock(), threading.Event(), threading.Event()

    def take_the_signal() -> None:
        with gate:  # main released it and kept the interpreter until it blocked in the wait
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # this thread takes it
        if not finished.wait(timeout=10):  # a wait deaf to the signal: end it, the test fails
            never.set()

    previous = signal.signal(signal.SIGUSR1, _interrupt)
    interval = sys.getswitchinterval()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(never.wait)
        gate.acquire()
        taker = threading.Thread(target=take_the_signal)
        taker.start()
        sys.setswitchinterval(1000)  # no other thread runs before this one blocks
        gate.release()
        with pytest.raises(Interrupted):
            parallel.result(future)
        assert not future.done()  # woken by the signal, not by the end of what it waited for
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGUSR1, previous)
        finished.set()
        never.set()
        taker.join()
        pool.shutdown()


def test_gather_returns_the_results_in_order_and_every_error() -> None:
    def call(rank: int) -> int:
        if rank == 1:
            raise AgentError("b", "no torch")
        if rank == 2:
            raise OSError("connection reset")
        return rank * 10

    with ThreadPoolExecutor(max_workers=4) as pool:
        results, errors = parallel.gather(pool, call, [0, 1, 2, 3], lambda rank: "abcd"[rank])
    assert results == [0, 30]
    assert [type(e) for e in errors] == [AgentError, TransportError]
    assert isinstance(errors[1], TransportError) and errors[1].host == "c"


def test_a_closed_local_transport_starts_no_agent(tmp_path: Path) -> None:
    """``up``'s Ctrl-C closes the job's transports while a probe's thread may be about to start an
    agent: one started after close() was never ended, and ``up`` waited for that thread at exit."""
    started = tmp_path / "started"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 600\n")
    python.chmod(0o755)
    transport = LocalTransport(HostSpec(host="here", transport="local", python=str(python)))
    transport.close()
    with pytest.raises(AgentError, match="closed"):
        transport.session()
    assert not started.exists()
