"""The matrix-vector path's vector-IR blocks: a dot product over rows, an axpy over columns."""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.ir import (NUMBA_FLOAT, data_ptr, fma, prefetch_line, reduce_add, splat,
                                 vector_ptr)

#: Bytes ahead of the current position that the matrix-vector loops prefetch the
#: matrix, per ISA (0: no prefetch).  The matrix streams from memory once.  On an
#: AVX-512 Zen 5, float32 4096x1x4096 on one thread went 17.5 -> 23 GFLOPS with 1 KiB
#: (numpy 18 in the same runs); on an AVX2 Zen 3 the hardware prefetchers do better
#: alone: 1 thread, ratio to numpy in the same process, three runs each, without ->
#: with: 4096x1x4096 0.98-1.07x -> 0.86-0.94x, 1000x1x1280 0.77-0.90x -> 0.67-0.81x,
#: 1x4096x4096 0.90-0.95x -> 0.85-0.92x.
GEMV_PREFETCH = {"avx512": 1024, "avx2": 0, "generic": 1024}


def make_gemv_kernels(dtype, lanes, rows=4, prefetch=0):
    """Vector-IR building blocks of the matrix-vector path, ``rows`` rows or columns at a time.

    Returns ``(dot, axpy)``, intrinsics callable from jitted code (``rows=1`` gives
    a single dot product):

    * ``dot(kv, m, m_off, m_rs, x, x_off, out, out_off)``: ``out[out_off + r] =
      sum_p M[r, p] * x[p]`` for ``r < rows`` and ``p < kv`` (``kv`` a multiple of
      ``lanes``); rows contiguous, ``m_rs`` apart.  Two accumulators per row keep
      enough FMAs in flight.
    * ``axpy(nv, m, m_off, m_cs, x, x_off, x_s, y, y_off)``: ``y[i] += sum_c
      M[i, c] * x[c]`` for ``c < rows`` columns (``m_cs`` apart, each contiguous)
      and ``i < nv`` (a multiple of ``lanes``).

    Both prefetch the matrix ``prefetch`` bytes ahead (0: not at all; see
    :data:`GEMV_PREFETCH`).
    """
    dtype = np.dtype(dtype).type

    def emit_dot(context, builder, sig, args):
        return _emit_dot(context, builder, sig, args, dtype, lanes, rows, prefetch)

    def emit_axpy(context, builder, sig, args):
        return _emit_axpy(context, builder, sig, args, dtype, lanes, rows, prefetch)

    @intrinsic
    def dot(typingctx, kv, m, m_off, m_rs, x, x_off, out, out_off):
        i = types.intp
        return types.void(i, m, i, i, x, i, out, i), emit_dot

    @intrinsic
    def axpy(typingctx, nv, m, m_off, m_cs, x, x_off, x_s, y, y_off):
        i = types.intp
        return types.void(i, m, i, i, x, i, i, y, i), emit_axpy

    return dot, axpy


def _emit_axpy(context, builder, sig, args, dtype, lanes, rows, prefetch):
    """``y[:nv] += M[:nv, :rows] @ x[:rows]`` (see make_gemv_kernels)."""
    nv, m, m_off, m_cs, x, x_off, x_s, y, y_off = args
    vec, intp = _vector_types(context, dtype, lanes)
    esize = np.dtype(dtype).itemsize
    m_ptr = data_ptr(context, builder, sig.args[1], m, m_off)
    x_ptr = data_ptr(context, builder, sig.args[4], x, x_off)
    y_ptr = data_ptr(context, builder, sig.args[7], y, y_off)
    cols = [builder.gep(m_ptr, [builder.mul(ir.Constant(intp, c), m_cs)]) for c in range(rows)]
    xs = [splat(builder, builder.load(builder.gep(x_ptr, [builder.mul(ir.Constant(intp, c), x_s)])), vec)
          for c in range(rows)]
    step = ir.Constant(intp, lanes)
    with cgutils.for_range(builder, builder.sdiv(nv, step)) as loop:
        i = builder.mul(loop.index, step)
        y_vec = vector_ptr(builder, y_ptr, i, vec)
        total = builder.load(y_vec, align=esize)
        at = builder.add(i, ir.Constant(intp, prefetch // esize))
        for c in range(rows):
            if prefetch:
                prefetch_line(builder, builder.gep(cols[c], [at]))
            mv = builder.load(vector_ptr(builder, cols[c], i, vec), align=esize)
            total = fma(builder, mv, xs[c], total)
        builder.store(total, y_vec, align=esize)
    return context.get_dummy_value()


def _emit_dot(context, builder, sig, args, dtype, lanes, rows, prefetch):
    """``out[r] = M[r, :kv] . x[:kv]`` for ``r < rows`` (see make_gemv_kernels)."""
    kv, m, m_off, m_rs, x, x_off, out, out_off = args
    vec, intp = _vector_types(context, dtype, lanes)
    esize = np.dtype(dtype).itemsize
    m_ptr = data_ptr(context, builder, sig.args[1], m, m_off)
    x_ptr = data_ptr(context, builder, sig.args[4], x, x_off)
    o_ptr = data_ptr(context, builder, sig.args[6], out, out_off)
    zero = ir.Constant(vec, [0.0] * lanes)
    acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(rows)]
    row_ptrs = [builder.gep(m_ptr, [builder.mul(ir.Constant(intp, r), m_rs)]) for r in range(rows)]
    step = ir.Constant(intp, 2 * lanes)
    pairs = builder.sdiv(kv, step)
    with cgutils.for_range(builder, pairs) as loop:
        base = builder.mul(loop.index, step)
        # The rows stream from memory: ask for their lines well before they are read.
        for r in range(rows if prefetch else 0):
            for half in range(2):
                at = builder.add(base, ir.Constant(intp, prefetch // esize + half * lanes))
                prefetch_line(builder, builder.gep(row_ptrs[r], [at]))
        for half in range(2):
            p = builder.add(base, ir.Constant(intp, half * lanes))
            xv = builder.load(vector_ptr(builder, x_ptr, p, vec), align=esize)
            for r in range(rows):
                mv = builder.load(vector_ptr(builder, row_ptrs[r], p, vec), align=esize)
                builder.store(fma(builder, mv, xv, builder.load(acc[r][half])), acc[r][half])
    with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, step), kv)):
        p = builder.mul(pairs, step)
        xv = builder.load(vector_ptr(builder, x_ptr, p, vec), align=esize)
        for r in range(rows):
            mv = builder.load(vector_ptr(builder, row_ptrs[r], p, vec), align=esize)
            builder.store(fma(builder, mv, xv, builder.load(acc[r][0])), acc[r][0])
    for r in range(rows):
        total = builder.fadd(builder.load(acc[r][0]), builder.load(acc[r][1]))
        builder.store(reduce_add(builder, total), builder.gep(o_ptr, [ir.Constant(intp, r)]))
    return context.get_dummy_value()


def _vector_types(context, dtype, lanes):
    """The LLVM vector of ``lanes`` floats of ``dtype``, and the index type."""
    fl = context.get_value_type(NUMBA_FLOAT[dtype])
    return ir.VectorType(fl, lanes), context.get_value_type(types.intp)
