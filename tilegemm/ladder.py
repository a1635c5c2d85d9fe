"""The cache-blocking ladder: seven GEMMs from the naive triple loop to the library's engine.

Each rung is one short function computing ``C = A @ B`` for C-contiguous float
arrays, and each changes one thing from the rung before it.  Read them in order
next to ``docs/cache-blocking.md``; run them, measured on your own machine, with::

    python -m tilegemm ladder [--n 1024] [--out DIR]

====  ============================  ==============================================
rung  function                      what it now respects
====  ============================  ==============================================
0     :func:`naive_ijk`             nothing: B is read down its columns
1     :func:`loop_ikj`              cache lines: every inner access has unit stride
2     :func:`blocked`               L2: a KC x NC panel of B is reused by all of A
3     :func:`packed`                L1, TLB, prefetchers: contiguous micro-panels
4     :func:`packed_register_tile`  registers: an MR x NR tile of sums in registers
5     :func:`library_micro_kernel`  registers, really: the vector-IR micro-kernel
6     :func:`threaded`              every core: the library's parallel driver
====  ============================  ==============================================

Rungs 0-4 are plain Numba.  Rungs 3-5 pack with the library's own
:func:`tilegemm.packing.pack_a` / :func:`tilegemm.packing.pack_b`; rung 5 calls the
library's ``macro_kernel`` (the jr and ir loops around the vector-IR micro-kernel) and
rung 6 is :func:`tilegemm.kernels.driver.gemm_into` itself, so the last rungs measure
the library, not a copy of it.
"""
import argparse
import functools
import os
import sys
import textwrap
import time
from dataclasses import dataclass

import numba
import numpy as np

from tilegemm.ground.contracts import JIT
from tilegemm.kernels.driver import gemm_into
from tilegemm.kernels.registry import get_kernel
from tilegemm.packing import aligned_empty, pack_a, pack_b
from tilegemm.tuning.blocking import blocking


# --------------------------------------------------------------------------- rung 0
@numba.njit(**JIT)
def naive_ijk(a, b, c):
    """Rung 0: the textbook triple loop, ``i`` then ``j`` then ``k``.

    The innermost loop walks ``a[i, p]`` along a row (unit stride) but ``b[p, j]``
    down a column: consecutive iterations are ``n`` elements apart, so every one
    touches a new cache line and, for large ``n``, a new page.  Each line of B is
    fetched for one useful element; the loop runs at memory latency, not at the
    speed of arithmetic.
    """
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for j in range(n):
            c[i, j] = 0
            for p in range(k):
                c[i, j] += a[i, p] * b[p, j]


# --------------------------------------------------------------------------- rung 1
@numba.njit(**JIT)
def loop_ikj(a, b, c):
    """Rung 1: the same arithmetic with the loops in ``i, k, j`` order.

    Change: ``j`` is now innermost, so the loop reads a row of B and updates a row
    of C, both with unit stride, while ``a[i, p]`` is a constant.  Every byte of a
    fetched cache line is used, and the loop vectorises (one vector FMA updates
    several C elements).  What it still ignores: each ``i`` streams all of B
    through the caches again, so once B outgrows L2 the rate falls to what
    L3 or memory can deliver.
    """
    m, k = a.shape
    n = b.shape[1]
    c[:, :] = 0
    for i in range(m):
        for p in range(k):
            a_ip = a[i, p]
            for j in range(n):
                c[i, j] += a_ip * b[p, j]


# --------------------------------------------------------------------------- rung 2
@numba.njit(**JIT)
def blocked(a, b, c, KC, MC, NC):
    """Rung 2: cache blocking, the BLIS loops jc (NC), pc (KC), ic (MC) around rung 1.

    Change: the ``i, k, j`` loop runs over one block at a time.  The ``KC x NC``
    panel of B (sized to L2) is reused by all ``m`` rows before the next panel is
    touched, so B comes from memory once per ``jc``/``pc`` step instead of once per
    row of A.  The ``MC x KC`` block of A and a row of C are small enough to stay
    close in L1/L2 while a panel row of B streams past.  Assumes positive block sizes.
    """
    m, k = a.shape
    n = b.shape[1]
    c[:, :] = 0
    for jc in range(0, n, NC):
        j_end = min(jc + NC, n)
        for pc in range(0, k, KC):
            p_end = min(pc + KC, k)
            for ic in range(0, m, MC):
                for i in range(ic, min(ic + MC, m)):
                    c_row = c[i, jc:j_end]  # row views: indices from 0, so the loop vectorises
                    for p in range(pc, p_end):
                        a_ip = a[i, p]
                        b_row = b[p, jc:j_end]
                        for j in range(j_end - jc):
                            c_row[j] += a_ip * b_row[j]


# --------------------------------------------------------------------------- rung 3
@numba.njit(**JIT)
def tile_in_local_array(kc, a_panel, b_panel, acc, MR, NR):
    """``acc = a_panel @ b_panel`` for one ``MR x NR`` tile, summed in a small local array.

    ``a_panel`` is a packed A micro-panel (``kc x MR``, k-major), ``b_panel`` a packed B
    micro-panel (``kc x NR``, k-major), ``acc`` a scratch of ``MR*NR`` values.  For
    each ``p`` a row of B (``NR`` contiguous values) is multiplied by each of the
    ``MR`` A values and added to a row of ``acc``: slices from 0 with a run-time
    length, so the ``j`` loop vectorises whatever NR is (a literal NR of 16 is
    unrolled into scalar code instead).
    """
    acc[:] = 0
    for p in range(kc):
        b_row = b_panel[p * NR:(p + 1) * NR]
        for i in range(MR):
            a_ip = a_panel[p * MR + i]
            acc_row = acc[i * NR:(i + 1) * NR]
            for j in range(NR):
                acc_row[j] += a_ip * b_row[j]


@numba.njit(**JIT)
def packed(a, b, c, MR, NR, KC, MC, NC, apack, bpack, acc):
    """Rung 3: pack the A block and the B panel into contiguous micro-panels.

    Change: before they are used, the ``MC x KC`` block of A is copied into
    ``MR``-row micro-panels and the ``KC x NC`` panel of B into ``NR``-column
    micro-panels, both k-major (the reference packers of ``tilegemm.packing.pack``),
    and C is computed one ``MR x NR`` tile at a time (:func:`tile_in_local_array`):
    the tile's sums stay in a small array (``acc``, L1) for the whole ``kc`` loop,
    and C is read and written once per tile and KC block instead of once per
    ``p``.  The micro-panels are read strictly in order: one of A (``MR*KC``) and one
    of B (``KC*NR``) fit L1 together, the prefetchers see plain streams.  The copy
    costs O(mk + kn) per block against O(mnk) arithmetic.  Buffers: ``apack >=
    ceil(MC/MR)*MR*KC``, ``bpack >= ceil(NC/NR)*NR*KC``, ``acc >= MR*NR``; a, b, c
    C-contiguous.
    """
    m, k = a.shape
    n = b.shape[1]
    af, bf = a.reshape(-1), b.reshape(-1)  # flat views: pack_* take offsets and strides
    c[:, :] = 0
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, k, KC):
            kc = min(KC, k - pc)
            pack_b(bf, pc * n + jc, n, 1, kc, nc, NR, bpack)
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                pack_a(af, ic * k + pc, k, 1, mc, kc, MR, apack)
                for jr in range(0, nc, NR):          # B micro-panel: stays in L1 ...
                    for ir in range(0, mc, MR):      # ... while A micro-panels stream
                        tile_in_local_array(kc, apack[ir * kc:(ir + MR) * kc],
                                            bpack[jr * kc:(jr + NR) * kc], acc, MR, NR)
                        for i in range(min(MR, mc - ir)):     # clipped at the edges
                            c_row = c[ic + ir + i, jc + jr:min(jc + jr + NR, n)]
                            for j in range(c_row.shape[0]):
                                c_row[j] += acc[i * NR + j]


# --------------------------------------------------------------------------- rung 4
def register_tile_shape(vector_registers):
    """(MR, NR) of rung 4's register tile: ``MR*NR`` accumulators, each a vector of
    partial sums, in at most half the vector registers (the rest hold the loaded
    rows): 2 x 8 with 32 registers (AVX-512), 2 x 4 with 16 (AVX2)."""
    return (2, 8) if vector_registers >= 32 else (2, 4)


def _register_tile_source(MR, NR):
    """Source of :func:`register_tile` for an ``MR x NR`` tile: one scalar sum per
    element of C, written out (plain Numba has no arrays in registers)."""
    sums = [(i, j) for i in range(MR) for j in range(NR)]
    lines = ["def register_tile(kc, a, a_off, lda, b, b_off, c, c_off, ldc, mr, nr, zero):"]
    # Rows past the last (mr of them are real) read the last row again: never stored.
    lines += [f"    a{i} = a[a_off + min({i}, mr - 1) * lda:a_off + min({i}, mr - 1) * lda + kc]"
              for i in range(MR)]
    lines += [f"    b{j} = b[b_off + {j} * kc:b_off + {j + 1} * kc]" for j in range(NR)]
    lines += [f"    s{i}_{j} = zero" for i, j in sums]
    lines += ["    for p in range(kc):"]
    lines += [f"        s{i}_{j} += a{i}[p] * b{j}[p]" for i, j in sums]
    lines += [f"    if {i} < mr and {j} < nr:\n        c[c_off + {i} * ldc + {j}] += s{i}_{j}"
              for i, j in sums]
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def make_register_tile(MR, NR):
    """Rung 4's micro-kernel for an ``MR x NR`` tile of C (compiled once per shape).

    ``register_tile(kc, a, a_off, lda, b, b_off, c, c_off, ldc, mr, nr, zero)`` adds
    to the ``mr x nr`` corner of the tile at ``c[c_off]`` (rows ``ldc`` apart) the
    products of ``MR`` rows of A (``kc`` values each, contiguous, ``lda`` apart, from
    ``a[a_off]``) and ``NR`` columns of B packed along k (``kc`` values each, one after
    another from ``b[b_off]``).  ``zero`` is 0 in C's dtype.  Not cached on disk: the
    function is made from generated source.
    """
    namespace = {}
    exec(_register_tile_source(MR, NR), namespace)
    return numba.njit(**dict(JIT, cache=False))(namespace["register_tile"])


@numba.njit(**JIT)
def pack_columns(b, b_off, ldb, kc, nc, NR, bpack):
    """Columns ``0:nc`` of the ``kc``-row block of B at ``b[b_off]`` (rows ``ldb`` apart),
    each column's ``kc`` values contiguous (column ``j`` at ``j*kc``), zero columns up
    to a multiple of ``NR``.  Rows of B are read in order."""
    for j in range(nc, -(-nc // NR) * NR):
        bpack[j * kc:(j + 1) * kc] = 0
    for p in range(kc):
        row = b[b_off + p * ldb:b_off + p * ldb + nc]
        for j in range(nc):
            bpack[j * kc + p] = row[j]


def register_tile_kc(MR, NR, itemsize):
    """Rung 4's KC: the ``NR`` packed columns of B in half of L1d, reused by every
    ``MR`` rows of A.  Its tiles are narrow, so KC is longer than the library's, which
    also spreads each sum's final reduction over more products (n = 1024 on a
    48 KiB L1d: 52 GFLOPS with the library's KC of 192, 63 with 768)."""
    from tilegemm.tuning.machine import detect
    return max(1, detect().l1d_bytes // 2 // (NR * itemsize))


def packed_register_tile(a, b, c, KC=None, MC=None, NC=None):
    """Rung 4: the same blocking with an ``MR x NR`` tile of C held in registers.

    Change: the tile's ``MR*NR`` sums are scalars (:func:`make_register_tile`) and the
    ``k`` loop is innermost, so LLVM vectorises along k and keeps each sum as a
    vector of partial sums in a register for the whole KC block: per ``p``, ``MR + NR``
    vector loads feed ``MR*NR`` vector FMAs, and no sum goes to memory before the
    block ends.  Plain Numba vectorises only its innermost loop, which is why k goes
    there: A's rows are already contiguous along k (read in place), B's columns are
    packed along k (:func:`pack_columns`), and each sum is reduced across its vector
    once per tile and block.  Rung 5 puts the vectors along n instead, as the library
    does, and needs no reduction.  ``KC`` defaults to :func:`register_tile_kc`, ``MC``
    and ``NC`` to the library's.
    """
    m, k = a.shape
    n = b.shape[1]
    MR, NR = register_tile_shape(_vector_registers())
    blk = blocking(a.dtype)
    KC = KC or register_tile_kc(MR, NR, a.itemsize)
    MC, NC = MC or blk.mc, NC or blk.nc
    bpack = _column_buffer(a.dtype.name, NR, KC, min(NC, max(n, 1)))
    _register_tile_loops(a.reshape(-1), b.reshape(-1), c.reshape(-1), m, n, k, KC, MC, NC,
                         bpack, a.dtype.type(0), make_register_tile(MR, NR), MR, NR)


@functools.lru_cache(maxsize=None)
def _column_buffer(dtype_name, NR, KC, NC):
    """Rung 4's packed columns of B: ``NC`` rounded up to ``NR`` columns of ``KC``."""
    return aligned_empty(-(-NC // NR) * NR * KC, dtype_name)


def _vector_registers():
    from tilegemm.tuning.machine import detect
    return detect().vector_registers


@numba.njit(**dict(JIT, cache=False))
def _register_tile_loops(af, bf, cf, m, n, k, KC, MC, NC, bpack, zero, tile, MR, NR):
    """The jc, pc, ic, jr, ir loops of rung 4 around ``tile``; C zeroed first."""
    cf[:m * n] = zero
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, k, KC):
            kc = min(KC, k - pc)
            pack_columns(bf, pc * n + jc, n, kc, nc, NR, bpack)
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                for jr in range(0, nc, NR):
                    for ir in range(0, mc, MR):
                        tile(kc, af, (ic + ir) * k + pc, k, bpack, jr * kc, cf,
                             (ic + ir) * n + jc + jr, n, min(MR, mc - ir), min(NR, nc - jr),
                             zero)


# --------------------------------------------------------------------------- rung 5
# Not cached on disk: ``macro_kernel`` arrives as an argument (a function from the
# generated kernel module), and Numba cannot cache code specialised on a function.
@numba.njit(**dict(JIT, cache=False))
def library_micro_kernel(a, b, c, KC, MC, NC, apack, bpack, macro_kernel, MR, NR,
                         one, zero):
    """Rung 5: the same five loops, with the library's vector-IR micro-kernel inside.

    Change: the jr and ir loops and the micro-kernel are the library's
    ``macro_kernel`` from ``get_kernel(dtype).module`` (``kernels/_tile.py``).  Its
    micro-kernel is written as LLVM vector IR: per ``p`` it loads ``NR/lanes``
    vectors of B, broadcasts each of the ``MR`` A values and issues
    ``MR*NR/lanes`` full-width FMAs into accumulators that live in registers for
    the whole ``kc`` loop.  C is read and written once per tile and block.
    ``one``/``zero`` are 1 and 0 in C's dtype: beta is 0 on the first ``pc`` block
    (overwrite C), 1 afterwards (accumulate).
    """
    m, k = a.shape
    n = b.shape[1]
    af, bf, cf = a.reshape(-1), b.reshape(-1), c.reshape(-1)
    for jc in range(0, n, NC):
        nc = min(NC, n - jc)
        for pc in range(0, max(k, 1), KC):   # k == 0 still makes one pass to zero C
            kc = min(KC, k - pc)
            pack_b(bf, pc * n + jc, n, 1, kc, nc, NR, bpack)
            beta = zero if pc == 0 else one
            for ic in range(0, m, MC):
                mc = min(MC, m - ic)
                pack_a(af, ic * k + pc, k, 1, mc, kc, MR, apack)
                # (mc, nc, kc, A, B, B offset, C, C offset, ldc, alpha, beta,
                #  bias (unread: no epilogue), bias row, bias col, epilogue flags = none)
                macro_kernel(mc, nc, kc, apack, 0, bpack, 0, cf, ic * n + jc, n, one, beta,
                             apack, ic, jc, 0)


# --------------------------------------------------------------------------- rung 6
def threaded(a, b, c, threads=None):
    """Rung 6: the library's engine on every core (:func:`tilegemm.kernels.driver.gemm_into`).

    Change: the ic loop (one MC block of A per task) and the packing of the B
    panel are spread over the threads; each thread owns its A buffer and its L1/L2,
    and all threads share the packed B panel.  The driver also keeps its pack
    buffers between calls, and chooses its own paths: one thread for small products
    (``SERIAL_FLOPS``, ``SERIAL_SECONDS``) and no packing when the operands already fit in L2 (see
    ``kernels/driver.py``).  With ``threads`` cores the ceiling is
    ``threads`` times a core's peak.
    """
    return gemm_into(a, b, c, threads=threads)


# --------------------------------------------------------------------------- plumbing
@dataclass(frozen=True)
class Rung:
    """One step of the ladder: its number, a short title and whether it uses all threads."""

    number: int
    title: str
    parallel: bool = False


RUNGS = (
    Rung(0, "naive i-j-k"),
    Rung(1, "loop order i-k-j"),
    Rung(2, "cache blocking (KC, MC, NC)"),
    Rung(3, "packed micro-panels"),
    Rung(4, "MR x NR tile, plain Numba"),
    Rung(5, "vector-IR micro-kernel"),
    Rung(6, "threads", parallel=True),
)


@functools.lru_cache(maxsize=None)
def _buffers(dtype_name, MR, NR, KC, MC, NC):
    """Pack buffers and rung 3's tile scratch for one blocking, allocated once and
    reused (as the library does).  B's buffer also holds rung 4's column panels
    (its NR divides no more than the library's: padding to it takes no more room)."""
    apack = aligned_empty(-(-MC // MR) * MR * KC, dtype_name)
    bpack = aligned_empty(-(-NC // NR) * NR * KC, dtype_name)
    acc = aligned_empty(MR * NR, dtype_name)
    return apack, bpack, acc


def compute(number, a, b, c=None, blk=None):
    """``C = A @ B`` with rung ``number``; the entry point for tests and the benchmark.

    Parameters
    ----------
    number : int
        0 to 6.
    a, b : ndarray
        2-D float32 or float64 of one dtype, shapes (m, k) and (k, n).
    c : ndarray, optional
        C-contiguous (m, n) output of the same dtype; allocated when omitted.
    blk : tilegemm.tuning.blocking.Blocking, optional
        Block sizes for rungs 2-5 (default ``blocking(dtype)``, and rung 4's own KC and
        register tile); tests pass small ones to exercise every loop on small
        matrices.  MR and NR must be the library's for rung 5.  Rung 6 always uses the
        library's own plan.

    Returns
    -------
    ndarray
        ``c``.
    """
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"compute: need 2-D a, b of one dtype with matching inner dimension, "
                         f"got {a.shape} {a.dtype} and {b.shape} {b.dtype}")
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"compute: float32 or float64 only, got {a.dtype}")
    if c is None:
        c = np.empty((a.shape[0], b.shape[1]), a.dtype)
    if number == 6:
        threaded(a, b, c)
        return c
    custom_blocks = blk is not None
    blk = blk or blocking(a.dtype)
    MR, NR, KC, MC, NC = blk.mr, blk.nr, blk.kc, blk.mc, blk.nc
    apack, bpack, acc = _buffers(a.dtype.name, MR, NR, KC, MC, NC)
    if number == 0:
        naive_ijk(a, b, c)
    elif number == 1:
        loop_ikj(a, b, c)
    elif number == 2:
        blocked(a, b, c, KC, MC, NC)
    elif number == 3:
        packed(a, b, c, MR, NR, KC, MC, NC, apack, bpack, acc)
    elif number == 4:
        if custom_blocks:
            packed_register_tile(a, b, c, KC, MC, NC)
        else:
            packed_register_tile(a, b, c)     # its own KC (register_tile_kc)
    elif number == 5:
        kern = get_kernel(a.dtype, MR, NR)
        one = a.dtype.type(1)
        library_micro_kernel(a, b, c, KC, MC, NC, apack, bpack, kern.module.macro_kernel,
                             MR, NR, one, one - one)
    else:
        raise ValueError(f"compute: rung must be 0 to 6, got {number}")
    return c


# --------------------------------------------------------------------------- measuring
#: Longest one call of a rung may take; slower rungs are measured on a smaller n.
CALL_BUDGET = 0.25
#: The smallest n a rung is measured at (its first, compiling call is about this size).
PROBE_N = 128


@dataclass
class Result:
    """One row of the ladder table (GFLOPS are best-of-runs rates).

    ``spread`` is the slowest run's time over the fastest one's, minus 1: how much
    the repeats disagreed (a busy machine shows here first).
    """

    rung: Rung
    n: int
    threads: int
    gflops: float
    first_call_s: float
    numpy_gflops: float
    peak_gflops: float
    spread: float = 0.0


def _operands(n, dtype):
    rng = np.random.default_rng(n)
    a = rng.uniform(-1, 1, (n, n)).astype(dtype)
    b = rng.uniform(-1, 1, (n, n)).astype(dtype)
    return a, b, np.empty((n, n), dtype)


def _timed_runs(call, min_runs=5, min_total=0.5, max_runs=30):
    """Wall times of ``call()`` over enough runs to be stable: at least ``min_runs``
    and ``min_total`` seconds, at most ``max_runs``."""
    times = []
    while len(times) < min_runs or (sum(times) < min_total and len(times) < max_runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _best_seconds(call, min_runs=3, min_total=0.3, max_runs=20):
    """Best wall time of ``call()`` over a few runs (the minimum is the least disturbed)."""
    return min(_timed_runs(call, min_runs, min_total, max_runs))


def _numpy_gflops(n, dtype, threads, cache):
    """numpy's rate at the same n and thread count (OpenBLAS limited with threadpoolctl)."""
    key = (n, threads)
    if key not in cache:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # without it numpy's thread count is unknown: no fair figure
            return float("nan")
        a, b, c = _operands(n, dtype)
        with threadpool_limits(limits=threads, user_api="blas"):
            np.matmul(a, b, out=c)
            cache[key] = 2 * n ** 3 / _best_seconds(lambda: np.matmul(a, b, out=c)) / 1e9
    return cache[key]


def measure(rung, n, dtype=np.float32, numpy_cache=None, log=None):
    """Time one rung: compile on a small problem, pick its n, best-of-runs GFLOPS.

    The size climbs from about :data:`PROBE_N` to ``n`` by doubling, and stops where
    the next call is predicted (time growing as size**3) to exceed :data:`CALL_BUDGET`
    seconds: a slow rung is measured on a smaller n, a fast one on ``n``.
    """
    from tilegemm.tuning.peak import measured_peak_gflops
    threads = numba.get_num_threads() if rung.parallel else 1
    sizes = [n]                                   # n, n/2, n/4, ... down to the probe size
    while sizes[-1] // 2 >= PROBE_N:
        sizes.append(sizes[-1] // 2)
    first_call = None
    for size in reversed(sizes):
        a, b, c = _operands(size, dtype)
        t0 = time.perf_counter()
        compute(rung.number, a, b, c)             # the first call compiles (or loads the cache)
        if first_call is None:
            first_call = time.perf_counter() - t0
        per_call = _best_seconds(lambda: compute(rung.number, a, b, c), min_runs=2, min_total=0)
        if size == n or per_call * 8 > CALL_BUDGET:
            break
    times = _timed_runs(lambda: compute(rung.number, a, b, c))
    gflops = 2 * size ** 3 / min(times) / 1e9
    numpy = _numpy_gflops(size, dtype, threads, {} if numpy_cache is None else numpy_cache)
    peak = measured_peak_gflops(dtype, threads)
    spread = max(times) / min(times) - 1
    if log:
        log(f"  rung {rung.number}: n={size}, {gflops:.1f} GFLOPS (runs within {100 * spread:.0f}%)")
    return Result(rung, size, threads, gflops, first_call, numpy, peak, spread)


def run_ladder(n=1024, dtype=np.float32, log=None):
    """Measure every rung; returns a list of :class:`Result`, in rung order."""
    numpy_cache = {}
    return [measure(r, n, dtype, numpy_cache, log) for r in RUNGS]


def format_table(results):
    """The ladder as a Markdown table (prints well in a terminal, pastes into docs)."""
    head = ("| rung | what | n | threads | GFLOPS | % of peak | x prev | x rung 0 "
            "| numpy GFLOPS | first call s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(results):
        prev = f"{r.gflops / results[i - 1].gflops:.2f}" if i else "-"
        base = f"{r.gflops / results[0].gflops:.1f}"
        lines.append(f"| {r.rung.number} | {r.rung.title} | {r.n} | {r.threads} | {r.gflops:.1f} "
                     f"| {100 * r.gflops / r.peak_gflops:.1f} | {prev} | {base} "
                     f"| {r.numpy_gflops:.1f} | {r.first_call_s:.2f} |")
    return "\n".join(lines)


#: Why a rung may not beat the one before it on some hosts, printed under the table
#: when it does not.
SLOWER_BECAUSE = {
    3: "packing changes what is read, not what is written: like rung 2 it stores every "
       "sum of C to L1 at every k step, and that store traffic, not the reads packing "
       "straightens, bounds both (rung 4 keeps the sums in registers)",
    4: "plain Numba's vectors here are as wide as LLVM's preferred width for this CPU, "
       "and each sum is reduced across its vector once per tile",
}
#: Repeats of one rung further apart than this (slowest over fastest, minus 1) mean
#: another program shared the cores.
SPREAD_WARNING = 0.25
#: A thread rung scaling less than this fraction of its thread count over rung 5 also does.
SCALING_WARNING = 0.75


def slower_notes(results):
    """One line for each rung slower than the one before it by more than their
    repeats' spread, saying why (:data:`SLOWER_BECAUSE`)."""
    notes = []
    for prev, r in zip(results, results[1:]):
        if r.gflops * (1 + max(r.spread, prev.spread)) < prev.gflops:
            reason = SLOWER_BECAUSE.get(r.rung.number, "see the rung's docstring")
            notes.append(f"rung {r.rung.number} is slower than rung {prev.rung.number} here: "
                         f"{reason}.")
    return notes


def _busy_machine_warning(results):
    """A warning when the figures show another program sharing the cores, else None."""
    # (An n-thread peak below n x the 1-thread peak is not a sign of this by itself:
    # cores may share an FMA unit or drop their clock when all of them run 512-bit code.)
    for r in results:
        if r.gflops > r.peak_gflops:
            return (f"warning: rung {r.rung.number} ran above the measured peak, so the peak "
                    "was measured while another program used the cores; rerun when it is quiet")
    for r in results:
        if r.spread > SPREAD_WARNING:
            return (f"warning: rung {r.rung.number}'s runs were {100 * r.spread:.0f}% apart: "
                    "another program is probably using the cores; rerun when it is quiet")
    single = {r.rung.number: r for r in results}
    for r in results:
        if r.threads > 1 and 5 in single:
            scaling = r.gflops / single[5].gflops
            if scaling < SCALING_WARNING * r.threads:
                return (f"warning: rung {r.rung.number} on {r.threads} threads ran only "
                        f"{scaling:.2f}x rung 5: another program is probably using a core; "
                        "rerun when it is quiet")
    return None


def plot(results, path, machine_label=""):
    """A bar chart of the ladder (log scale: the rungs span two orders of magnitude)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    x = np.arange(len(results))
    colors = ["tab:orange" if r.rung.parallel else "tab:blue" for r in results]
    bars = ax.bar(x, [r.gflops for r in results], color=colors, width=0.65)
    for bar, r in zip(bars, results):
        ax.annotate(f"{r.gflops:.1f}\nn={r.n}", (bar.get_x() + bar.get_width() / 2, r.gflops),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
    ax.scatter(x, [r.numpy_gflops for r in results], marker="_", s=900, color="black",
               zorder=3, label="numpy, same n and threads")
    for threads, style in ((1, "--"), (max(r.threads for r in results), ":")):
        peak = next((r.peak_gflops for r in results if r.threads == threads), None)
        if peak:
            ax.axhline(peak, color="gray", linestyle=style, linewidth=1,
                       label=f"measured FMA peak, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_yscale("log")
    ax.set_ylim(top=max(r.peak_gflops for r in results) * 2.5)
    ax.set_xticks(x, [f"{r.rung.number}\n" + textwrap.fill(r.rung.title, 14) for r in results],
                  fontsize=8)
    ax.set_ylabel("GFLOPS (log scale)")
    ax.set_title(f"The cache-blocking ladder {machine_label}".strip(), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    """``tilegemm ladder``: measure the ladder, print the table, write the chart.

    Returns the process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="tilegemm ladder",
        description="Measure seven GEMMs, from the naive loop to the library's threaded "
                    "engine, on this machine (float32, square n x n).")
    parser.add_argument("--n", type=int, default=1024,
                        help="matrix size (default 1024); a slow rung uses n halved until one "
                             f"call takes under {CALL_BUDGET} s")
    parser.add_argument("--out", default=".",
                        help="directory for ladder.png and ladder.md (default: current)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be positive")

    from tilegemm.tuning.machine import detect
    m = detect()
    blk = blocking(np.float32)
    print(f"{m.brand}: {m.isa}, L1d {m.l1d_bytes // 1024} KiB, L2 {m.l2_bytes // 1024} KiB "
          f"per core, {numba.get_num_threads()} threads")
    print(f"float32 blocking: MR={blk.mr} NR={blk.nr} KC={blk.kc} MC={blk.mc} NC={blk.nc}")
    print("measuring (compiles on first use) ...", flush=True)
    t0 = time.perf_counter()
    results = run_ladder(args.n, np.float32, log=lambda s: print(s, flush=True))
    table = format_table(results)
    print()
    print(table)
    notes = slower_notes(results)
    for note in notes:
        print(note)
    print(f"\nGFLOPS = 2n^3 / best time; % of peak against the measured FMA peak for the "
          f"thread count; ladder took {time.perf_counter() - t0:.0f} s.")
    if any(np.isnan(r.numpy_gflops) for r in results):
        print("numpy column empty: pip install threadpoolctl to limit numpy's threads",
              file=sys.stderr)
    warning = _busy_machine_warning(results)
    if warning:
        print(warning, file=sys.stderr)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ladder.md"), "w") as f:
        f.write(table + "\n" + "".join(f"\n{note}\n" for note in notes))
    try:
        plot(results, os.path.join(args.out, "ladder.png"), f"({m.isa}, {m.brand})")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"wrote {os.path.join(args.out, 'ladder.png')} and ladder.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
