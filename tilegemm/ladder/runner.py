"""The rungs by number (:func:`compute`) and their measurement (:func:`measure`)."""
import functools
import time
from dataclasses import dataclass

import numba
import numpy as np

from tilegemm.ground.contracts import round_up
from tilegemm.kernels.peak import seconds_at_once
from tilegemm.kernels.registry import get_kernel
from tilegemm.ladder.register_tile import packed_register_tile
from tilegemm.ladder.rungs import (LOCAL_MR, LOCAL_NR, blocked, library_micro_kernel,
                                   loop_ikj, naive_ijk, packed, threaded)
from tilegemm.packing import aligned_empty
from tilegemm.tuning.blocking import blocking


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
    """Rungs 3 and 5's pack buffers for one tile and blocking, allocated once and
    reused (as the library does)."""
    apack = aligned_empty(round_up(MC, MR) * KC, dtype_name)
    bpack = aligned_empty(round_up(NC, NR) * KC, dtype_name)
    return apack, bpack


def _local_tile_mc(blk):
    """Rung 3's MC: rung 2's, a whole number of its ``LOCAL_MR``-row micro-panels.

    Its KC is rung 2's too.  A B micro-panel in half of L1d (KC = 64 on a 32 KiB
    L1d) ran no faster than rung 2 on an AVX2 EPYC: the sums' stores bound the tile
    whatever the cache B comes from, and a short KC repeats the tile's fixed cost
    (zeroing its sums, adding them to C) more often.  With the library's KC (512
    there) rung 3 ran 1.2-1.3x rung 2 timed interleaved, 0.87-1.13x in the ladder's
    own runs (docs/cache-blocking.md).
    """
    return max(LOCAL_MR, blk.mc // LOCAL_MR * LOCAL_MR)


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
    if number == 0:
        naive_ijk(a, b, c)
    elif number == 1:
        loop_ikj(a, b, c)
    elif number == 2:
        blocked(a, b, c, KC, MC, NC)
    elif number == 3:
        MC3 = _local_tile_mc(blk)
        packed(a, b, c, KC, MC3, NC, *_buffers(a.dtype.name, LOCAL_MR, LOCAL_NR, KC, MC3, NC))
    elif number == 4:
        if custom_blocks:
            packed_register_tile(a, b, c, KC, MC, NC)
        else:
            packed_register_tile(a, b, c)     # its own KC and NC (register_tile_kc/_nc)
    elif number == 5:
        mod = get_kernel(a.dtype, MR, NR).module
        one = a.dtype.type(1)
        library_micro_kernel(a, b, c, (KC, MC, NC), _buffers(a.dtype.name, MR, NR, KC, MC, NC),
                             mod.pack_a, mod.pack_b, mod.macro_kernel,
                             (MR, NR), (one, one - one))
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
    from tilegemm.kernels.peak import measured_peak_gflops
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


@dataclass
class Contention:
    """What ``threads`` cores give when each runs its own rung-5 product at once.

    The products share nothing, so what the cores lose running together is the
    host's (a shared L3 and memory bus, the clock a CPU holds with every core busy,
    a neighbour on a VM), not any threading's: rung 6 on the same host scales about
    as well, a little better when sharing one packed B saves it packing.
    ``scaling`` is the products' summed rate over one product alone.
    """

    threads: int
    n: int
    alone_gflops: float
    together_gflops: float

    @property
    def scaling(self):
        return self.together_gflops / self.alone_gflops


def measure_contention(n, threads, dtype=np.float32, rounds=5):
    """The :class:`Contention` of ``threads`` cores for rung 5 at size ``n``.

    One product alone and ``threads`` products at once are timed in alternating
    rounds, so that a neighbour that comes and goes weighs on both alike; the best
    time of each is kept, as for the rungs.
    """
    operands = [_operands(n, dtype) for _ in range(threads)]
    calls = [functools.partial(compute, 5, *ops) for ops in operands]
    seconds_at_once(calls)                      # compiles, touches every operand
    alone, together = [], []
    for _ in range(rounds):
        alone += _timed_runs(calls[0], min_runs=3, min_total=0.1, max_runs=10)
        together += [seconds_at_once(calls) for _ in range(3)]
    flops = 2 * n ** 3
    return Contention(threads, n, flops / min(alone) / 1e9, threads * flops / min(together) / 1e9)


@dataclass
class BlockingCheck:
    """Rungs 1 and 2 timed at a size ``n`` whose B is past a quarter of L3, where
    rung 1 waits on memory: what rung 2's blocking saves once there is something to
    save (see :func:`~tilegemm.ladder.table.blocking_reason`)."""

    n: int
    loop_gflops: float
    blocked_gflops: float


def measure_blocking_check(n, dtype=np.float32, rounds=2):
    """The :class:`BlockingCheck` at size ``n``: rungs 1 and 2 in alternating rounds
    (a neighbour that comes and goes weighs on both alike), best time of each."""
    a, b, c = _operands(n, dtype)
    loop, blocked_ = [], []
    for _ in range(rounds):
        loop += _timed_runs(lambda: compute(1, a, b, c), min_runs=1, min_total=0)
        blocked_ += _timed_runs(lambda: compute(2, a, b, c), min_runs=1, min_total=0)
    flops = 2 * n ** 3
    return BlockingCheck(n, flops / min(loop) / 1e9, flops / min(blocked_) / 1e9)


def run_ladder(n=1024, dtype=np.float32, log=None):
    """Measure every rung; returns a list of :class:`Result`, in rung order."""
    numpy_cache = {}
    return [measure(r, n, dtype, numpy_cache, log) for r in RUNGS]
