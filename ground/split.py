"""Memory-bound numpy passes (layout conversions, pooling, residual sums) on several
threads: the calling thread and pool threads each take a slice of one axis.  numpy
releases the GIL inside its copy and ufunc loops, so the slices run at once; a pass
is as fast as the memory the cores can draw on together, not one core's share.
"""
import concurrent.futures
import threading

from tilegemm.ground.threads import get_num_threads, max_threads

#: A slice of fewer elements is not worth a thread's wake-up.
MIN_ELEMENTS = 1 << 15

_pool = None
_pool_lock = threading.Lock()


def _executor():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, max_threads() - 1), thread_name_prefix="tilegemm-split")
        return _pool


def for_slices(fn, length, elements):
    """``fn(slice)`` for consecutive slices covering ``range(length)``, one per thread
    (:func:`tilegemm.get_num_threads`, fewer for a pass of few ``elements``); the
    caller runs the first and returns when all are done.  ``fn`` must write only
    what its slice owns."""
    parts = min(get_num_threads(), length, max(1, elements // MIN_ELEMENTS))
    if parts <= 1:
        fn(slice(0, length))
        return
    bounds = [length * i // parts for i in range(parts + 1)]
    slices = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    futures = [_executor().submit(fn, s) for s in slices[1:]]
    try:
        fn(slices[0])
    finally:
        for f in futures:
            f.result()
