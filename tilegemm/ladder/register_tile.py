"""Rung 4 of the ladder: an ``MR x NR`` tile of C in registers, from plain Numba.

Plain Numba has no arrays in registers, so the tile's micro-kernel is generated
(:func:`make_register_tile`): one scalar sum per element of C, written out.
"""
import functools

import numba
import numpy as np

from tilegemm.ground.contracts import JIT, round_up
from tilegemm.packing import aligned_empty
from tilegemm.tuning.blocking import blocking


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
    to a multiple of ``NR``.

    A transpose, NR columns at a time: per row of B, NR neighbouring values go to the
    ends of NR column runs that each grow by one value, so every write lands in one
    of NR cache lines already in L1 (a whole row of B at a time scatters each row
    over ``nc`` lines: 3x slower at n = 1024).
    """
    for j in range(nc, round_up(nc, NR)):
        bpack[j * kc:(j + 1) * kc] = 0
    for jr in range(0, nc, NR):
        width = min(NR, nc - jr)
        for p in range(kc):
            row = b[b_off + p * ldb + jr:b_off + p * ldb + jr + width]
            for j in range(width):
                bpack[(jr + j) * kc + p] = row[j]


def register_tile_kc(MR, NR, itemsize):
    """Rung 4's KC: the ``NR`` packed columns of B in two thirds of L1d, reused by
    every ``MR`` rows of A streaming through the rest, rounded down to 64 values.

    Its tiles are narrow, so KC is much longer than the library's: each tile ends
    with its sums reduced across their vectors and added to C, and a long KC spreads
    that over more products (measured in docs/cache-blocking.md).
    """
    from tilegemm.tuning.machine import detect
    kc = detect().l1d_bytes * 2 // 3 // (NR * itemsize)
    return max(64, kc // 64 * 64)


def register_tile_nc(NR, KC, itemsize):
    """Rung 4's NC: the ``KC x NC`` panel of packed B columns in half of L2, a multiple
    of ``NR``.

    Its KC is long, so the library's NC (a panel sized for the library's short KC)
    would make the panel several times L2, and every ``MC`` block of A would fetch
    each micro-panel of B from L3 again.  A panel that stays in L2 is read from
    there by every A block (n = 1024: 3-4% faster on AVX-512).
    """
    from tilegemm.tuning.machine import detect
    nc = detect().l2_bytes // 2 // (KC * itemsize)
    return max(NR, nc // NR * NR)


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
    does, and needs no reduction.  ``KC`` defaults to :func:`register_tile_kc`, ``NC``
    to :func:`register_tile_nc`, ``MC`` to the library's.
    """
    m, k = a.shape
    n = b.shape[1]
    MR, NR = register_tile_shape(_vector_registers())
    blk = blocking(a.dtype)
    KC = KC or register_tile_kc(MR, NR, a.itemsize)
    MC, NC = MC or blk.mc, NC or register_tile_nc(NR, KC, a.itemsize)
    bpack = _column_buffer(a.dtype.name, NR, KC, min(NC, max(n, 1)))
    _register_tile_loops(a.reshape(-1), b.reshape(-1), c.reshape(-1), (m, n, k), (KC, MC, NC),
                         bpack, a.dtype.type(0), make_register_tile(MR, NR), (MR, NR))


@functools.lru_cache(maxsize=None)
def _column_buffer(dtype_name, NR, KC, NC):
    """Rung 4's packed columns of B: ``NC`` rounded up to ``NR`` columns of ``KC``."""
    return aligned_empty(round_up(NC, NR) * KC, dtype_name)


def vector_bits():
    """Width in bits of the vectors in rung 4's compiled tile, read from its machine
    code (512 when it uses zmm registers, 256 for ymm, else 128).

    The tile is plain Numba, so LLVM chooses the width: on many AVX-512 CPUs its
    tuning prefers 256-bit vectors in auto-vectorised loops, half the width of the
    FMAs the peak is measured with, which caps rung 4 at half the peak there.
    """
    tile = make_register_tile(*register_tile_shape(_vector_registers()))
    if not tile.signatures:
        one = np.ones(1, np.float32)
        tile(1, one, 0, 1, one, 0, one.copy(), 0, 1, 1, 1, np.float32(0))
    asm = "".join(tile.inspect_asm(sig) for sig in tile.signatures)
    return next((bits for bits, reg in ((512, "%zmm"), (256, "%ymm")) if reg in asm), 128)


def _vector_registers():
    from tilegemm.tuning.machine import detect
    return detect().vector_registers


@numba.njit(**dict(JIT, cache=False))
def _register_tile_loops(af, bf, cf, shape, blocks, bpack, zero, tile, tile_shape):
    """The jc, pc, ic, jr, ir loops of rung 4 around ``tile``; C zeroed first.

    ``shape`` is ``(m, n, k)``, ``blocks`` ``(KC, MC, NC)``, ``tile_shape`` ``(MR, NR)``.
    """
    m, n, k = shape
    KC, MC, NC = blocks
    MR, NR = tile_shape
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
