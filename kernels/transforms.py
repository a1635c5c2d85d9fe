"""Data-movement kernels of the convolution paths: Winograd F(2x2, 3x3) input and output
transforms, a masked row copy, an in-register transpose and a stride-2 deinterleave."""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tilegemm.kernels.ir import (NUMBA_FLOAT, data_ptr, epi_flags, finish_scalar_bias,
                                 lane_range, masked_load, masked_store, shuffle, splat,
                                 vector_ptr)

# --- Winograd F(2x2, 3x3) transforms over a vector of tiles ----------------------------
#
# The convolution drivers lay the transformed input out as the GEMM's packed B, one tile
# per column, so `lanes` horizontally adjacent tiles of one channel form one vector.
# Reading an NCHW image along its contiguous width, a tile row's B^T d B is then a few
# vector loads, adds and even/odd shuffles per channel, and the output transform writes
# whole output rows: no scalar element handling anywhere.  Every load and store is
# masked, so image borders, short runs of tiles and padding need no special cases.


def make_winograd_input(dtype, lanes):
    """Build the intrinsic computing ``V = B^T d B`` for ``lanes`` adjacent tiles of one channel.

    Signature (jitted code only)::

        winograd_input(x, src, (s_row, H, W), (y0, col0, lo, hi), buf, dst, slab)

    The plane ``(s_row, H, W)`` and the window ``(y0, col0, lo, hi)`` are tuples of
    intp (unpacked in the IR, at no cost).  Tile lane ``l`` covers input rows ``y0 .. y0+3`` and columns ``col0+2l .. col0+2l+3``
    of one channel plane with contiguous rows ``s_row`` elements apart; ``src`` is the
    offset in ``x`` of (``y0``, ``col0``), which may lie outside the plane: pixels
    outside rows ``[0, H)`` or columns ``[0, W)`` read as zero and are never loaded.
    ``V[xi]`` for lanes ``lo <= l < hi`` is stored at ``buf[dst + xi*slab + l]``
    (xi = 4*row + column of the 4x4 transformed tile); other lanes of ``buf`` are untouched.
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        x, src, plane, window, buf, dst, slab = args
        s_row, H, W = cgutils.unpack_tuple(builder, plane, 3)
        y0, col0, lo, hi = cgutils.unpack_tuple(builder, window, 4)
        intp = context.get_value_type(types.intp)
        vec = ir.VectorType(context.get_value_type(nb_float), lanes)
        x_ptr = data_ptr(context, builder, sig.args[0], x, ir.Constant(intp, 0))
        buf_ptr = data_ptr(context, builder, sig.args[4], buf, dst)
        zero_i = ir.Constant(intp, 0)
        # Four loads per input row: columns col0+[0, 2*lanes) and col0+2+[0, 2*lanes).
        offsets = (0, lanes, 2, lanes + 2)
        col_masks = [lane_range(builder, builder.add(col0, ir.Constant(intp, o)), zero_i, W, lanes)
                     for o in offsets]
        rows = []
        for a in range(4):
            ya = builder.add(y0, ir.Constant(intp, a))
            inside = builder.and_(builder.icmp_signed(">=", ya, zero_i),
                                  builder.icmp_signed("<", ya, H))
            row_mask = splat(builder, inside, ir.VectorType(ir.IntType(1), lanes))
            start = builder.add(src, builder.mul(ir.Constant(intp, a), s_row))
            rows.append([masked_load(builder, x_ptr, builder.add(start, ir.Constant(intp, o)),
                                      builder.and_(m, row_mask), vec)
                         for o, m in zip(offsets, col_masks)])
        # B^T down the columns: t = (d0 - d2, d1 + d2, d2 - d1, d1 - d3), per loaded vector.
        d0, d1, d2, d3 = rows
        t = [[builder.fsub(d0[i], d2[i]) for i in range(4)],
             [builder.fadd(d1[i], d2[i]) for i in range(4)],
             [builder.fsub(d2[i], d1[i]) for i in range(4)],
             [builder.fsub(d1[i], d3[i]) for i in range(4)]]
        even = list(range(0, 2 * lanes, 2))
        odd = list(range(1, 2 * lanes, 2))
        store_mask = lane_range(builder, zero_i, lo, hi, lanes)
        for r in range(4):
            # Column b of every tile: b = 0, 1 from the loads at col0, b = 2, 3 from col0 + 2.
            e0 = shuffle(builder, t[r][0], t[r][1], even)
            e1 = shuffle(builder, t[r][0], t[r][1], odd)
            e2 = shuffle(builder, t[r][2], t[r][3], even)
            e3 = shuffle(builder, t[r][2], t[r][3], odd)
            # ... then B along the row.
            v = (builder.fsub(e0, e2), builder.fadd(e1, e2), builder.fsub(e2, e1),
                 builder.fsub(e1, e3))
            for b in range(4):
                offset = builder.mul(ir.Constant(intp, 4 * r + b), slab)
                masked_store(builder, v[b], buf_ptr, offset, store_mask)
        return context.get_dummy_value()

    @intrinsic
    def winograd_input(typingctx, x, src, plane, window, buf, dst, slab):
        i = types.intp
        sig = types.void(x, i, types.UniTuple(i, 3), types.UniTuple(i, 4), buf, i, i)
        return sig, emit

    winograd_input.__name__ = f"{np.dtype(dtype).char}_winograd_input_{lanes}"
    return winograd_input


def make_winograd_output(dtype, lanes):
    """Build the intrinsic computing ``Y = A^T m A`` + bias + activation for ``lanes`` tiles.

    Signature (jitted code only)::

        winograd_output(m, src, slab, out, dst, (s_row, Wo), (col0, rows, lo, hi), bias, epi)

    The output plane ``(s_row, Wo)`` and the run ``(col0, rows, lo, hi)`` are tuples
    of intp.  ``m[src + xi*slab + l]`` is position ``xi`` of tile lane ``l``'s 4x4 product
    (lanes contiguous).  Tile lane ``l`` writes output columns ``col0+2l`` and
    ``col0+2l+1`` of the row at ``out[dst]`` and, when ``rows == 2``, of the next row
    ``s_row`` elements further; only lanes ``lo <= l < hi`` and columns ``< Wo`` are
    written.  ``epi``: ``EPI_BIAS_ROW`` adds the scalar ``bias``, then ``EPI_RELU`` /
    ``EPI_RELU6`` as in the GEMM epilogue (NaN stays NaN).
    """
    dtype = np.dtype(dtype).type
    nb_float = NUMBA_FLOAT[dtype]

    def emit(context, builder, sig, args):
        m, src, slab, out, dst, plane, run, bias, epi = args
        s_row, Wo = cgutils.unpack_tuple(builder, plane, 2)
        col0, rows, lo, hi = cgutils.unpack_tuple(builder, run, 4)
        intp = context.get_value_type(types.intp)
        fl = context.get_value_type(nb_float)
        vec = ir.VectorType(fl, lanes)
        esize = np.dtype(dtype).itemsize
        m_ptr = data_ptr(context, builder, sig.args[0], m, src)
        out_ptr = data_ptr(context, builder, sig.args[3], out, dst)
        v = [builder.load(vector_ptr(builder, m_ptr, builder.mul(ir.Constant(intp, xi), slab), vec),
                          align=esize) for xi in range(16)]
        # A^T m: rows 0+1+2 and 1-2-3 of each 4x4 block, then the same along the columns.
        a = [builder.fadd(builder.fadd(v[j], v[4 + j]), v[8 + j]) for j in range(4)]
        b = [builder.fsub(builder.fsub(v[4 + j], v[8 + j]), v[12 + j]) for j in range(4)]

        def combine(r):
            return (builder.fadd(builder.fadd(r[0], r[1]), r[2]),
                    builder.fsub(builder.fsub(r[1], r[2]), r[3]))

        flags = epi_flags(builder, epi)
        bias_v = splat(builder, bias, vec)

        def finish(y):
            return finish_scalar_bias(builder, y, flags, bias_v)

        zero_i = ir.Constant(intp, 0)
        first = list(range(lanes // 2))
        for r, row in enumerate((combine(a), combine(b))):
            y0, y1 = finish(row[0]), finish(row[1])
            # Interleave the two output columns of every tile into one row of 2*lanes values.
            halves = (shuffle(builder, y0, y1, [i for l in first for i in (l, lanes + l)]),
                      shuffle(builder, y0, y1, [i for l in first for i in (lanes // 2 + l,
                                                                           lanes + lanes // 2 + l)]))
            row_off = zero_i if r == 0 else s_row
            wanted = builder.icmp_signed(">", rows, ir.Constant(intp, r))
            with builder.if_then(wanted):
                for h, half in enumerate(halves):
                    start = ir.Constant(intp, h * lanes)
                    # Position q of this half is output column col0 + start + q, tile lane (start+q)//2.
                    mask = builder.and_(
                        lane_range(builder, start, builder.mul(lo, ir.Constant(intp, 2)),
                                    builder.mul(hi, ir.Constant(intp, 2)), lanes),
                        lane_range(builder, builder.add(col0, start), zero_i, Wo, lanes))
                    masked_store(builder, half, out_ptr, builder.add(row_off, start), mask)
        return context.get_dummy_value()

    @intrinsic
    def winograd_output(typingctx, m, src, slab, out, dst, plane, run, bias, epi):
        i = types.intp
        sig = types.void(m, i, i, out, i, types.UniTuple(i, 2), types.UniTuple(i, 4), nb_float, i)
        return sig, emit

    winograd_output.__name__ = f"{np.dtype(dtype).char}_winograd_output_{lanes}"
    return winograd_output


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
