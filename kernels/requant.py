"""The quantized convolution's epilogue: int32 sums to float32 or to requantized codes.

``y = acc * mult[k] + bias[k]``, then relu or relu6, then either y itself (float
output, computed in float64) or the code ``clip(rint(y / scale) + zero_point, low,
high)`` (round half to even, saturating), as ONNX's QLinearConv defines it
(computed in float32, the scale folded into mult and bias).  Shared by the
patch path (``conv/quantized.py``) and the taps drivers (``kernels/_int8.py``).

Both writers take flat arrays and offsets (one signature for every caller: a 2-D
slice of a block of pixels and a run of channels is an array of unknown strides to
Numba) and index row views by their loops' counters, which vectorises.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, jit

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
    (:func:`finish_rows`): ``clip(rint(total * mult + bias) + zero_point, low, high)``,
    ``limits = (zero_point, low, high, top)``, ``top`` the activation's upper clip
    over the scale (relu6), or infinite; the lower clip is ``-zero_point`` or
    ``-inf`` likewise."""
    zero_point, low, high, top, bottom = limits
    y = min(max(np.float32(total) * mult + bias, bottom), top)
    return min(max(np.rint(y) + zero_point, low), high)


@jit
def finish_rows(acc, a_at, a_stride, scales, k0, out, o_at, o_stride, shape):
    """The epilogue of ``shape = (rows, cols)`` sums into channels-last rows:
    ``out[o_at + r*o_stride + k]`` = the output of ``acc[a_at + r*a_stride + k]`` with
    channel ``k0 + k``'s ``scales = (mult, bias, act, requant)``; flat 1-D arrays.

    Codes are computed in float32 with the output scale folded into each channel's
    multiplier and bias, as onnxruntime requantizes (twice as fast as float64 with a
    division, 0.11 -> 0.05 ms for 3136 x 64 outputs here): the code can differ from
    float64's by one where y / scale lies within float32's rounding of a half.
    Float outputs stay in float64 until stored."""
    mult, bias, act, requant = scales
    rows, cols = shape
    scale, zero_point, low, high = requant
    if scale > 0.0:
        m = (mult[k0:k0 + cols] / scale).astype(np.float32)
        b = (bias[k0:k0 + cols] / scale).astype(np.float32)
        inf = np.float32(np.inf)
        limits = (np.float32(zero_point), np.float32(low), np.float32(high),
                  np.float32(6.0 / scale) if act == 2 else inf, np.float32(0.0) if act > 0 else -inf)
        for r in range(rows):
            # row views indexed by the loop's counter: no index of unknown sign, so the
            # loop vectorises (flat offsets in the loop did not)
            a, o = a_at + r * a_stride, o_at + r * o_stride
            src, dst = acc[a:a + cols], out[o:o + cols]
            for k in range(cols):
                dst[k] = code(src[k], m[k], b[k], limits)
        return
    m, b = mult[k0:k0 + cols], bias[k0:k0 + cols]
    for r in range(rows):
        a, o = a_at + r * a_stride, o_at + r * o_stride
        src, dst = acc[a:a + cols], out[o:o + cols]
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
