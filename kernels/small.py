"""The one-call path of small products: ``c = a @ b`` in a single jitted call.

The general entry (:func:`~tilegemm.kernels.driver.gemm_into`) spends several
microseconds in Python deciding paths and describing strides; a small C-contiguous
product has one path for its shape, chosen once (the register tile, in place or
packed: :func:`small_kernel`, :func:`one_call_plan`), with its scratch allocated in
the jitted call.  ``tilegemm.matmul`` finds the call by shape (``SMALL_CALLS``), and
a product that never takes a second thread by its compiled entry point
(``TINY_CALLS``, :mod:`tilegemm.kernels.tiny`).
"""
import math

from tilegemm.ground.contracts import round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.kernels.driver import (UNPACKED_FEW_ROWS, UNPACKED_KC, gemm_into, k_block,
                                     product_kernel, serial_flops, serial_plan)
from tilegemm.kernels.tiles import SMALL_ITEM, derived_tile, item_kernel, kernel_for
from tilegemm.kernels.registry import get_kernel
from tilegemm.kernels.tiny import SMALL_CALLS, TINY_FLOPS, entry_for, record_tiny
from tilegemm.tuning.blocking import blocking
from tilegemm.tuning.machine import detect


#: Products up to this many flops may take :func:`matmul_small` (past
#: :func:`serial_flops` only when the caller may use one thread: see
#: :func:`small_call_shape`).  On a Zen 3 (AVX2, one thread, two runs, numpy
#: alternated in each) float32 ran at 0.93-0.98x numpy's speed at 192^3 in one call
#: against 0.84x through :func:`gemm_into`, 0.96-0.97x against 0.90-0.94x at 256^3,
#: 0.97-0.99x against 0.92-0.94x at 320^3; from 384^3 on the two were within the noise.
SMALL_CALL_FLOPS = 2 * 320 ** 3

#: Up to this many flops a one-call product takes the tile and plan chosen for its
#: shape (:func:`small_kernel`, :func:`one_call_plan`); past it, those
#: :func:`gemm_into` takes on one thread, so that the one call changes nothing but
#: the Python side.
OWN_TILE_FLOPS = 2 * 160 ** 3


def small_product(a, b):
    """Whether ``a @ b`` (2-D, C-contiguous, same dtype) is small enough for :func:`matmul_small`."""
    m, k = a.shape
    n = b.shape[1]
    return m > 1 and n > 1 and k > 0 and small_call_shape(a.dtype, m, n, k)


def small_call_shape(dtype, m, n, k):
    """Whether an m x n x k product of ``dtype`` takes the one-call path: up to
    ``SMALL_CALL_FLOPS``, unless it is worth sharing (from :func:`serial_flops`, as
    :func:`gemm_into` decides) and this thread may use more than one thread (float64
    128^3 on a Zen 3, one process: 118 us on the one-call path, 94 us on two threads,
    numpy's two threads 59 us)."""
    flops = 2 * m * n * k
    if flops > SMALL_CALL_FLOPS:
        return False
    if flops <= NEVER_SHARED_FLOPS:      # the calls whose every microsecond shows
        return True
    return flops < serial_flops(dtype) or get_num_threads() == 1


#: Below :func:`serial_flops` on any core that runs these kernels (80 us of a core
#: of 1 GFLOPS nominal peak is 80 000 flops): no product this small is ever shared.
NEVER_SHARED_FLOPS = TINY_FLOPS


#: One-call products with more rows and columns than this take the GEMM's tile where
#: it pads at most a sixth of either (:func:`small_kernel`).  Its k loop keeps more
#: independent sums than the tiles that fit such shapes exactly, which run at the FMA
#: latency bound: on a Zen 3 (AVX2, one call, operands in cache), float32 4x16 took
#: 1.12-1.6x 6x16's time at 40-64 (1.32-1.6x at 64^3, where 6x16 pads 2 of 64 rows),
#: float64 4x8 1.13-1.53x 6x8's.  Batch items, whose operands come from memory,
#: keep their shape's tile (there the two were within 5%).
ONE_CALL_ITEM = 32


def small_kernel(dtype, m, n):
    """The kernel of a one-call small product of m x n (:func:`matmul_small`).

    Up to ``SMALL_ITEM`` rows and columns, the tile chosen for the shape
    (:func:`item_kernel`), unless both exceed ``ONE_CALL_ITEM`` and the GEMM's tile
    pads at most a sixth of them.  More than ``SMALL_ITEM`` columns, not a multiple
    of the GEMM tile's NR: a tile two vectors wide and up to 8 rows high: the GEMM
    tile would leave its last column panel to the edge kernels, whose packed panels
    cost a product this small up to a quarter of its time (float32 80^3 and 96^3 on
    AVX-512, docs/kernels.md).  With 16 registers that tile is the GEMM's own (6x16
    float32 on AVX2).
    """
    if m <= SMALL_ITEM and n <= SMALL_ITEM:
        if min(m, n) <= ONE_CALL_ITEM:
            return item_kernel(dtype, m, n)
        kern, blk = kernel_for(dtype, n)
        snug = 6 * round_up(m, kern.mr) <= 7 * m and 6 * round_up(n, kern.nr) <= 7 * n
        return (kern, blk) if snug and derived_tile(blk) else item_kernel(dtype, m, n)
    kern, blk = kernel_for(dtype, n)
    # (the default tile's derivation: kernel_for's own narrow and snug tiles are not)
    if not derived_tile(kernel_for(dtype)[1]) or n <= SMALL_ITEM or n % blk.nr == 0:
        return kern, blk                # narrow products keep kernel_for's narrow tile
    mr = min(8, (detect().vector_registers - 3) // 2)
    return get_kernel(dtype, mr, 2 * blk.lanes), blocking(dtype, mr=mr, nr=2 * blk.lanes)


def small_call(dtype, m, n, k):
    """``(call, plan)``: the compiled entry point (``kernels.tiny.entry_for``) of the
    jitted ``matmul_small`` (in place) or ``matmul_small_packed`` of the kernel for
    m x n products (:func:`small_kernel` up to ``OWN_TILE_FLOPS``), called ``call(a,
    b, c, plan)`` with 2-D operands of ``dtype``, c writeable (False, nothing
    computed, where they are not C-contiguous and aligned), and its plan for k
    (:func:`one_call_plan`); past ``OWN_TILE_FLOPS``, the GEMM's tile and the plan of
    :func:`gemm_into` on one thread (:func:`serial_plan`)."""
    if 2 * m * n * k <= OWN_TILE_FLOPS:
        kern, blk = small_kernel(dtype, m, n)
        plan = one_call_plan(kern, blk, m, n, k)
    else:       # the tile and plan gemm_into takes on one thread, without its Python side
        kern, blk = product_kernel(dtype, m, n)
        plan = serial_plan(kern, blk, m, n, k, (n, 1))[1]
    mod = kern.module
    return entry_for(mod.matmul_small_packed if plan[1] else mod.matmul_small, dtype, plan), plan


#: One-call products pack A and B from this many columns of tiles (and rows as many
#: NR) on: see :func:`one_call_plan`.
ONE_CALL_PACKED_PANELS = 12


def one_call_plan(kern, blk, m, n, k):
    """``(KC, MC, NC)`` of a one-call product: MC 0 for the unpacked path, else the
    packed five loops' blocks (whole MR and NR panels, the kernel's own tile).

    The unpacked path reads A in place once per column of tiles (n / NR times);
    packing costs a pass over A and B, less per flop the larger the product.  So
    the product packs when both m and n are at least ``ONE_CALL_PACKED_PANELS`` times
    NR (and m more than ``UNPACKED_FEW_ROWS``).  Measured on a Zen 3 (AVX2, 1 thread,
    ``matmul(a, b, out=c)`` and the jitted call alone, in place against packed, four
    to five runs, each alternated in one process): float64 (NR 8) packed ran 1.03-1.17x
    faster at 96^3, 1.08-1.24x at 128^3, 1.03-1.31x at 160^3, and at 64^3 0.94-1.15x;
    float32 (NR 16) at 112-160^3 0.85-1.41x, the winner changing from run to run with
    the machine's load (so a square float32 product stays in place up to 2*160^3).
    """
    KC = max(1, min(UNPACKED_KC, k))
    if min(m, n) < ONE_CALL_PACKED_PANELS * kern.nr or m <= UNPACKED_FEW_ROWS:
        return KC, 0, 0
    KC = k_block(k, blk.kc)
    MC = min(round_up(blk.mc, kern.mr), round_up(m, kern.mr))
    NC = min(round_up(blk.nc, kern.nr), round_up(n, kern.nr))
    return KC, MC, NC


def matmul_small(a, b, c):
    """``c = a @ b`` on one thread through a single jitted call; see :func:`small_product`.

    The general entry spends several microseconds in Python deciding paths and
    describing strides; a small C-contiguous product has one path for its shape,
    on the register tile chosen for it (:func:`small_kernel`; figures in
    docs/kernels.md).  Records the call in ``SMALL_CALLS`` for ``tilegemm.matmul``'s
    fast path.
    """
    key = (a.dtype, b.dtype, c.shape[0], c.shape[1], a.shape[1])
    call = SMALL_CALLS.get(key)
    if call is None:
        call = SMALL_CALLS[key] = small_call(c.dtype, *key[2:])
    if not call[0](a, b, c, call[1]):       # data not aligned to its items
        return gemm_into(a, b, c)
    record_tiny(call, a, b, c, one_thread_flops)
    return c


def one_thread_flops(dtype):
    """The largest product (2·m·n·k) that runs on one thread whatever the thread count:
    at least ``NEVER_SHARED_FLOPS``, up to :func:`serial_flops` and ``SMALL_CALL_FLOPS``.
    ``tilegemm.matmul`` calls those it has seen straight at their compiled entry
    (``kernels/tiny.py``); after changing ``SERIAL_FLOPS`` or ``SERIAL_SECONDS``,
    :func:`~tilegemm.kernels.driver.reset_plans` forgets them."""
    return max(NEVER_SHARED_FLOPS, min(SMALL_CALL_FLOPS, math.ceil(serial_flops(dtype)) - 1))
