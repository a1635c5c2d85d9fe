"""Data-movement kernels of the convolution paths: a masked row copy, an in-register
transpose and a stride-2 deinterleave (the Winograd transforms are in
:mod:`tilegemm.kernels.winograd`)."""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.extending import intrinsic

from tilegemm.kernels.ir import (NUMBA_FLOAT, data_ptr, lane_range, masked_load, masked_store,
                                 shuffle, vector_ptr)


def make_masked_copy(dtype, lanes, step=1):
    """Build the intrinsic copying up to ``lanes`` elements of an image row, zeros off the row.

    Signature (jitted code only)::

        masked_copy(x, src, first, W, buf, dst, count)

    For lanes ``l < count``: ``buf[dst + l] = x[src + l*step]`` when ``0 <= first + l*step
    < W`` (``first`` is the column of ``x[src]`` in its row of ``W`` pixels), else 0.
    Pixels off the row are never loaded and ``buf`` past ``count`` is untouched: the
    implicit im2col packer's stride-1 row segments, padding included, in one vector
    each.  ``step`` is 1 or 2 (two loads and an even-lane shuffle: a stride-2 row).
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]
    if step not in (1, 2):
        raise ValueError(f"masked_copy reads every pixel or every other one, not step={step}")

    def emit(context, builder, sig, args):
        x, src, first, W, buf, dst, count = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        zero_i = ir.Constant(intp, 0)
        x_ptr = data_ptr(context, builder, sig.args[0], x, zero_i)
        wanted = lane_range(builder, zero_i, zero_i, count, lanes)
        if step == 1:
            inside = builder.and_(wanted, lane_range(builder, first, zero_i, W, lanes))
            value = masked_load(builder, x_ptr, src, inside, vec)
        else:
            # Source elements j < 2*count - 1 of the row, in two vectors; keep the even ones.
            needed = builder.sub(builder.mul(count, ir.Constant(intp, 2)), ir.Constant(intp, 1))
            halves = []
            for h in range(2):
                at = ir.Constant(intp, h * lanes)
                mask = builder.and_(lane_range(builder, at, zero_i, needed, lanes),
                                    lane_range(builder, builder.add(first, at), zero_i, W, lanes))
                halves.append(masked_load(builder, x_ptr, builder.add(src, at), mask, vec))
            value = shuffle(builder, halves[0], halves[1], list(range(0, 2 * lanes, 2)))
        masked_store(builder, value, data_ptr(context, builder, sig.args[4], buf, zero_i), dst,
                      wanted)
        return context.get_dummy_value()

    @intrinsic
    def masked_copy(typingctx, x, src, first, W, buf, dst, count):
        i = types.intp
        return types.void(x, i, i, i, buf, i, i), emit

    masked_copy.__name__ = f"{np.dtype(dtype).char}_masked_copy_{lanes}"
    return masked_copy


def make_transpose(dtype, lanes):
    """Build the intrinsic transposing a ``lanes x lanes`` block between two arrays.

    Signature (jitted code only)::

        transpose(x, src, src_step, y, dst, dst_step)

    For ``i, j < lanes``: ``y[dst + j*dst_step + i] = x[src + i*src_step + j]``.  The
    rows are loaded as vectors and transposed in registers by ``log2(lanes)`` rounds of
    block swaps (round ``d`` swaps the ``d``-lane blocks off the diagonal of each
    ``2d x 2d`` block), then stored as vectors: no strided element copies.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize
    if lanes & (lanes - 1):
        raise ValueError(f"transpose needs a power-of-two vector width, got {lanes}")

    def emit(context, builder, sig, args):
        x, src, src_step, y, dst, dst_step = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = data_ptr(context, builder, sig.args[0], x, src)
        y_ptr = data_ptr(context, builder, sig.args[3], y, dst)
        rows = [builder.load(vector_ptr(builder, x_ptr, builder.mul(ir.Constant(intp, i),
                                                                      src_step), vec),
                             align=esize)
                for i in range(lanes)]
        d = lanes // 2
        while d:
            for r in range(lanes):
                if r & d:
                    continue
                a, b = rows[r], rows[r + d]
                rows[r] = shuffle(builder, a, b, [p if not p & d else lanes + p - d
                                                   for p in range(lanes)])
                rows[r + d] = shuffle(builder, a, b, [p + d if not p & d else lanes + p
                                                       for p in range(lanes)])
            d //= 2
        for j in range(lanes):
            builder.store(rows[j], vector_ptr(builder, y_ptr, builder.mul(ir.Constant(intp, j),
                                                                           dst_step), vec),
                          align=esize)
        return context.get_dummy_value()

    @intrinsic
    def transpose(typingctx, x, src, src_step, y, dst, dst_step):
        i = types.intp
        return types.void(x, i, i, y, i, i), emit

    transpose.__name__ = f"{np.dtype(dtype).char}_transpose_{lanes}"
    return transpose


def make_deinterleave(dtype, lanes):
    """Build the intrinsic splitting ``2*lanes`` consecutive elements into even and odd.

    Signature (jitted code only)::

        deinterleave(x, src, y, even, odd)

    For ``l < lanes``: ``y[even + l] = x[src + 2*l]`` and ``y[odd + l] = x[src + 2*l + 1]``:
    two plain loads, two shuffles, two plain stores.  A stride-2 row's two column
    phases in one pass, where a masked copy per phase read the row twice.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]
    esize = np.dtype(dtype).itemsize

    def emit(context, builder, sig, args):
        x, src, y, even, odd = args
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = data_ptr(context, builder, sig.args[0], x, src)
        y_ptr = data_ptr(context, builder, sig.args[2], y, ir.Constant(intp, 0))
        lo = builder.load(vector_ptr(builder, x_ptr, ir.Constant(intp, 0), vec), align=esize)
        hi = builder.load(vector_ptr(builder, x_ptr, ir.Constant(intp, lanes), vec), align=esize)
        for start, at in ((0, even), (1, odd)):
            builder.store(shuffle(builder, lo, hi, list(range(start, 2 * lanes, 2))),
                          vector_ptr(builder, y_ptr, at, vec), align=esize)
        return context.get_dummy_value()

    @intrinsic
    def deinterleave(typingctx, x, src, y, even, odd):
        i = types.intp
        return types.void(x, i, y, i, i), emit

    deinterleave.__name__ = f"{np.dtype(dtype).char}_deinterleave_{lanes}"
    return deinterleave
