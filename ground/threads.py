"""How many threads a tilegemm call may use.

Three settings, each narrowing the one before:

* the process-wide limit, :func:`set_num_threads` (also what threadpoolctl sets
  through :class:`tilegemm.threadpool.TilegemmController`); by default Numba's
  ``NUMBA_NUM_THREADS`` (the number of cores unless that variable says otherwise);
* a limit for the calling Python thread only, inside a :func:`thread_limit` block;
* Numba's own per-thread setting, ``numba.set_num_threads`` (thread-local in Numba:
  set in one Python thread it does not reach the others), honoured for code written
  against earlier versions.

A call uses at most the smallest of the three, and fewer when the work is too small
to pay for another thread.  Imports only numba and the standard library.
"""
import contextlib
import numbers
import threading

import numba
from numba.np.ufunc import parallel as _parallel

_limit = None


class _Local(threading.local):
    """Per Python thread: the :func:`thread_limit` in force (a class default, so that a
    thread that never set one reads None without the cost of a failed lookup)."""

    limit = None


_local = _Local()


def _numba_limit():
    """``numba.get_num_threads()``, read straight from the threading layer once that is
    up: the public call takes two locks on every call (a microsecond and more, paid by
    every small product)."""
    if getattr(_parallel, "_is_initialized", False):
        read = getattr(_parallel, "_get_num_threads", None)
        if read is not None:
            return read()
    return numba.get_num_threads()


def max_threads():
    """The most threads a call can use: Numba's ``NUMBA_NUM_THREADS``, fixed at start-up."""
    return numba.config.NUMBA_NUM_THREADS


def _checked(n, func):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{func}: the thread count must be an integer, got {type(n).__name__}")
    n = int(n)
    if not 1 <= n <= max_threads():
        raise ValueError(f"{func}: the thread count must be between 1 and {max_threads()} "
                         f"(NUMBA_NUM_THREADS, set before start-up), got {n}")
    return n


def set_num_threads(n):
    """Limit every later call, from any Python thread, to ``n`` threads.

    Parameters
    ----------
    n : int
        1 to :func:`max_threads`.

    Raises
    ------
    TypeError, ValueError
        For a count that is not an integer in that range.
    """
    global _limit
    _limit = _checked(n, "set_num_threads")


def process_limit():
    """The process-wide limit (:func:`set_num_threads`, else :func:`max_threads`)."""
    return max_threads() if _limit is None else _limit


def get_num_threads():
    """The threads a call from this Python thread may use (the smallest of the three limits)."""
    n = process_limit()
    local = _local.limit
    if local is not None:
        n = min(n, local)
    if n <= 1:
        return 1            # no need to ask Numba (a microsecond, on every small call)
    return max(1, min(n, _numba_limit()))


@contextlib.contextmanager
def thread_limit(n):
    """Within the block, calls from this Python thread use at most ``n`` threads.

    Other Python threads keep their own limits, so each of several threads calling
    tilegemm at once can be given its share of the cores.  A block inside another
    never raises the outer block's limit; leaving a block restores the limit it found.

    Parameters
    ----------
    n : int
        1 to :func:`max_threads`.
    """
    n = _checked(n, "thread_limit")
    previous = _local.limit
    _local.limit = n if previous is None else min(n, previous)
    try:
        yield
    finally:
        _local.limit = previous
