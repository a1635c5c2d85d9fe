"""Template for the batched products of one GEMM kernel: ``C_i = A_i @ B_i`` in compiled loops.

``tilegemm.kernels.registry`` writes one module per kernel from this file, as it
does from ``_tile.py`` (whose drivers run each item).  :func:`batch_tasks` is the
loop every batched launch runs, on pool threads through the native shares
(``_tile_shares.py``) or on the caller's thread through :func:`matmul_batched`,
the one-call entry of C-contiguous 3-D operands: for a batch of small products the
Python side of the general launch costs more than the arithmetic.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, imin, jit
from tilegemm.kernels.registry import get_kernel
from tilegemm.kernels.sync import next_task

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
# --- end configuration ---

_DRIVERS = get_kernel(DTYPE, MR, NR, ISA).module
gemm_serial, gemm_small = _DRIVERS.gemm_serial, _DRIVERS.gemm_small
overlap, copy_back = _DRIVERS.overlap, _DRIVERS.copy_back
NO_BIAS, ZERO, UNIT = _DRIVERS.NO_BIAS, _DRIVERS.ZERO, _DRIVERS.UNIT
JIT_NO_NRT = _DRIVERS.JIT_NO_NRT


@numba.njit(inline='always', **JIT)
def item_offsets(i, dims, steps, first):
    """The element offsets of batch item ``i`` (C order over ``dims``) in A, B and C:
    ``first[o] + sum(idx[d] * steps[o, d])``.  One batch dimension needs no division
    (an integer division costs about as much as an 8x8 item's k step)."""
    a_at, b_at, c_at = first
    if dims.size == 1:
        return a_at + i * steps[0, 0], b_at + i * steps[1, 0], c_at + i * steps[2, 0]
    for d in range(dims.size - 1, -1, -1):
        q = i % dims[d]
        i //= dims[d]
        a_at += q * steps[0, d]
        b_at += q * steps[1, d]
        c_at += q * steps[2, d]
    return a_at, b_at, c_at


@numba.njit(**JIT_NO_NRT)
def batch_tasks(counter, chunk, batch, shape, a, b, c, KC, blocks, packs):
    """Products of a batch, ``chunk`` at a time from ``counter``: ``C_i = A_i @ B_i``.

    ``batch`` is ``(dims, steps)``: the batch shape and, per operand (rows A, B, C),
    each batch dimension's stride in elements (0 where it is broadcast).  ``a``,
    ``b``, ``c`` are ``(flat, (offset, row_stride, col_stride))`` of item 0, as for
    ``gemm_serial``; ``shape`` is one item's ``(m, n, k)``.  With ``blocks``
    None each product takes the unpacked path (``gemm_small``, k blocks of
    ``KC``; B's columns contiguous), else the packed one (``gemm_serial`` with
    ``blocks``): Numba compiles only the branch the type of ``blocks`` selects.
    ``packs`` are the thread's ``(apack, bpack)``.
    """
    dims, steps = batch
    af, (a_off, a_rs, a_cs) = a
    bf, (b_off, b_rs, b_cs) = b
    cf, (c_off, ldc, _) = c
    count = 1
    for d in dims:
        count *= d
    scal = (DTYPE(1), DTYPE(0))
    while True:
        first = next_task(counter) * chunk
        if first >= count:
            break
        for i in range(first, imin(first + chunk, count)):
            a_at, b_at, c_at = item_offsets(i, dims, steps, (a_off, b_off, c_off))
            av = (af, (a_at, a_rs, a_cs))
            bv = (bf, (b_at, b_rs, b_cs))
            cv = (cf, (c_at, ldc, UNIT))
            if blocks is None:
                gemm_small(shape, scal, av, bv, cv, (NO_BIAS, ZERO), KC, packs)
            else:
                gemm_serial(shape, scal, av, bv, cv, (NO_BIAS, ZERO), blocks, packs)


@numba.njit(inline='always', **JIT)
def one_call_batch(a, b, c):
    """``(dst, batch, shape, a, b, c)`` of a one-call batch: ``dst`` is C, or a
    temporary where C shares memory with A or B; the rest as :func:`batch_tasks`
    takes them, each operand's batch step 0 where it has one item (broadcast)."""
    count, m, n = c.shape
    k = a.shape[2]
    dst = np.empty(c.shape, DTYPE) if overlap(c, a) or overlap(c, b) else c
    dims = np.full(1, count, np.int64)
    steps = np.empty((3, 1), np.int64)
    steps[0, 0] = m * k if a.shape[0] != 1 else 0
    steps[1, 0] = k * n if b.shape[0] != 1 else 0
    steps[2, 0] = m * n
    return (dst, (dims, steps), (m, n, k), (a.reshape(-1), (ZERO, k, UNIT)),
            (b.reshape(-1), (ZERO, n, UNIT)), (dst.reshape(-1), (ZERO, n, UNIT)))


@jit
def matmul_batched(a, b, c, plan):
    """``c[i] = a[i] @ b[i]`` on this thread in one call, each item unpacked.

    ``a`` ``(count or 1, m, k)``, ``b`` ``(count or 1, k, n)`` and ``c`` ``(count,
    m, n)`` C-contiguous, count, m, n, k >= 1; ``plan = (KC, 0, 0)``: the k block.
    """
    KC = plan[0]
    dst, batch, shape, av, bv, cv = one_call_batch(a, b, c)
    packs = (np.empty(MR * KC, DTYPE), np.empty(NR * KC, DTYPE))
    batch_tasks(np.zeros(1, np.int64), c.shape[0], batch, shape, av, bv, cv, KC, None, packs)
    copy_back(dst, c)


@jit
def matmul_batched_packed(a, b, c, plan):
    """:func:`matmul_batched` over packed panels, ``plan = (KC, MC, NC)`` the blocks
    (a function of its own: a batch in place never compiles the packed loops)."""
    KC, MC, NC = plan
    dst, batch, shape, av, bv, cv = one_call_batch(a, b, c)
    packs = (np.empty(MC * KC, DTYPE), np.empty(NC * KC, DTYPE))
    batch_tasks(np.zeros(1, np.int64), c.shape[0], batch, shape, av, bv, cv, KC, plan, packs)
    copy_back(dst, c)
