"""Template for the native shares of one GEMM kernel (``kernels/native.py``).

A product's shares reach pool threads as a C function and an argument block, so
that no thread takes the GIL.  Each kind of share has a jitted writer of its
blocks, run by the caller, and a reader, compiled as a C function on first use (a
process that never shares a product compiles neither); the reader calls the
kernel module's driver (``kernels/_tile.py``) the Python call would.
``tilegemm.kernels.registry`` writes one module per kernel from this file, as it
does from ``_tile.py``.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import c_entry, jit
from tilegemm.kernels.native import (SHARE, array_at, batch_at, bits_of, data_address, float_bits,
                                     operand_at, put_array, put_operand, put_range)
from tilegemm.kernels.registry import get_kernel

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
# --- end configuration ---

_DRIVERS = get_kernel(DTYPE, MR, NR, ISA).module
#: The writers allocate nothing: without reference counting, taking arrays out of
#: their tuples costs no atomic increments (and compiles faster).
JIT_NO_NRT = _DRIVERS.JIT_NO_NRT
gemm_tasks, gemm_serial, gemm_small = (_DRIVERS.gemm_tasks, _DRIVERS.gemm_serial,
                                       _DRIVERS.gemm_small)
gemv_product = _DRIVERS.gemv_product
batch_tasks = get_kernel(DTYPE, MR, NR, ISA).batches.batch_tasks


#: Slots of one product's description in a block (:func:`put_product`).
PRODUCT_SLOTS = 23


@numba.njit(inline='always', **JIT_NO_NRT)
def put_product(v, at, shape, scal, a, b, c, epilogue):
    """A product as :func:`gemm_serial` takes it, from ``v[at]`` on: ``m, n, k``,
    alpha and beta (float64 bits), the operands (five slots each), the bias (two),
    the epilogue flags."""
    v[at], v[at + 1], v[at + 2] = shape
    v[at + 3], v[at + 4] = bits_of(np.float64(scal[0])), bits_of(np.float64(scal[1]))
    put_operand(v, at + 5, a)
    put_operand(v, at + 10, b)
    put_operand(v, at + 15, c)
    put_array(v, at + 20, epilogue[0])
    v[at + 22] = epilogue[1]


@numba.njit(inline='always', **JIT_NO_NRT)
def product_at(v, at):
    """``(shape, scal, a, b, c, epilogue)`` as :func:`put_product` wrote them."""
    return ((v[at], v[at + 1], v[at + 2]),
            (DTYPE(float_bits(v[at + 3])), DTYPE(float_bits(v[at + 4]))),
            operand_at(v, at + 5, DTYPE), operand_at(v, at + 10, DTYPE),
            operand_at(v, at + 15, DTYPE), (array_at(v, at + 20, DTYPE), v[at + 22]))


#: Slots of a block of share_address("serial"), and its paths (the ``path`` slot).
SERIAL_SLOTS = 31
GEMV, UNPACKED, PACKED = 0, 1, 2


@numba.njit(**JIT_NO_NRT)
def serial_blocks(out, plan, scal, a, b, c, epilogue, packs):
    """Row ``t`` of ``out``: the argument block of share ``t`` of a product, one product
    on one thread (a block of C, or a slice of k), every row in one call (a row
    written from Python costs a microsecond, a small share's arithmetic).  ``plan``
    row ``t``: the path (GEMV, UNPACKED or PACKED), the share's m, n, k, the shifts
    of A's, B's and C's offsets and of the bias, and its KC, MC, NC; ``packs[2t]``,
    ``packs[2t + 1]`` are its buffers (GEMV: ``acc`` first).  Slots as
    :func:`serial_at` reads them: the path, :func:`put_product`, the blocks, the
    two buffers."""
    af, (a_off, a_rs, a_cs) = a
    bf, (b_off, b_rs, b_cs) = b
    cf, (c_off, c_rs, c_cs) = c
    bias, epi = epilogue
    for t in range(plan.shape[0]):
        p, v = plan[t], out[t]
        v[0] = p[0]
        put_product(v, 1, (p[1], p[2], p[3]), scal, (af, (a_off + p[4], a_rs, a_cs)),
                    (bf, (b_off + p[5], b_rs, b_cs)), (cf, (c_off + p[6], c_rs, c_cs)),
                    (bias[p[7]:], epi))
        v[24], v[25], v[26] = p[8], p[9], p[10]
        put_array(v, 27, packs[2 * t])
        put_array(v, 29, packs[2 * t + 1])


@numba.njit(**JIT_NO_NRT)
def matvec_blocks(out, mat, vec, y, vec_first, partial):
    """Row ``t`` of ``out``: the :func:`serial_blocks` (GEMV path) of thread ``t``'s part
    of ``y = mat @ vec`` (``vec @ mat`` with ``vec_first``), for a C-contiguous ``mat``
    and contiguous vectors; each share's output doubles as its scratch.

    ``mat @ vec``: equal parts of y in steps of 4 dot products, each share a block
    of whole rows.  ``vec @ mat``: equal parts of k, any size (the rows of ``mat``, so
    each share reads one contiguous block; a part of y's columns would read a part
    of every row), share 0 summing into y and share ``t`` into ``partial[(t-1)*n:]``,
    which the caller adds to y.  One call for every share: a share built by
    :func:`serial_blocks` from Python costs more than a small share's arithmetic.
    """
    threads = out.shape[0]
    rows, cols = mat.shape
    unit = 1 if vec_first else 4          # any cut of k; whole steps of 4 dot products
    step = ((rows + threads - 1) // threads + unit - 1) // unit * unit
    flat = mat.reshape(-1)
    one, zero = DTYPE(1), DTYPE(0)
    for t in range(threads):
        r0 = min(t * step, rows)
        size = min(step, rows - r0)
        v = out[t]
        v[0] = GEMV
        if vec_first:    # rows r0:r0+size of mat, as B of a 1 x cols product over them
            dest = y if t == 0 else partial[(t - 1) * cols:t * cols]
            put_product(v, 1, (1, cols, size), (one, zero), (vec, (r0, size, 1)),
                        (flat, (r0 * cols, cols, 1)), (dest, (0, cols, 1)), (dest, 0))
            put_range(v, 27, dest, 0, cols)
        else:            # rows r0:r0+size of mat, as A of a size x 1 product
            put_product(v, 1, (size, 1, cols), (one, zero), (flat, (r0 * cols, cols, 1)),
                        (vec, (0, 1, 1)), (y, (r0, 1, 1)), (y, 0))
            put_range(v, 27, y, r0, size)
        v[24], v[25], v[26] = 0, 0, 0
        v[29], v[30] = v[27], v[28]


@numba.njit(inline='always', **JIT_NO_NRT)
def serial_at(block):
    """``(path, shape, scal, (a, b, c), epilogue, blocks, packs)`` as
    :func:`serial_blocks` wrote them."""
    v = numba.carray(block, SERIAL_SLOTS)
    shape, scal, a, b, c, epilogue = product_at(v, 1)
    packs = (array_at(v, 27, DTYPE), array_at(v, 29, DTYPE))
    return v[0], shape, scal, (a, b, c), epilogue, (v[24], v[25], v[26]), packs


# One reader per path, so that a process compiles only the drivers its products take
# (the three together cost about 3 s of a first call); ``serial`` reads any path.
def _serial_packed_share(block):
    _, shape, scal, (a, b, c), epilogue, blocks, packs = serial_at(block)
    gemm_serial(shape, scal, a, b, c, epilogue, blocks, packs)


def _serial_unpacked_share(block):
    _, shape, scal, (a, b, c), epilogue, blocks, packs = serial_at(block)
    gemm_small(shape, scal, a, b, c, epilogue, blocks[0], packs)


def _serial_gemv_share(block):
    _, shape, scal, (a, b, c), epilogue, _, packs = serial_at(block)
    gemv_product(shape, scal, a, b, c, epilogue, packs[0])


def _serial_share(block):
    """One product on the path its block names, as a native share (see
    :func:`serial_blocks`): :func:`gemm_serial`, :func:`gemm_small` or :func:`gemv_product`."""
    path, shape, scal, (a, b, c), epilogue, blocks, packs = serial_at(block)
    if path == PACKED:
        gemm_serial(shape, scal, a, b, c, epilogue, blocks, packs)
    elif path == UNPACKED:
        gemm_small(shape, scal, a, b, c, epilogue, blocks[0], packs)
    else:
        gemv_product(shape, scal, a, b, c, epilogue, packs[0])


#: Slots of a block of share_address("gemm_tasks") (see ``kernels/native.py``).
SHARED_B_SLOTS = 34


@numba.njit(**JIT_NO_NRT)
def shared_b_blocks(out, counter, flags, shape, scal, a, b, c, epilogue, blocks, scratch):
    """Row ``t`` of ``out``: the argument block of share ``t`` of :func:`gemm_tasks`
    (arguments as there).  ``scratch`` = ``(buffer, b_len, a_len)``: the buffer
    holds the packed B (``b_len`` elements), then each share's A blocks (``a_len``)."""
    buf, b_len, a_len = scratch
    for t in range(out.shape[0]):
        v = out[t]
        put_array(v, 0, counter)
        put_array(v, 2, flags)
        put_product(v, 4, shape, scal, a, b, c, epilogue)
        v[27], v[28], v[29] = blocks
        put_range(v, 30, buf, b_len + t * a_len, a_len)
        put_range(v, 32, buf, 0, b_len)


def scratch_sizes(threads, first, second):
    """``(total, first, second)``: a scratch buffer of two buffers per share, of
    ``first`` and ``second`` elements, each rounded up to whole cache lines so that
    every share's buffers start one (:func:`shared_b_blocks`, :func:`batch_blocks`)."""
    line = 64 // np.dtype(DTYPE).itemsize
    first, second = -(-first // line) * line, -(-second // line) * line
    return threads * (first + second), first, second


def _gemm_tasks_share(block):
    """:func:`gemm_tasks` as a native share, its arguments read from ``block`` (as
    :func:`shared_b_blocks` writes them)."""
    v = numba.carray(block, SHARED_B_SLOTS)
    shape, scal, a, b, c, epilogue = product_at(v, 4)
    gemm_tasks(array_at(v, 0, np.int64), array_at(v, 2, np.int64), shape, scal,
               a, b, c, epilogue, (v[27], v[28], v[29]),
               (array_at(v, 30, DTYPE), array_at(v, 32, DTYPE)))


#: Slots of a block of share_address("batch") or ("batch_packed").
BATCH_SLOTS = 33


@numba.njit(**JIT_NO_NRT)
def batch_blocks(out, counter, chunk, batch, shape, a, b, c, KC, blocks, scratch):
    """Row ``t`` of ``out``: the argument block of share ``t`` of :func:`batch_tasks`
    (arguments as there).  ``scratch`` = ``(buffer, a_len, b_len)``: share ``t``'s A
    and B panels at ``t*(a_len + b_len)`` of the buffer."""
    dims, steps = batch
    buf, a_len, b_len = scratch
    for t in range(out.shape[0]):
        v = out[t]
        put_array(v, 0, counter)
        v[2] = chunk
        put_array(v, 3, dims)
        v[5], v[6] = data_address(steps), steps.size      # (3, len(dims)), C order
        v[7], v[8], v[9] = shape
        put_operand(v, 10, a)
        put_operand(v, 15, b)
        put_operand(v, 20, c)
        v[25] = KC
        if blocks is not None:
            v[26], v[27], v[28] = blocks
        put_range(v, 29, buf, t * (a_len + b_len), a_len)
        put_range(v, 31, buf, t * (a_len + b_len) + a_len, b_len)


def _batch_share(block):
    v = numba.carray(block, BATCH_SLOTS)
    batch_tasks(array_at(v, 0, np.int64), v[2], batch_at(v), (v[7], v[8], v[9]),
                operand_at(v, 10, DTYPE), operand_at(v, 15, DTYPE), operand_at(v, 20, DTYPE), v[25], None,
                (array_at(v, 29, DTYPE), array_at(v, 31, DTYPE)))


def _batch_packed_share(block):
    v = numba.carray(block, BATCH_SLOTS)
    batch_tasks(array_at(v, 0, np.int64), v[2], batch_at(v), (v[7], v[8], v[9]),
                operand_at(v, 10, DTYPE), operand_at(v, 15, DTYPE), operand_at(v, 20, DTYPE), v[25],
                (v[26], v[27], v[28]), (array_at(v, 29, DTYPE), array_at(v, 31, DTYPE)))


_SHARE_READERS = {"gemm_tasks": _gemm_tasks_share, "serial": _serial_share,
                  "serial_packed": _serial_packed_share, "serial_unpacked": _serial_unpacked_share,
                  "serial_gemv": _serial_gemv_share,
                  "batch": _batch_share, "batch_packed": _batch_packed_share}
_shares = {}


def share_address(kind):
    """The address of the native share ``kind`` (``"gemm_tasks"``: :func:`gemm_tasks`
    from a :func:`shared_b_blocks` block; ``"serial"``: one product from a
    :func:`serial_blocks` block, ``"serial_gemv"`` and so on: one on that path only;
    ``"batch"`` and ``"batch_packed"``: :func:`batch_tasks`
    on the unpacked or packed path from a :func:`batch_blocks` block), compiled (or
    loaded from the cache) on first use."""
    entry = _shares.get(kind)
    if entry is None:
        reader = jit(_SHARE_READERS[kind])
        # The dispatcher is kept: it holds the compiled code the address points into.
        entry = _shares[kind] = (reader, c_entry(reader, SHARE))
    return entry[1]
