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

Rungs 0-4 are plain Numba.  Rung 3 packs with the library's reference packers
:func:`tilegemm.packing.pack_a` / :func:`tilegemm.packing.pack_b`; rung 5 calls the
library's vector-IR packers of the same layouts and its ``macro_kernel`` (the jr and
ir loops around the vector-IR micro-kernel), and
rung 6 is :func:`tilegemm.kernels.driver.gemm_into` itself, so the last rungs measure
the library, not a copy of it.

Modules: :mod:`~tilegemm.ladder.rungs` (rungs 0-3, 5, 6),
:mod:`~tilegemm.ladder.register_tile` (rung 4 and its generated micro-kernel),
:mod:`~tilegemm.ladder.runner` (:func:`compute` by rung number, :func:`measure`),
:mod:`~tilegemm.ladder.table` (the table, notes, chart and :func:`main`).
"""
from tilegemm.ladder.register_tile import (make_register_tile, pack_columns,
                                           packed_register_tile, register_tile_kc,
                                           register_tile_nc, register_tile_shape,
                                           vector_bits)
from tilegemm.ladder.rungs import (LOCAL_MR, LOCAL_NR, blocked, library_micro_kernel,
                                   loop_ikj, naive_ijk, packed, threaded,
                                   tile_in_local_array)
from tilegemm.ladder.runner import (CALL_BUDGET, PROBE_N, RUNGS, BlockingCheck, Contention, Result,
                                    Rung, compute, measure, measure_blocking_check,
                                    measure_contention, run_ladder)
from tilegemm.ladder.table import (CHECK_BUDGET, SCALING_WARNING, SLOWER_BECAUSE, SLOWER_MARGIN,
                                   SPREAD_WARNING, blocking_check_n, blocking_reason,
                                   busy_machine_warning, contention_notes, format_table, main,
                                   past_l3_quarter, plot, slower_notes, smaller_n_notes,
                                   width_notes)

__all__ = [
    "naive_ijk", "loop_ikj", "blocked", "LOCAL_MR", "LOCAL_NR",
    "tile_in_local_array", "packed",
    "register_tile_shape", "make_register_tile", "pack_columns", "register_tile_kc",
    "register_tile_nc", "vector_bits", "packed_register_tile", "library_micro_kernel", "threaded",
    "Rung", "RUNGS", "compute", "CALL_BUDGET", "PROBE_N", "Result", "measure", "run_ladder",
    "Contention", "measure_contention", "contention_notes",
    "format_table", "SLOWER_BECAUSE", "SPREAD_WARNING", "SCALING_WARNING", "slower_notes",
    "SLOWER_MARGIN", "blocking_reason", "past_l3_quarter", "blocking_check_n", "CHECK_BUDGET",
    "BlockingCheck", "measure_blocking_check",
    "smaller_n_notes", "width_notes", "busy_machine_warning",
    "plot", "main",
]
