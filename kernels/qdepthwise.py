"""int8 depthwise convolution, channels-last: lanes over channels, int32 sums.

A depthwise layer (one input and one output channel per group) has no product to
pack: each output value is a sum of kh*kw products of one channel.  Per output row
the sums of every pixel and channel go into a row of int32 -- the inner loop over a
pixel's contiguous channels, so it vectorises -- then the requantizing epilogue
(``kernels/requant.py``) writes the row.  A 3x3 kernel's pixels whose taps all lie
inside the image take their nine products in one pass (:func:`_nine_taps`, 16
channels at a time in explicit vectors, :func:`nine_taps16`: one store per sum);
the others, and other kernels, tap by tap.  The weights, int32 ``(kh*kw, C)``, stay
in L1.  On MobileNetV2's 144-channel 56 x 56 layer, per output row, tap by tap over
whole rows with the weights repeated per pixel (a stream of 9 x 32 KB) took 7.9 us;
per pixel 5.7, the nine taps at once in Numba's loop (256-bit) 5.9, in 512-bit
vectors 4.4 (AVX-512 Xeon).  The patches path (one GEMM of k = kh*kw per channel,
called per group from Python) had cost these layers 10-24 ms each.  Exact: |x -
zero| <= 255 times |w| <= 128 times kh*kw taps fits int32 for any kernel the
overflow bound admits.
"""
import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.extending import intrinsic

from tilegemm.ground.contracts import jit
from tilegemm.kernels.ir import data_ptr, splat
from tilegemm.kernels.requant import finish_planes, finish_rows
from tilegemm.kernels.sync import publish


@jit
def qdepthwise_rows(x, zero, w, geom, blocks, epilogue, out, acc, gate):
    """Output rows of a depthwise convolution of the NHWC int8/uint8 ``x`` (zero point
    ``zero``) into ``out`` (NHWC, or NCHW with ``geom[-1]``), through the epilogue
    ``epilogue = (mult, bias, act, requant, folded)`` (``kernels/requant.py``): per row
    ``(n, oy0, oy1)`` of ``blocks`` (int64), rows ``oy0:oy1`` of image ``n``.  One
    thread's share in one call.

    ``w``: int32 ``(kh*kw, C)``, tap ``r*kw + s`` of channel c at ``w[r*kw + s, c]``.
    ``geom = (Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, nchw)``.  ``acc``: int32 room
    for ``Wo * C`` sums and then ``W * C`` bytes (a row of the zero point, for rows
    outside the image).  ``gate``: as ``kernels/_int8.py`` :func:`qconv_taps_blocks`'s."""
    publish(gate, 0, 1)
    flat = out.reshape(-1)
    WC = x.shape[2] * x.shape[3]
    sums = acc[:geom[1] * x.shape[3]]
    zeros = acc[geom[1] * x.shape[3]:].view(x.dtype)[:WC]
    zeros[:] = zero
    for b in range(blocks.shape[0]):
        _image_rows(x, zero, w, geom, (blocks[b, 0], blocks[b, 1], blocks[b, 2]), epilogue,
                    flat, (sums, zeros))


@jit
def _image_rows(x, zero, w, geom, rows, epilogue, flat, scratch):
    """Rows ``rows = (n, oy0, oy1)`` of :func:`qdepthwise_rows` (``flat``: the output,
    flat; ``scratch = (sums, zeros)``: room for a row's sums, a row of zero points)."""
    Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, nchw = geom
    n, oy0, oy1 = rows
    H, W, C = x.shape[1], x.shape[2], x.shape[3]
    sums, zeros = scratch
    # the output columns whose kw taps all lie inside the image
    inner0 = min(Wo, max(0, -(-left // sx)))
    inner1 = max(inner0, min(Wo, (W - 1 - (kw - 1) * dx + left) // sx + 1))
    for oy in range(oy0, oy1):
        if kh == 3 and kw == 3 and inner1 > inner0:
            lines = (_line(x, n, oy * sy - top, zeros), _line(x, n, oy * sy - top + dy, zeros),
                     _line(x, n, oy * sy - top + 2 * dy, zeros))
            _nine_taps(lines, w, zero, (inner0, inner1, C, sx, dx, left), sums)
            sums[:inner0 * C] = 0
            sums[inner1 * C:] = 0
            edges = ((0, inner0), (inner1, Wo))
        else:
            sums[:] = 0
            edges = ((0, Wo), (Wo, Wo))
        for r in range(kh):
            iy = oy * sy - top + r * dy
            if iy < 0 or iy >= H:
                continue
            line = x[n, iy].reshape(-1)
            for s in range(kw):
                # the output columns whose input column lies inside the image
                ox0 = max(0, -((s * dx - left) // sx))
                ox1 = min(Wo, (W - 1 - s * dx + left) // sx + 1)
                for e0, e1 in edges:
                    _one_tap(line, w[r * kw + s], (max(ox0, e0), min(ox1, e1), C, sx,
                                                   s * dx - left), zero, sums)
        if nchw:
            finish_planes(sums, C, epilogue, 0, flat, n * C * Ho * Wo + oy * Wo, Ho * Wo,
                          (Wo, C))
        else:
            finish_rows(sums, 0, C, epilogue, 0, flat, (n * Ho + oy) * Wo * C, C, (Wo, C))


@jit
def _line(x, n, iy, zeros):
    """Row ``iy`` of image ``n`` as one run of pixels, or the zero points' row outside
    the image (it adds nothing)."""
    if 0 <= iy < x.shape[1]:
        return x[n, iy].reshape(-1)
    return zeros


#: Channels per :func:`nine_taps16`: one 512-bit vector of int32 sums (two on AVX2).
LANES = 16


@intrinsic
def nine_taps16(typingctx, lines, at, steps, w, w_at, zero, dst, d_at):
    """``dst[d_at:d_at + LANES]`` = the nine products of a 3x3 kernel for LANES channels
    of one output pixel, in int32: ``lines`` the three input rows (1-D int8/uint8),
    the pixel's first tap at ``at`` in each, the others ``steps = (b1, b2)`` further;
    ``w`` the int32 weights flat, tap t's LANES channels at ``w_at[0] + t * w_at[1]``;
    ``zero`` taken off every input value.  Explicit vectors: Numba's loops ran on
    256-bit vectors, a multiply per 8 channels."""
    def run_of(a, dtypes):
        return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in dtypes
    if not (isinstance(lines, types.UniTuple) and len(lines) == 3
            and run_of(lines.dtype, (types.int8, types.uint8))
            and run_of(w, (types.int32,)) and run_of(dst, (types.int32,))):
        return None      # a typing error: the pointer arithmetic assumes these runs

    def emit(context, builder, sig, args):
        lines_v, at_v, steps_v, w_v, w_at_v, zero_v, dst_v, d_at_v = args
        line_type = sig.args[0].dtype
        i32 = ir.IntType(32)
        row, sums = ir.VectorType(ir.IntType(8), LANES), ir.VectorType(i32, LANES)
        widen = builder.sext if line_type.dtype.signed else builder.zext
        zeros = splat(builder, zero_v, sums)
        offsets = (None, builder.extract_value(steps_v, 0), builder.extract_value(steps_v, 1))
        w0, w_step = builder.extract_value(w_at_v, 0), builder.extract_value(w_at_v, 1)
        acc = None
        for r in range(3):
            line = builder.extract_value(lines_v, r)
            for s, off in enumerate(offsets):
                spot = at_v if off is None else builder.add(at_v, off)
                ptr = builder.bitcast(data_ptr(context, builder, line_type, line, spot),
                                      row.as_pointer())
                x = builder.sub(widen(builder.load(ptr, align=1), sums), zeros)
                tap = builder.add(w0, builder.mul(w_step, ir.Constant(w_step.type, 3 * r + s)))
                wptr = builder.bitcast(data_ptr(context, builder, sig.args[3], w_v, tap),
                                       sums.as_pointer())
                term = builder.mul(x, builder.load(wptr, align=4))
                acc = term if acc is None else builder.add(acc, term)
        out = builder.bitcast(data_ptr(context, builder, sig.args[6], dst_v, d_at_v),
                              sums.as_pointer())
        builder.store(acc, out, align=4)
        return context.get_dummy_value()
    return types.void(lines, types.intp, types.UniTuple(types.intp, 2), w,
                      types.UniTuple(types.intp, 2), types.int32, dst, types.intp), emit


@jit
def _nine_taps(lines, w, zero, run, sums):
    """``sums`` of output pixels ``ox0:ox1`` = a 3x3 kernel's nine products (``lines``:
    the three input rows; ``run = (ox0, ox1, C, sx, dx, left)``), each sum stored
    once.  Every tap of these pixels lies inside the rows."""
    ox0, ox1, C, sx, dx, left = run
    c16, w_flat = C // LANES * LANES, w.reshape(-1)
    b1, b2 = max(0, dx * C), max(0, 2 * dx * C)     # max: LLVM knows them not negative
    for ox in range(ox0, ox1):
        for c0 in range(0, c16, LANES):
            nine_taps16(lines, (ox * sx - left) * C + c0, (b1, b2), w_flat, (c0, C), zero,
                        sums, ox * C + c0)
    if c16 == C:
        return
    l0, l1, l2 = lines
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
    for ox in range(ox0, ox1):    # the last channels, fewer than LANES
        # views indexed by the loop's counter and offsets LLVM knows are not negative:
        # with flat offsets, or dx * C (of unknown sign, so each read kept its
        # wraparound test), this loop stayed scalar (34-47 against 5.8 us a row of 144
        # channels, when it took every channel)
        a0 = (ox * sx - left) * C
        p0, p1 = l0[a0:a0 + (2 * dx + 1) * C], l1[a0:a0 + (2 * dx + 1) * C]
        p2, d = l2[a0:a0 + (2 * dx + 1) * C], sums[ox * C:(ox + 1) * C]
        for c in range(c16, C):     # int32 throughout: it vectorises
            t = np.int32(np.int32(p0[c]) - zero) * w0[c]
            t += np.int32(np.int32(p0[b1 + c]) - zero) * w1[c]
            t += np.int32(np.int32(p0[b2 + c]) - zero) * w2[c]
            t += np.int32(np.int32(p1[c]) - zero) * w3[c]
            t += np.int32(np.int32(p1[b1 + c]) - zero) * w4[c]
            t += np.int32(np.int32(p1[b2 + c]) - zero) * w5[c]
            t += np.int32(np.int32(p2[c]) - zero) * w6[c]
            t += np.int32(np.int32(p2[b1 + c]) - zero) * w7[c]
            t += np.int32(np.int32(p2[b2 + c]) - zero) * w8[c]
            d[c] = t


@jit
def _one_tap(line, tap, run, zero, sums):
    """``sums`` += one tap over output pixels ``ox0:ox1`` (``run = (ox0, ox1, C, sx,
    shift)``: pixel ox reads input column ``ox*sx + shift`` of the row ``line``), pixel
    by pixel (a tap's whole run at once needed its weights repeated per pixel: a
    stream from L2 that cost more than the products)."""
    ox0, ox1, C, sx, shift = run
    for ox in range(ox0, ox1):
        src, dst = line[(ox * sx + shift) * C:(ox * sx + shift + 1) * C], sums[ox * C:(ox + 1) * C]
        for c in range(C):
            dst[c] += np.int32(np.int32(src[c]) - zero) * tap[c]
