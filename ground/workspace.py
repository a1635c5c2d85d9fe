"""Scratch memory: 64-byte aligned arrays and per-Python-thread buffers reused across calls.

Every driver (GEMM and convolution) takes its pack buffers from here.  Each Python
thread has its own store, so concurrent calls never share a buffer; a buffer grows
when a call needs more and is kept for the next call.
"""
import threading

import numpy as np

from tilegemm.ground.contracts import round_up

#: Shapes of views kept per set of buffers (see :func:`thread_buffers`).
VIEWS_MAX = 64

_workspace = threading.local()


def aligned_empty(n, dtype, align=64):
    """An uninitialised 1-D array of ``n`` elements whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + n * dtype.itemsize].view(dtype)


def buffers(key, sizes, dtype):
    """This thread's aligned buffers of at least ``sizes`` elements under ``key``, reused.

    Parameters
    ----------
    key : hashable
        Names the set (with ``dtype``): one set per driver and kernel.
    sizes : sequence of int
        Minimum elements of each buffer (0 is allowed: a buffer has at least one).
    dtype : dtype-like

    Returns
    -------
    tuple of 1-D numpy arrays, one per size; contents are undefined.
    """
    store = getattr(_workspace, "buffers", None)
    if store is None:
        store = _workspace.buffers = {}
    key = (key, np.dtype(dtype).str)
    have = store.get(key)
    if have is None or len(have) != len(sizes) or any(h.size < s for h, s in zip(have, sizes)):
        # Each buffer grows to the largest size asked of it: calls that alternate
        # between one larger and the other larger must not reallocate every time.
        old = have if have is not None and len(have) == len(sizes) else [None] * len(sizes)
        have = store[key] = tuple(
            h if h is not None and h.size >= s else
            aligned_empty(max(s, 1, 0 if h is None else h.size), dtype)
            for h, s in zip(old, sizes))
    return have


def thread_buffers(key, threads, sizes, dtype):
    """Like :func:`buffers`, as 2-D arrays with one 64-byte aligned row per worker thread.

    The views are kept with the buffers under them (up to ``VIEWS_MAX`` shapes):
    a small layer's call takes them from a dict instead of remaking them.
    """
    bkey = (key, np.dtype(dtype).str)
    views = getattr(_workspace, "views", None)
    if views is None:
        views = _workspace.views = {}
    shape = (threads, tuple(sizes))
    entry = views.get(bkey)
    if entry is not None and _workspace.buffers.get(bkey) is entry[0]:
        made = entry[1].get(shape)
        if made is not None:
            return made
    padded = [round_up(max(s, 1), 64) for s in sizes]
    flat = buffers(key, [threads * s for s in padded], dtype)
    made = tuple(f[:threads * s].reshape(threads, s) for f, s in zip(flat, padded))
    if entry is None or entry[0] is not flat or len(entry[1]) >= VIEWS_MAX:
        entry = views[bkey] = (flat, {})      # views of replaced buffers go with them
    entry[1][shape] = made
    return made


def share_blocks(key, rows, slots):
    """This thread's ``rows x slots`` int64 argument blocks of native shares under
    ``key``, reused, and the address of each row (an int64 array).

    A call's blocks are read by the pool's threads only while the call runs, so the
    next call from the same Python thread may rewrite them.  Keeping them saves the
    allocation and, above all, the addresses: ``ndarray.ctypes`` costs more than
    writing the blocks.
    """
    store = getattr(_workspace, "blocks", None)
    if store is None:
        store = _workspace.blocks = {}
    entry = store.get((key, rows, slots))
    if entry is None:
        block = aligned_empty(rows * slots, np.int64).reshape(rows, slots)
        base, row = block.ctypes.data, block.strides[0]
        entry = store[(key, rows, slots)] = (block, base + row * np.arange(rows, dtype=np.int64))
    return entry
