"""Byte matrices transposed in 16 x 16 blocks of vector registers.

A quantized layer in NCHW reads its input channels-last and writes codes that go
back to channel planes: per image a C x (H*W) byte matrix transposed each way.
numpy's strided copy moves one byte at a time (ResNet-50's 256 x 56 x 56 input:
0.31 ms on the AVX-512 Xeon); here each 16 x 16 block is sixteen 16-byte loads, one
LLVM shuffle of the 256 bytes (a few ``vpermt2b`` with AVX512-VBMI, unpacks on
AVX2) and sixteen 16-byte stores: 0.036 ms (0.089 ms compiled for AVX2).
"""
import llvmlite.ir as ir
import numba
from numba import types
from numba.extending import intrinsic

from tilegemm.ground.contracts import JIT
from tilegemm.kernels.ir import data_ptr, shuffle

#: The block's side: 16 bytes, one SSE register a row.
BLOCK = 16

# Nothing allocated inside (the caller passes the output): no reference counting.
_kernel = numba.njit(**dict(JIT, _nrt=False))


def _concat(builder, rows):
    """The ``rows`` (vectors of one type) as one vector, by a tree of two-way shuffles."""
    while len(rows) > 1:
        width = 2 * rows[0].type.count
        rows = [shuffle(builder, rows[i], rows[i + 1], range(width))
                for i in range(0, len(rows), 2)]
    return rows[0]


@intrinsic
def transpose_block(typingctx, src, s_at, s_stride, dst, d_at, d_stride):
    """``dst[d_at + j*d_stride + i] = src[s_at + i*s_stride + j]`` for i, j < BLOCK
    (1-D C-contiguous byte arrays, any alignment)."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
               and a.dtype in (types.int8, types.uint8) for a in (src, dst)):
        return None      # a typing error: the pointer arithmetic assumes bytes in a run
    def emit(context, builder, sig, args):
        src, s_at, s_stride, dst, d_at, d_stride = args
        row = ir.VectorType(ir.IntType(8), BLOCK)
        rows = []
        for i in range(BLOCK):
            at = builder.add(s_at, builder.mul(s_stride, ir.Constant(s_stride.type, i)))
            ptr = builder.bitcast(data_ptr(context, builder, sig.args[0], src, at),
                                  row.as_pointer())
            rows.append(builder.load(ptr, align=1))
        block = _concat(builder, rows)
        undef = ir.Constant(block.type, ir.Undefined)
        moved = shuffle(builder, block, undef,
                        [(e % BLOCK) * BLOCK + e // BLOCK for e in range(BLOCK * BLOCK)])
        for j in range(BLOCK):
            line = shuffle(builder, moved, undef, range(j * BLOCK, (j + 1) * BLOCK))
            at = builder.add(d_at, builder.mul(d_stride, ir.Constant(d_stride.type, j)))
            ptr = builder.bitcast(data_ptr(context, builder, sig.args[3], dst, at),
                                  row.as_pointer())
            builder.store(line, ptr, align=1)
        return context.get_dummy_value()
    return types.void(src, types.intp, types.intp, dst, types.intp, types.intp), emit


@_kernel
def _transpose_matrix(src, s0, s_stride, dst, d0, d_stride, shape):
    """``dst[d0 + j*d_stride + i] = src[s0 + i*s_stride + j]`` for ``i < rows``, ``j <
    cols`` (``shape``, both at least BLOCK): BLOCK x BLOCK blocks a column of them at
    a time, so that the rows of ``dst`` each block writes are finished before it
    moves on (row by row of blocks ran 2.6x slower: each line of ``dst`` was written
    in four visits); a side that is not whole blocks ends with a block overlapping
    the one before (its bytes written twice, alike)."""
    rows, cols = shape
    for jb in range(0, cols, BLOCK):
        j0 = min(jb, cols - BLOCK)
        for ib in range(0, rows, BLOCK):
            i0 = min(ib, rows - BLOCK)
            transpose_block(src, s0 + i0 * s_stride + j0, s_stride, dst, d0 + j0 * d_stride + i0,
                            d_stride)


@_kernel
def transpose_bytes(src, dst, shape, n0, n1):
    """``dst[n, j, i] = src[n, i, j]`` for matrices ``n0 <= n < n1`` of ``shape = (rows,
    cols)`` (flat byte arrays, each matrix after the other), by
    :func:`_transpose_matrix` (ResNet-18's 14 x 14 x 256 codes, whose last 4 rows
    went byte by byte before the overlapping block, 3.6-3.8 -> 3.1-3.3 us); a side
    shorter than a block goes byte by byte."""
    rows, cols = shape
    for n in range(n0, n1):
        s0 = n * rows * cols
        if rows < BLOCK or cols < BLOCK:
            for j in range(cols):
                for i in range(rows):
                    dst[s0 + j * rows + i] = src[s0 + i * cols + j]
        else:
            _transpose_matrix(src, s0, cols, dst, s0, rows, shape)


@_kernel
def transpose_rows(src, dst, shape, step, n0, n1):
    """``dst[n, r, j, c] = src[n, c, r*step, j]`` for images ``n0 <= n < n1`` of the
    NCHW ``shape = (C, H, W)`` (flat byte arrays) and rows ``r`` below ``(H - 1) //
    step + 1``: every ``step``-th row of the image to channels-last, each row's C x W
    matrix by :func:`_transpose_matrix`.  A 1x1 layer of stride ``step`` reads no
    other row.  C and W at least BLOCK."""
    C, H, W = shape
    if C < BLOCK or W < BLOCK:
        raise ValueError("transpose_rows: C and W must be at least 16")
    rows = (H - 1) // step + 1
    for n in range(n0, n1):
        for r in range(rows):
            _transpose_matrix(src, (n * C * H + r * step) * W, H * W, dst,
                              (n * rows + r) * W * C, C, (C, W))
