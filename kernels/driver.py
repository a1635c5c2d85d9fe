"""The Python side of the GEMM engine: orient the problem, pick a path, own the buffers.

``gemm_into(a, b, c, alpha, beta)`` computes ``c = alpha * a @ b + beta * c`` for
validated 2-D float arrays of one dtype.  It chooses between

* the matrix-vector path when m == 1 or n == 1 (:mod:`tilegemm.kernels.gemv`),
* the unpacked path when A and B together fit in L2 and B's rows are contiguous:
  the strided micro-kernel reads them in place (serial or split by tiles),
* the serial five-loop driver for small products or one thread,
* the parallel driver (ic loop and B packing spread over Numba's threads).

Numba's threading layer is set to a thread-safe one before anything parallel is
compiled; when only the workqueue layer is available, parallel launches are
serialised with a lock and a caller that finds it taken runs the serial driver.
"""
import threading

import numba
import numpy as np

from tilegemm.kernels.gemv import gemv
from tilegemm.kernels.generator import EPI_BIAS_COL, EPI_BIAS_ROW
from tilegemm.kernels.registry import get_kernel
from tilegemm.packing import aligned_empty, flat_view
from tilegemm.tuning.blocking import blocking
from tilegemm.tuning.machine import detect

if numba.config.THREADING_LAYER == "default":
    # omp or tbb: both accept parallel launches from several Python threads at once.
    numba.config.THREADING_LAYER = "threadsafe"

#: Below this many flops (2*m*n*k) the serial driver is used: thread start-up costs more.
SERIAL_FLOPS = 2 * 96 ** 3

_parallel_lock = threading.Lock()
_workspace = threading.local()


def _buffers(key, sizes, dtype):
    """Per-Python-thread pack buffers, grown as needed and reused across calls."""
    store = getattr(_workspace, "buffers", None)
    if store is None:
        store = _workspace.buffers = {}
    have = store.get(key)
    if have is None or any(h.size < s for h, s in zip(have, sizes)):
        have = store[key] = tuple(aligned_empty(s, dtype) for s in sizes)
    return have


_plans = {}


def _plan(dtype):
    """(kernel, blocking) for a dtype, looked up once per process (see :func:`reset_plans`)."""
    plan = _plans.get(dtype)
    if plan is None:
        plan = _plans[dtype] = (get_kernel(dtype), blocking(dtype))
    return plan


def reset_plans():
    """Forget cached kernel choices, e.g. after changing ``TILEGEMM_*`` overrides."""
    _plans.clear()


#: Operand bytes (A + B) under which the unpacked path runs; None means the L2 size.
SMALL_BYTES = None


def _small_bytes():
    return detect().l2_bytes if SMALL_BYTES is None else SMALL_BYTES


def _round_up(x, m):
    return -(-x // m) * m


def _threading_layer_is_safe():
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:  # no parallel function has run yet; the configured layer decides
        return numba.config.THREADING_LAYER in ("threadsafe", "omp", "tbb", "safe")


def gemm_into(a, b, c, alpha=1.0, beta=0.0, bias=None, epi=0, threads=None):
    """``c = alpha * a @ b + beta * c`` (then bias/activation per ``epi``), in place.

    Parameters
    ----------
    a, b, c : ndarray
        2-D arrays of one float dtype, shapes (m, k), (k, n), (m, n), any strides.
        ``c`` must be writeable and must not overlap ``a`` or ``b``.
    alpha, beta : float
    bias : ndarray, optional
        1-D contiguous, length m with ``EPI_BIAS_ROW`` or n with ``EPI_BIAS_COL``.
    epi : int
        Epilogue flags from :mod:`tilegemm.kernels.generator`.
    threads : int, optional
        Defaults to ``numba.get_num_threads()``.

    Returns
    -------
    c
    """
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return c
    item = c.itemsize
    if c.strides[1] != item and c.strides[0] == item and m > 1:
        # Column-major C: compute C^T = B^T A^T, whose rows are contiguous.
        epi_t = epi ^ (EPI_BIAS_ROW | EPI_BIAS_COL) if epi & (EPI_BIAS_ROW | EPI_BIAS_COL) else epi
        gemm_into(b.T, a.T, c.T, alpha, beta, bias, epi_t, threads)
        return c
    if c.strides[1] != item and n > 1:
        # Neither orientation has unit stride: work in a contiguous copy.
        tmp = np.ascontiguousarray(c) if beta != 0 else np.empty(c.shape, c.dtype)
        gemm_into(a, b, tmp, alpha, beta, bias, epi, threads)
        c[...] = tmp
        return c

    dtype = c.dtype.type
    alpha, beta = dtype(alpha), dtype(beta)
    if bias is None:
        bias = np.zeros(1, c.dtype)
    af, a_off, a_rs, a_cs = flat_view(a)
    bf, b_off, b_rs, b_cs = flat_view(b)
    cf, c_off, c_rs, _ = flat_view(c)

    if m == 1 or n == 1:
        if n == 1:   # y (m) = A (m x k) @ b[:, 0]
            (acc,) = _buffers(("gemv", c.dtype), (m,), c.dtype)
            gemv(m, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, beta, cf, c_off, c_rs,
                 bias, bool(epi & EPI_BIAS_ROW), epi, acc)
        else:        # y (n) = B^T (n x k) @ a[0, :]
            (acc,) = _buffers(("gemv", c.dtype), (n,), c.dtype)
            gemv(n, k, alpha, bf, b_off, b_cs, b_rs, af, a_off, a_cs, beta, cf, c_off, 1,
                 bias, bool(epi & EPI_BIAS_COL), epi, acc)
        return c

    kern, blk = _plan(c.dtype)
    MR, NR = kern.mr, kern.nr
    threads = numba.get_num_threads() if threads is None else threads
    use_parallel = threads > 1 and 2 * m * n * k >= SERIAL_FLOPS
    locked = False
    if use_parallel and not _threading_layer_is_safe():
        locked = _parallel_lock.acquire(blocking=False)
        use_parallel = locked
    try:
        if b_cs == 1 and (m + n) * k * item <= _small_bytes():
            # A and B fit in L2 together: packing would only copy what is already close by.
            apack, bpack, tiles = _buffers(("small", kern.name, threads),
                                           (MR * k, NR * k, threads * MR * NR), c.dtype)
            if use_parallel:
                kern.module.gemm_small_parallel(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off,
                                                b_rs, beta, cf, c_off, c_rs, bias, epi, apack, bpack,
                                                tiles[:threads * MR * NR].reshape(threads, MR * NR))
            else:
                kern.module.gemm_small(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs,
                                       beta, cf, c_off, c_rs, bias, epi, apack, bpack, tiles)
            return c
        KC = max(1, min(blk.kc, k))
        NC = min(blk.nc, _round_up(n, NR))
        if not use_parallel:
            MC = min(blk.mc, _round_up(m, MR))
            apack, bpack, tile = _buffers(("serial", kern.name),
                                          (MC * KC, NC * KC, MR * NR), c.dtype)
            kern.module.gemm_serial(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, b_cs,
                                    beta, cf, c_off, c_rs, bias, epi, KC, MC, NC,
                                    apack, bpack, tile)
        else:
            # Enough MC blocks for every thread, in a multiple of the thread count.
            blocks = _round_up(max(threads, -(-m // blk.mc)), threads)
            MC = min(blk.mc, _round_up(-(-m // blocks), MR))
            row_blocks = -(-m // MC)
            jsplit = max(1, -(-threads // row_blocks))
            apack_size = _round_up(MC * KC, 64)
            flat_a, bpack, tiles = _buffers(("parallel", kern.name, threads),
                                            (threads * apack_size, NC * KC, threads * MR * NR),
                                            c.dtype)
            apacks = flat_a[:threads * apack_size].reshape(threads, apack_size)
            tiles = tiles[:threads * MR * NR].reshape(threads, MR * NR)
            kern.module.gemm_parallel(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, b_cs,
                                      beta, cf, c_off, c_rs, bias, epi, KC, MC, NC,
                                      apacks, bpack, tiles, jsplit)
    finally:
        if locked:
            _parallel_lock.release()
    return c
