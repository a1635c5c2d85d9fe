"""Measured peak: an FMA-throughput loop built with the micro-kernels' IR toolkit,
and its int8 counterpart on the int8 kernels' dot-product step.

``chains`` independent vector accumulators, each updated by ``llvm.fma`` in a
counted loop with no memory traffic, so it runs at the FMA ports' throughput.
Reports and the ladder set every figure against it (the nominal peak, from the
spec sheet, is :func:`tilegemm.tuning.peak.nominal_peak_gflops`).
"""
import functools
import threading
import time

import llvmlite.ir as ir
import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.ground.contracts import JIT
from tilegemm.kernels.int8 import AMX_A, AMX_B, AMX_C, GROUP, amx_call, amx_configure, dot_step
from tilegemm.kernels.ir import fma, splat
from tilegemm.tuning.machine import detect
from tilegemm.tuning.peak import lanes_for


def fma_chains():
    """Independent accumulators in the peak loop: all the vector registers but two.

    Enough to cover FMA latency x ports on current cores (4 x 2 = 8), but never more
    than the register file holds: with 24 chains on a 16-register AVX2 core the
    loop spilled to the stack and measured 44 instead of 102 GFLOPS.
    """
    return min(24, detect().vector_registers - 2)


def _make_loop(nb_type, vec_of, step, add, chains):
    """An intrinsic ``loop(iters, x)``: ``chains`` vector accumulators, all set to x,
    each updated by ``step(builder, acc, x)`` every iteration; returns lane 0 of
    their sum (``add``), so that nothing is dead.  ``vec_of(context)`` is the vector
    type."""
    @intrinsic
    def loop(typingctx, iters, x):
        sig = nb_type(types.intp, nb_type)

        def codegen(context, builder, sig, args):
            iters, x = args
            xv = splat(builder, x, vec_of(context))
            acc = [cgutils.alloca_once_value(builder, xv) for _ in range(chains)]
            with cgutils.for_range(builder, iters):
                for slot in acc:
                    builder.store(step(builder, builder.load(slot), xv), slot)
            total = builder.load(acc[0])
            for slot in acc[1:]:
                total = add(builder, total, builder.load(slot))
            return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

        return sig, codegen

    return loop


def _make_fma_loop(nb_float, lanes, chains):
    return _make_loop(nb_float, lambda context: ir.VectorType(context.get_value_type(nb_float),
                                                              lanes),
                      lambda builder, acc, x: fma(builder, acc, x, x),
                      lambda builder, a, b: builder.fadd(a, b), chains)


@functools.lru_cache(maxsize=None)
def fma_kernel(dtype):
    """The jitted FMA loop for ``dtype``: ``kernel(iters, x)`` runs ``iters`` iterations of
    :func:`fma_chains` vector FMAs.  Built once per process (not cached on disk: a
    closure over the intrinsic)."""
    nb_float = numba.from_dtype(np.dtype(dtype))
    fma_loop = _make_fma_loop(nb_float, lanes_for(dtype), fma_chains())

    @numba.njit(**dict(JIT, cache=False))
    def run(iters, x):
        return fma_loop(iters, x)

    return run


def _make_dot_loop(kind, bits, chains):
    """The int8 counterpart of the FMA loop: each step is the int8 kind's dot-product
    step (``kernels/int8.py``).  The accumulator is also a factor: a product of loop
    invariants (x by x) would be hoisted, leaving only the adds to time."""
    return _make_loop(types.int32, lambda context: ir.VectorType(ir.IntType(32), bits // 32),
                      lambda builder, acc, x: dot_step(builder, kind, bits, acc, acc, x),
                      lambda builder, a, b: builder.add(a, b), chains)


def int8_chains(kind):
    """Accumulators of the int8 peak loop: :func:`fma_chains`, two fewer for ``maddubs``,
    whose step holds the ones and its pair sums in registers too (with 14 chains on
    the 16-register Zen 3 it measured 140 GOPS, with 12 179)."""
    return fma_chains() - (2 if kind == "maddubs" else 0)


@intrinsic
def _amx_loop(typingctx, iters, x):
    """The ``amx`` peak loop: per iteration the ``amx`` tile's four ``tdpbusd`` (2 x 2
    accumulator tiles, operand tiles loaded once: an AMX product's time does not depend
    on the values), between the tile configuration and its release."""
    def codegen(context, builder, sig, args):
        amx_configure(builder)
        for t in AMX_C + AMX_A + AMX_B:
            amx_call(builder, "tilezero", t)
        with cgutils.for_range(builder, args[0]):
            for i, ta in enumerate(AMX_A):
                for j, tb in enumerate(AMX_B):
                    amx_call(builder, "tdpbusd", AMX_C[2 * i + j], ta, tb)
        amx_call(builder, "tilerelease")
        return args[1]

    return types.int32(types.intp, types.int32), codegen


@functools.lru_cache(maxsize=None)
def int8_kernel(kind, bits):
    """The jitted int8 dot-product loop of ``(kind, bits)``: ``kernel(iters, x)``, as
    :func:`fma_kernel` (not cached on disk: a closure over the intrinsic)."""
    if kind == "amx":
        from tilegemm.kernels.qgemm import get_int8_kernel
        get_int8_kernel(kind, bits)     # refuses a process that may not run AMX

        @numba.njit(**dict(JIT, cache=False))
        def run_amx(iters, x):
            return _amx_loop(iters, x)

        return run_amx
    dot_loop = _make_dot_loop(kind, bits, int8_chains(kind))

    @numba.njit(**dict(JIT, cache=False))
    def run(iters, x):
        return dot_loop(iters, x)

    return run


def int8_ops_per_iteration(kind, bits):
    """Integer operations (a multiply and an add per product) of one iteration of
    :func:`int8_kernel`'s loop."""
    if kind == "amx":    # four 16 x 16 x 64 tile products
        return 4 * 16 * 16 * 64 * 2
    return int8_chains(kind) * (bits // 32) * GROUP[kind] * 2


def measured_int8_peak_gops(threads=1, kind=None, seconds=0.2):
    """The int8 dot-product throughput of this machine's int8 kernel (``vpdpbusd``,
    ``vpmaddwd``, ``vpmaddubsw`` or the generic pair products; ``kind`` a ``(kind,
    bits)``, default the host's), in GOPS, measured like
    :func:`measured_peak_gflops` and cached for the process."""
    from tilegemm.kernels.qgemm import int8_kind
    kind, bits = kind or int8_kind()
    key = ("int8", kind, bits, int(threads))
    with _measured_lock:
        if key in _measured:
            return _measured[key]
    single = measured_int8_peak_gops(1, (kind, bits), seconds) if threads > 1 else None
    with _measured_lock:
        if key not in _measured:
            _measured[key] = measure_peak(int8_kernel(kind, bits), np.int32, threads, seconds,
                                          single, ops=int8_ops_per_iteration(kind, bits))
        return _measured[key]


_measured = {}
_measured_lock = threading.Lock()


#: A several-thread peak below this share of ``threads`` x the one-thread peak is measured
#: again, up to ``PEAK_ATTEMPTS`` times in all, and the best kept: on a shared virtual
#: machine both threads can land on one host core for a while (a 2-thread float64
#: peak once came out at 49 GFLOPS, the one-thread figure, and GEMMs then ran at
#: "110% of peak").  What the machine still gives after that is what is reported.
PEAK_SCALING = 0.75
PEAK_ATTEMPTS = 3


def measured_peak_gflops(dtype=np.float32, threads=1, seconds=0.2):
    """FMA throughput measured on this machine, cached for the process.

    Parameters
    ----------
    dtype : numpy dtype, float32 or float64
    threads : int
        Threads running the loop at once (each on its own core when possible).
    seconds : float
        Approximate length of each timed run; the best of five is kept
        (the clock ramps and neighbours come and go, so the best is the peak).

    Returns
    -------
    float
        GFLOPS.
    """
    key = (np.dtype(dtype).name, int(threads))
    with _measured_lock:
        if key in _measured:
            return _measured[key]
    # Several threads are measured against one: see PEAK_ATTEMPTS.
    single = measured_peak_gflops(dtype, 1, seconds) if threads > 1 else None
    with _measured_lock:
        if key not in _measured:
            kernel = fma_kernel(np.dtype(dtype).type)
            _measured[key] = measure_peak(kernel, dtype, threads, seconds, single)
        return _measured[key]


def seconds_at_once(calls):
    """Wall time of running every one of ``calls`` at once: the first on this thread,
    each other on a Python thread of its own (as the engine shares work; the calls
    must release the GIL to run in parallel)."""
    workers = [threading.Thread(target=call) for call in calls[1:]]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    calls[0]()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def measure_peak(kernel, dtype, threads=1, seconds=0.2, single=None, ops=None):
    """The GFLOPS of ``kernel`` (:func:`fma_kernel`'s calling convention) run on
    ``threads`` threads at once, measured now (:func:`measured_peak_gflops` caches it).

    Parameters
    ----------
    kernel : callable
        ``kernel(iters, x)``, doing ``fma_chains() * lanes * 2`` flops an iteration.
    dtype : numpy dtype, float32 or float64
    threads : int
    seconds : float
        Approximate length of each timed run; the best of five is kept.
    single : float, optional
        The one-thread figure: a several-thread figure below ``PEAK_SCALING`` times
        ``threads`` times it is measured again, up to ``PEAK_ATTEMPTS`` times in all.
    ops : int, optional
        Operations of one iteration, for a loop of another kind (the int8 loop);
        default the FMA loop's flops.

    Returns
    -------
    float
        GFLOPS.
    """
    integer = np.dtype(dtype).kind == "i"
    x = np.dtype(dtype).type(1 if integer else 1e-8)
    flops_per_iter = ops or fma_chains() * lanes_for(dtype) * 2

    def run(iters):
        return seconds_at_once([functools.partial(kernel, iters, x)] * threads)

    run(1000)
    iters = 100_000
    while run(iters) < seconds / 4:
        iters *= 2
    best = float("inf")
    for _ in range(PEAK_ATTEMPTS):
        best = min(best, min(run(iters) for _ in range(5)))
        gflops = threads * iters * flops_per_iter / best / 1e9
        if single is None or gflops >= PEAK_SCALING * threads * single:
            break
    return gflops
