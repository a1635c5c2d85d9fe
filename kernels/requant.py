"""The quantized convolution's epilogue: int32 sums to float32 or to requantized codes.

``y = acc * mult[k] + bias[k]``, then relu or relu6, then either y itself (float
output, computed in float64) or the code ``clip(rint(y / scale) + zero_point, low,
high)`` (round half to even, saturating), as ONNX's QLinearConv defines it
(computed in float32, the scale folded into mult and bias, where float32 holds
every term to well within a code: :func:`fold`; else in float64).  Shared by the
patch path (``conv/quantized.py``) and the taps drivers (``kernels/_int8.py``).

Both writers take flat arrays and offsets (one signature for every caller: a 2-D
slice of a block of pixels and a run of channels is an array of unknown strides to
Numba) and index row views by their loops' counters, which vectorises.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import CACHE, JIT, jit

#: Without fastmath: a division must divide (not multiply by a reciprocal) to round as
#: ONNX's QuantizeLinear does, and NaN must be seen.  Said explicitly: a jitted function
#: that leaves fastmath unset inherits its caller's (the taps driver's), and a sum
#: then rounded differently from the float32 steps it must equal.
exact = numba.njit(nogil=True, cache=CACHE, fastmath=False)

#: Activation codes of the epilogue.
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


@numba.njit(inline="always", **JIT)
def real_value(total, mult, bias, act):
    """One float output: ``y = total * mult + bias`` then relu or relu6 (``act`` 1 or
    2), in float64."""
    y = total * mult + bias
    if act > 0 and y < 0.0:
        y = 0.0
    if act == 2 and y > 6.0:
        y = 6.0
    return y


@numba.njit(inline="always", **JIT)
def code(total, mult, bias, limits):
    """One requantized output in float32, the scale folded into ``mult`` and ``bias``
    (:func:`fold`): ``rint(clip(total * mult + bias, bottom, top)) + zero_point`` with
    ``limits = (zero_point, low, high, top, bottom)``, where ``bottom`` and ``top`` are
    the activation's clips over the scale (0 and 6 / scale for relu6) narrowed to the
    codes' range less the zero point, so that no clip follows the rounding
    (``low``, ``high`` unused here)."""
    zero_point, low, high, top, bottom = limits
    y = min(max(np.float32(total) * mult + bias, bottom), top)
    return np.rint(y) + zero_point


#: :func:`fold` keeps float32 only while every term stays below this: float32's
#: rounding then moves y / scale by well under half a code.
FOLD_LIMIT = 2.0 ** 22


#: The epilogue's ``folded`` where the codes are computed in float64 (and of a float
#: output): empty arrays, :func:`fold`'s None as the jitted code takes it.
_EMPTY = np.zeros(0, np.float32)
NOT_FOLDED = (_EMPTY, _EMPTY, _EMPTY)


def fold(mult, bias, act, requant, sums_bound):
    """``(mult, bias, lim)`` in float32 with the output scale folded in (for
    :func:`code` and the taps kernel's codes tile), or None: float output, or terms
    that float32 would not hold to within a code (``sums_bound`` bounds |sum|; the
    float64 path with a division runs instead)."""
    scale, zero_point, low, high = requant
    if not scale > 0.0:
        return None
    with np.errstate(over="ignore"):
        m, b = (mult / scale).astype(np.float32), (bias / scale).astype(np.float32)
    largest = sums_bound * float(np.abs(m).max(initial=0)) + float(np.abs(b).max(initial=0))
    if not (np.isfinite(m).all() and np.isfinite(b).all() and largest < FOLD_LIMIT):
        return None
    # The codes' range folded into the activation's clips: with integers low - zero and
    # high - zero, clip(rint(clip(y, b, t)) + zero, low, high) = rint(clip(y, max(b,
    # low - zero), min(t, high - zero))) + zero (rint is monotonic and keeps integers),
    # two operations a code fewer.
    top = min(6.0 / scale if act == 2 else np.inf, high - zero_point)
    bottom = max(0.0 if act > 0 else -np.inf, low - zero_point)
    lim = np.array([zero_point, low, high, top, bottom], np.float32)
    return m, b, lim


@jit
def finish_rows(acc, a_at, a_stride, scales, k0, out, o_at, o_stride, shape):
    """The epilogue of ``shape = (rows, cols)`` sums into channels-last rows:
    ``out[o_at + r*o_stride + k]`` = the output of ``acc[a_at + r*a_stride + k]`` with
    channel ``k0 + k``'s ``scales = (mult, bias, act, requant, folded)``; flat 1-D
    arrays.

    Codes are computed in float32 when :func:`fold` gave ``folded = (mult, bias,
    lim)`` (the scale folded in, as onnxruntime requantizes: eight lanes and no
    division, 0.11 -> 0.05 ms for 3136 x 64 outputs here); a code can then differ
    from float64's by one where y / scale lies within float32's rounding of a half.
    Otherwise (empty ``folded`` arrays), and for float outputs, float64."""
    mult, bias, act, requant, (m32, b32, lim) = scales
    rows, cols = shape
    scale, zero_point, low, high = requant
    # Each mode its own loops (a test per row in one loop kept them scalar).
    if m32.size > 0:
        # in locals: loads from ``lim`` in the loop, which might alias ``out`` as far as
        # LLVM knows, would keep it scalar
        limits = (lim[0], lim[1], lim[2], lim[3], lim[4])
        m, b = m32[k0:k0 + cols], b32[k0:k0 + cols]
        for r in range(rows):
            # row views indexed by the loop's counter: no index of unknown sign, so
            # the loop vectorises (flat offsets in the loop did not)
            src = acc[a_at + r * a_stride:a_at + r * a_stride + cols]
            dst = out[o_at + r * o_stride:o_at + r * o_stride + cols]
            for k in range(cols):
                dst[k] = code(src[k], m[k], b[k], limits)
        return
    m, b = mult[k0:k0 + cols], bias[k0:k0 + cols]
    for r in range(rows):
        src = acc[a_at + r * a_stride:a_at + r * a_stride + cols]
        dst = out[o_at + r * o_stride:o_at + r * o_stride + cols]
        if scale > 0.0:
            for k in range(cols):
                y = real_value(src[k], m[k], b[k], act)
                dst[k] = min(max(np.rint(y / scale) + zero_point, low), high)
        else:
            for k in range(cols):
                dst[k] = real_value(src[k], m[k], b[k], act)


#: Pixels per block of :func:`finish_planes`: a block's values are computed row by row
#: into a small tile (vectorised along the channels), then written channel by channel,
#: each channel's run of the block a contiguous write.
PLANE_BLOCK = 32


@jit
def finish_planes(acc, a_stride, scales, k0, out, o_at, plane, shape):
    """The epilogue of ``shape = (pixels, cols)`` sums (``acc[p*a_stride + k]``) into
    channel planes, ``out[o_at + k*plane + p]`` (an NCHW output): per block of
    ``PLANE_BLOCK`` pixels, the values into a tile a pixel's channels at a time (as
    :func:`finish_rows`), then the tile transposed into the planes (value by value
    over all the pixels with a strided read of the sums, it ran 7x slower)."""
    P, cols = shape
    tile = np.empty(PLANE_BLOCK * cols, out.dtype)
    for p0 in range(0, P, PLANE_BLOCK):
        n = min(PLANE_BLOCK, P - p0)
        finish_rows(acc, p0 * a_stride, a_stride, scales, k0, tile, 0, cols, (n, cols))
        for k in range(cols):
            dst = out[o_at + k * plane + p0:o_at + k * plane + p0 + n]
            for i in range(n):
                dst[i] = tile[i * cols + k]


@exact
def add_codes(a, b, scales, zeros, relu, low, high, out):
    """``out = Q(DQ(a) + DQ(b))`` over 1-D runs of codes, exactly as ONNX's three float32
    steps (DequantizeLinear twice, Add, QuantizeLinear) compute it: ``scales = (a, b,
    out)`` and ``zeros`` likewise; ``relu`` between the sum and the rounding.  A QDQ
    model's residual sum: the network's QLinearAdd, and a conv's epilogue where the sum
    is fused into it (``kernels/_int8.py``)."""
    # In locals: loads from the arrays inside the loop, which might alias ``out`` as
    # far as LLVM knows, kept it scalar (5x slower).  Codes and zero points are
    # float32 exactly, and so their difference: float32 throughout lets the loop
    # vectorise (an integer difference is int64 in Numba, and int64 to float32 has
    # no AVX2 instruction: 4x slower).  Products near the float32 range can sum to
    # inf - inf: NaN gets the lowest code, as QuantizeLinear gives it.
    # The network writes a residual sum over one of its operands: LLVM's loop then
    # fails its runtime check that out and a do not overlap and runs the scalar loop
    # (0.57 against 0.085 ms on 200k codes).  Each block's sums go through a scratch
    # run instead, which overlaps nothing: both loops vectorise (on the blocks as
    # slices; indexed from i0 they did not).
    sa, sb, sy = scales[0], scales[1], scales[2]
    za, zb, zy = np.float32(zeros[0]), np.float32(zeros[1]), np.float32(zeros[2])
    floor = np.float32(0) if relu else np.float32(-np.inf)
    sums = np.empty(1024, np.float32)
    for i0 in range(0, out.size, 1024):
        count = min(1024, out.size - i0)
        ab, bb, ob = a[i0:i0 + count], b[i0:i0 + count], out[i0:i0 + count]
        for j in range(count):
            y = (np.float32(ab[j]) - za) * sa + (np.float32(bb[j]) - zb) * sb
            sums[j] = max(y, floor)
        for j in range(count):
            v = np.rint(sums[j] / sy) + zy
            # clipped first, then through int32: float to byte directly ran 1.12x slower
            ob[j] = np.int32(low if not v >= low else min(v, high))
