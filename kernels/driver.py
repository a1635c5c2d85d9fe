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
    """Per-Python-thread pack buffers, grown as needed and reused across calls.

    Each Python thread gets its own, so concurrent calls never share a buffer.
    """
    try:
        store = _workspace.buffers
    except AttributeError:
        store = _workspace.buffers = {}
    have = store.get(key)
    if have is None or any(h.size < s for h, s in zip(have, sizes)):
        have = store[key] = tuple(aligned_empty(max(s, 1), dtype) for s in sizes)
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


_layer_is_safe = None


def _threading_layer_is_safe():
    """Whether Numba's threading layer accepts launches from several Python threads at once."""
    global _layer_is_safe
    if _layer_is_safe is None:
        try:
            _layer_is_safe = numba.threading_layer() != "workqueue"
        except ValueError:  # no parallel function has run yet; the configured layer decides
            return numba.config.THREADING_LAYER in ("threadsafe", "omp", "tbb", "safe")
    return _layer_is_safe


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
    c_rs, c_cs = c.strides
    if c_cs != item and c_rs == item and m > 1:
        # Column-major C: compute C^T = B^T A^T, whose rows are contiguous.
        if epi & (EPI_BIAS_ROW | EPI_BIAS_COL):
            epi ^= EPI_BIAS_ROW | EPI_BIAS_COL
        gemm_into(b.T, a.T, c.T, alpha, beta, bias, epi, threads)
        return c
    if c_cs != item and n > 1:
        # Neither orientation has unit stride: work in a contiguous copy.
        tmp = np.ascontiguousarray(c) if beta != 0 else np.empty(c.shape, c.dtype)
        gemm_into(a, b, tmp, alpha, beta, bias, epi, threads)
        c[...] = tmp
        return c

    dtype = c.dtype
    kern, blk = _plan(dtype)
    args = (dtype.type(alpha),) + flat_view(a) + flat_view(b) + (dtype.type(beta),) + flat_view(c)[:3]
    bias = kern.no_bias if bias is None else bias
    if m == 1 or n == 1:
        _gemv(m, n, k, args, bias, epi)
        return c
    if threads is None:
        # Only worth asking when the product is big enough to share.
        threads = numba.get_num_threads() if 2 * m * n * k >= SERIAL_FLOPS else 1
    use_parallel = threads > 1 and 2 * m * n * k >= SERIAL_FLOPS
    locked = False
    if use_parallel and not _threading_layer_is_safe():
        locked = _parallel_lock.acquire(blocking=False)
        use_parallel = locked
    try:
        b_cs = args[8]
        if b_cs == 1 and (m + n) * k * item <= _small_bytes():
            _unpacked(kern, m, n, k, args, bias, epi, threads if use_parallel else 1)
        else:
            _packed(kern, blk, m, n, k, args, bias, epi, threads if use_parallel else 1)
    finally:
        if locked:
            _parallel_lock.release()
    return c


def _gemv(m, n, k, args, bias, epi):
    """m == 1 or n == 1: one pass over the matrix operand, no packing."""
    alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, b_cs, beta, cf, c_off, c_rs = args
    (acc,) = _buffers("gemv/" + cf.dtype.name, (max(m, n),), cf.dtype)
    if n == 1:   # y (m) = A (m x k) @ b[:, 0]
        gemv(m, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, beta, cf, c_off, c_rs,
             bias, bool(epi & EPI_BIAS_ROW), epi, acc)
    else:        # y (n) = B^T (n x k) @ a[0, :]
        gemv(n, k, alpha, bf, b_off, b_cs, b_rs, af, a_off, a_cs, beta, cf, c_off, 1,
             bias, bool(epi & EPI_BIAS_COL), epi, acc)


def _unpacked(kern, m, n, k, args, bias, epi, threads):
    """A and B fit in L2 together: packing would only copy what is already close by."""
    alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs, _, beta, cf, c_off, c_rs = args
    MR, NR = kern.mr, kern.nr
    apack, bpack, tiles = _buffers(kern.name + "/unpacked", (MR * k, NR * k, threads * MR * NR),
                                   cf.dtype)
    if threads > 1:
        kern.module.gemm_small_parallel(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs,
                                        beta, cf, c_off, c_rs, bias, epi, apack, bpack,
                                        tiles[:threads * MR * NR].reshape(threads, MR * NR))
    else:
        kern.module.gemm_small(m, n, k, alpha, af, a_off, a_rs, a_cs, bf, b_off, b_rs,
                               beta, cf, c_off, c_rs, bias, epi, apack, bpack, tiles)


def _packed(kern, blk, m, n, k, args, bias, epi, threads):
    """The five-loop driver over packed panels, on one thread or several."""
    MR, NR = kern.mr, kern.nr
    KC = max(1, min(blk.kc, k))
    NC = min(blk.nc, _round_up(n, NR))
    if threads == 1:
        MC = min(blk.mc, _round_up(m, MR))
        apack, bpack, tile = _buffers(kern.name + "/serial", (MC * KC, NC * KC, MR * NR),
                                      kern.dtype)
        kern.module.gemm_serial(m, n, k, *args, bias, epi, KC, MC, NC, apack, bpack, tile)
        return
    # Enough MC blocks for every thread, in a multiple of the thread count.
    blocks = _round_up(max(threads, -(-m // blk.mc)), threads)
    MC = min(blk.mc, _round_up(-(-m // blocks), MR))
    row_blocks = -(-m // MC)
    jsplit = max(1, -(-threads // row_blocks))
    apack_size = _round_up(MC * KC, 64)
    flat_a, bpack, tiles = _buffers(kern.name + "/parallel",
                                    (threads * apack_size, NC * KC, threads * MR * NR), kern.dtype)
    apacks = flat_a[:threads * apack_size].reshape(threads, apack_size)
    tiles = tiles[:threads * MR * NR].reshape(threads, MR * NR)
    kern.module.gemm_parallel(m, n, k, *args, bias, epi, KC, MC, NC, apacks, bpack, tiles, jsplit)
