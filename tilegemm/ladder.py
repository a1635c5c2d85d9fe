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
4     :func:`packed_register_tile`  registers, in intent: an MR x NR tile of C
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

from tilegemm.config import JIT
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
def packed(a, b, c, MR, NR, KC, MC, NC, apack, bpack):
    """Rung 3: pack the A block and the B panel into contiguous micro-panels.

    Change: before they are used, the ``MC x KC`` block of A is copied into
    ``MR``-row micro-panels and the ``KC x NC`` panel of B into ``NR``-column
    micro-panels, both k-major (the reference packers of ``tilegemm.packing.pack``).
    The inner loops (jr, ir, then one ``MR x NR`` tile) now read memory strictly in order:
    one micro-panel of A (``MR*KC``) and one of B (``KC*NR``) together fit L1, the
    hardware prefetchers see plain streams and no access crosses a page needlessly.
    The copy costs O(mk + kn) per block against O(mnk) arithmetic.  The C tile is
    still read and written for every ``p``.  Buffers: ``apack >= ceil(MC/MR)*MR*KC``,
    ``bpack >= ceil(NC/NR)*NR*KC``; a, b, c C-contiguous.
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
                for jr in range(0, nc, NR):
                    for ir in range(0, mc, MR):
                        a_panel = apack[ir * kc:(ir + MR) * kc]
                        b_panel = bpack[jr * kc:(jr + NR) * kc]
                        for i in range(min(MR, mc - ir)):   # the MR x NR tile, clipped at edges
                            c_row = c[ic + ir + i, jc + jr:min(jc + jr + NR, n)]
                            for p in range(kc):
                                a_ip = a_panel[p * MR + i]
                                b_row = b_panel[p * NR:(p + 1) * NR]
                                for j in range(c_row.shape[0]):
                                    c_row[j] += a_ip * b_row[j]


# --------------------------------------------------------------------------- rung 4
@numba.njit(**JIT)
def register_tile(kc, a_panel, b_panel, c_tile, MR, NR):
    """The plain-Numba micro-kernel: ``c_tile += a_panel @ b_panel`` through a local tile.

    ``a_panel`` is one packed A micro-panel (``kc x MR``, k-major), ``b_panel`` one
    packed B micro-panel (``kc x NR``, k-major), both zero padded; ``c_tile`` is the
    (possibly clipped, at most ``MR x NR``) view of C.  The ``MR x NR`` sums are
    accumulated in ``acc`` for all ``kc`` steps and C is touched once at the end.
    """
    acc = np.zeros((MR, NR), c_tile.dtype)
    for p in range(kc):
        for i in range(MR):
            a_ip = a_panel[p * MR + i]
            for j in range(NR):
                acc[i, j] += a_ip * b_panel[p * NR + j]
    for i in range(c_tile.shape[0]):
        for j in range(c_tile.shape[1]):
            c_tile[i, j] += acc[i, j]


@numba.njit(**JIT)
def packed_register_tile(a, b, c, MR, NR, KC, MC, NC, apack, bpack):
    """Rung 4: rung 3's five loops with an ``MR x NR`` register tile of C.

    Change: the innermost work is :func:`register_tile`, which keeps the tile's
    sums in a local ``acc`` across the whole ``kc`` loop and adds them to C once,
    instead of a read-modify-write of the C tile for every ``p``.  The intent is
    the C tile in registers: ``MR + NR`` loads for ``MR*NR`` FMAs per ``p``.  Plain
    Numba gets only part of the way: the compiler cannot prove ``acc`` does not
    overlap the packed panels, so ``acc`` stays in L1 (a load and a store per
    FMA), and LLVM tunes this CPU for 256-bit vectors.  Rung 5 removes both limits.
    """
    m, k = a.shape
    n = b.shape[1]
    af, bf = a.reshape(-1), b.reshape(-1)
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
                        register_tile(kc, apack[ir * kc:(ir + MR) * kc],
                                      bpack[jr * kc:(jr + NR) * kc],
                                      c[ic + ir:ic + ir + MR, jc + jr:jc + jr + NR], MR, NR)


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
    """Pack buffers for one blocking, allocated once and reused (as the library does)."""
    apack = aligned_empty(-(-MC // MR) * MR * KC, dtype_name)
    bpack = aligned_empty(-(-NC // NR) * NR * KC, dtype_name)
    return apack, bpack


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
        Block sizes for rungs 2-5 (default ``blocking(dtype)``); tests pass small ones
        to exercise every loop on small matrices.  MR and NR must be the library's
        for rung 5.  Rung 6 always uses the library's own plan.

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
    blk = blk or blocking(a.dtype)
    MR, NR, KC, MC, NC = blk.mr, blk.nr, blk.kc, blk.mc, blk.nc
    apack, bpack = _buffers(a.dtype.name, MR, NR, KC, MC, NC)
    if number == 0:
        naive_ijk(a, b, c)
    elif number == 1:
        loop_ikj(a, b, c)
    elif number == 2:
        blocked(a, b, c, KC, MC, NC)
    elif number == 3:
        packed(a, b, c, MR, NR, KC, MC, NC, apack, bpack)
    elif number == 4:
        packed_register_tile(a, b, c, MR, NR, KC, MC, NC, apack, bpack)
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
    """One row of the ladder table (GFLOPS are best-of-runs rates)."""

    rung: Rung
    n: int
    threads: int
    gflops: float
    first_call_s: float
    numpy_gflops: float
    peak_gflops: float


def _operands(n, dtype):
    rng = np.random.default_rng(n)
    a = rng.uniform(-1, 1, (n, n)).astype(dtype)
    b = rng.uniform(-1, 1, (n, n)).astype(dtype)
    return a, b, np.empty((n, n), dtype)


def _best_seconds(call, min_runs=3, min_total=0.3, max_runs=20):
    """Best wall time of ``call()`` over a few runs (the minimum is the least disturbed)."""
    times = []
    while len(times) < min_runs or (sum(times) < min_total and len(times) < max_runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


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
    gflops = 2 * size ** 3 / _best_seconds(lambda: compute(rung.number, a, b, c)) / 1e9
    numpy = _numpy_gflops(size, dtype, threads, {} if numpy_cache is None else numpy_cache)
    peak = measured_peak_gflops(dtype, threads)
    if log:
        log(f"  rung {rung.number}: n={size}, {gflops:.1f} GFLOPS")
    return Result(rung, size, threads, gflops, first_call, numpy, peak)


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


def _busy_machine_warning(results):
    """A warning when the figures show another program sharing the cores, else None."""
    # (An n-thread peak below n x the 1-thread peak is not a sign of this by itself:
    # cores may share an FMA unit or drop their clock when all of them run 512-bit code.)
    for r in results:
        if r.gflops > r.peak_gflops:
            return (f"warning: rung {r.rung.number} ran above the measured peak, so the peak "
                    "was measured while another program used the cores; rerun when it is quiet")
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
        f.write(table + "\n")
    try:
        plot(results, os.path.join(args.out, "ladder.png"), f"({m.isa}, {m.brand})")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"wrote {os.path.join(args.out, 'ladder.png')} and ladder.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
