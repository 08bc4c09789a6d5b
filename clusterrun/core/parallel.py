"""Work on every host at once, waited for by the main thread without going deaf to Ctrl-C.

The kernel hands a signal sent to the process to any one of its threads; Python runs the handler
(``KeyboardInterrupt``, ``up``'s stop) only in the main thread, when it next runs Python code. A
main thread blocked without a time-out on a lock (``Future.result()``, ``Thread.join()``) is not
woken when another thread took the signal: Ctrl-C was lost until that wait ended, and with a host
that never answers the probe it never did. So the main thread waits in slices of ``SLICE`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, TypeVar

from clusterrun.core.errors import ClusterrunError, TransportError

SLICE = 0.2  # how long a signal that another thread took may wait for its handler, at most

T = TypeVar("T")
U = TypeVar("U")
F = TypeVar("F", bound="Future[Any]")


@contextmanager
def threads(workers: int, name: str) -> Iterator[ThreadPoolExecutor]:
    """A pool of ``workers`` threads (at least one) for the block. Left at once when the block
    raises (Ctrl-C): its threads are not waited for, as ``with ThreadPoolExecutor()`` would (a host
    that never answers would hold the command until its time-out)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def map_all(pool: Executor, call: Callable[[U], T], items: Iterable[U]) -> list[T]:
    """``list(pool.map(call, items))``, waited for in slices; the first error in order is raised
    once every call has ended."""
    return [future.result() for future in settled([pool.submit(call, item) for item in items])]


def settled(futures: Iterable[F]) -> list[F]:
    """``futures`` once all are done (their ``result()`` no longer blocks), in the order given."""
    given = list(futures)
    pending: set[Future[Any]] = set(given)
    while pending:
        _, pending = wait(pending, timeout=SLICE)
    return given


def result(future: Future[T]) -> T:
    """``future.result()``, waited for in slices (see the module docstring)."""
    return settled([future])[0].result()


def gather(pool: Executor, call: Callable[[int], T], ranks: Iterable[int],
           host_of: Callable[[int], str]) -> tuple[list[T], list[ClusterrunError]]:
    """``call(rank)`` for each of ``ranks`` on ``pool``, in parallel: the results of those that
    succeeded, in order, and the errors of those that failed (an ``OSError`` a transport did not
    translate becomes a ``TransportError`` of ``host_of(rank)``)."""
    futures = [(rank, pool.submit(call, rank)) for rank in ranks]
    results: list[T] = []
    errors: list[ClusterrunError] = []
    for rank, future in futures:
        try:
            results.append(result(future))
        except ClusterrunError as exc:
            errors.append(exc)
        except OSError as exc:
            errors.append(TransportError(host_of(rank), str(exc)))
    return results, errors


__all__ = ["SLICE", "gather", "map_all", "result", "settled", "threads"]
