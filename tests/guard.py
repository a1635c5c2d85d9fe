"""Memory-safety helpers for tests: arrays next to a guard page, and arrays inside canaries.

Two tools, because each catches what the other misses:

* :func:`guarded_empty` places an array so that its memory ends exactly at (or starts
  exactly after) a page mapped ``PROT_NONE``.  The first read *or* write across that
  edge -- a vector load one lane too long, a loop that runs one row too far, a packer
  that reads B's next row -- faults at once, at the instruction that did it, in
  optimised jitted code where nothing else would notice a stray read.  But it sees
  only one edge of the array, and only accesses that reach the next page: a layout
  with gaps (a strided view, a C with a row stride larger than its width) has no
  guard between its rows, and a write a few elements before the start of an "after"
  array lands in ordinary memory.
* :func:`canaried` (and :func:`canaried_strided`) put the array inside a larger
  buffer whose every byte not owned by the array -- 4 KiB on each side and the gaps
  between rows -- holds a known bit pattern.  ``check()`` after the call finds any
  write outside the array's elements, on either side and in the gaps, a few bytes
  or a page away.  It cannot see reads, and it reports only after the fact.

So outputs get both (guard page: over-reads and far writes crash at the culprit;
canaries: near writes on both sides and into row gaps), inputs get guard pages on
either side (reads are all an input sees).

Guard pages need ``mmap`` and ``mprotect`` (Linux, macOS); :data:`GUARD_PAGES` says
whether they work here, and :func:`guarded_empty` raises ``OSError`` where they do not.
"""
import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

__all__ = ["GUARD_PAGES", "PAGE", "guarded_empty", "canaried", "canaried_strided",
           "CANARY_PATTERN"]

PAGE = mmap.PAGESIZE

_PROT_NONE = 0


def _load_mprotect():
    if sys.platform.startswith("win"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mprotect
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_mprotect = _load_mprotect()

#: Whether :func:`guarded_empty` can place guard pages on this platform.
GUARD_PAGES = _mprotect is not None and hasattr(mmap, "MAP_ANONYMOUS")


def guarded_empty(shape, dtype, *, order="C", where="after"):
    """An array whose memory touches a ``PROT_NONE`` guard page on one side.

    Parameters
    ----------
    shape : int or tuple of int
        Any shape, including ones with a zero dimension.
    dtype : dtype-like
    order : {"C", "F"}
        Memory order of the (contiguous) array.
    where : {"after", "before"}
        ``"after"``: the array's last byte is the last byte before the guard page,
        so reading or writing one element past its end faults.  ``"before"``: its
        first byte is the first byte after the guard page, so touching the element
        before its start faults.  A zero-size array points exactly at the guard
        page's edge (at its first byte for ``"after"``).

    Returns
    -------
    ndarray
        A plain, writeable, aligned ``numpy.ndarray`` (zero-filled, as fresh anonymous
        memory is).  Its ``base`` chain holds the ``mmap`` object, so the mapping
        lives exactly as long as the array and any view of it.

    Raises
    ------
    OSError
        Where guard pages are unavailable (see :data:`GUARD_PAGES`) or mprotect fails.
    """
    if not GUARD_PAGES:
        raise OSError("guard pages need mmap + mprotect (not available on this platform)")
    if where not in ("after", "before"):
        raise ValueError(f"where must be 'after' or 'before', got {where!r}")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data_pages = max(1, -(-nbytes // PAGE))
    mm = mmap.mmap(-1, (data_pages + 1) * PAGE,
                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # A numpy view of the whole mapping gives its address; numpy keeps ``mm`` alive
    # through the buffer protocol for as long as any array made from it exists.
    base = np.frombuffer(mm, np.uint8)
    start = base.ctypes.data
    if where == "after":
        guard_at = data_pages * PAGE
        offset = guard_at - nbytes
    else:
        guard_at = 0
        offset = PAGE
    if _mprotect(ctypes.c_void_p(start + guard_at), PAGE, _PROT_NONE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect of the guard page failed: {err}")
    # From here on nothing may read the whole mapping (``base`` included): only
    # the views below, which never cover the guard page, are handed out.
    return np.ndarray(shape, dtype, buffer=base, offset=offset, order=order)


#: Eight bytes repeated through every canary region: no float32/float64 arithmetic
#: result a kernel could store is likely to reproduce it, and it is not periodic in
#: 4 bytes, so a shifted store of it would still show.
CANARY_PATTERN = bytes([0xA5, 0x5A, 0xC3, 0x3C, 0x96, 0x69, 0xF0, 0x0F])


def _pattern(nbytes):
    reps = -(-nbytes // len(CANARY_PATTERN))
    return np.frombuffer(CANARY_PATTERN * reps, np.uint8)[:nbytes]


def canaried(shape, dtype, order="C", fill=np.nan, *, row_gap=0, pad=4096):
    """An array inside a buffer of canary bytes; returns ``(array, check)``.

    Parameters
    ----------
    shape : int or tuple of int
    dtype : dtype-like
    order : {"C", "F"}
    fill : scalar or None
        The array's initial value (``None`` leaves the canary bytes in it).  NaN by
        default, so an output the code under test forgets to write shows as NaN.
    row_gap : int
        Elements of canary between consecutive rows: the array is then a strided
        (non-contiguous) view whose contiguous axis is the last (C) or the first (F)
        and whose next axis steps over ``n + row_gap`` elements.  A 1-D array gets
        ``row_gap`` elements of canary between consecutive elements.
    pad : int
        Canary bytes before the first and after the last byte the array spans.  A
        multiple of 64 keeps the array as aligned as a fresh numpy array.

    Returns
    -------
    array : ndarray
        A plain writeable ndarray view into the buffer.
    check : callable
        ``check()`` raises ``AssertionError`` naming the side(s) -- ``before``,
        ``after``, ``gap between rows`` -- and the byte offsets (relative to the
        array's first byte) if any byte outside the array's elements changed.
    """
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    if row_gap < 0 or pad < 0:
        raise ValueError("row_gap and pad must be non-negative")
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(int(s) for s in shape)
    item = dtype.itemsize
    size = int(np.prod(shape, dtype=np.int64))

    # Strides of a contiguous array with the contiguous axis widened by row_gap.
    padded = list(shape)
    if shape and row_gap:
        fast = -1 if order == "C" else 0
        if len(shape) == 1:
            padded = [shape[0] * (1 + row_gap)]
        else:
            padded[fast] += row_gap
    axes = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    strides = [0] * len(shape)
    step = item
    for ax in axes:
        strides[ax] = step
        step *= padded[ax]
    if len(shape) == 1 and row_gap:
        strides[0] = item * (1 + row_gap)
    # Bytes from the first element's first byte to the last element's last byte.
    span = 0 if size == 0 else sum((d - 1) * s for d, s in zip(shape, strides)) + item

    total = pad + span + pad
    buf = np.empty(total, np.uint8)
    expected = _pattern(total)
    buf[...] = expected
    array = np.ndarray(shape, dtype, buffer=buf, offset=pad, strides=tuple(strides))

    # Which bytes the array owns: mark them through an unsigned-integer twin of it.
    owned = np.zeros(total, np.uint8)
    if size:
        twin = np.ndarray(shape, np.dtype(f"u{item}"), buffer=owned, offset=pad,
                          strides=tuple(strides))
        twin[...] = np.iinfo(twin.dtype).max
    outside = owned == 0

    if fill is not None:
        array[...] = fill

    def check():
        changed = np.flatnonzero((buf != expected) & outside)
        if changed.size == 0:
            return
        where = []
        for name, sel in (("before", changed < pad), ("after", changed >= pad + span),
                          ("gap between rows", (changed >= pad) & (changed < pad + span))):
            hit = changed[sel]
            if hit.size:
                where.append(f"{name} the array ({hit.size} bytes, offsets "
                             f"{int(hit[0]) - pad}..{int(hit[-1]) - pad} from its start)")
        raise AssertionError("canary changed " + "; ".join(where))

    return array, check


def canaried_strided(shape, dtype, row_gap, order="C", fill=np.nan, *, pad=4096):
    """:func:`canaried` with ``row_gap`` elements of canary between rows (a strided view)."""
    return canaried(shape, dtype, order=order, fill=fill, row_gap=row_gap, pad=pad)
