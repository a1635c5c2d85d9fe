"""The quantized convolution's epilogue: int32 sums to float32 or to requantized codes.

``y = acc * mult[k] + bias[k]`` in float64, then relu or relu6, then either y
itself (float output) or the code ``clip(rint(y / scale) + zero_point, low, high)``
(round half to even, saturating), as ONNX's QLinearConv defines it.  Shared by the
patch path (``conv/quantized.py``) and the taps drivers (``kernels/_int8.py``).
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, jit

#: Activation codes of :func:`finish`.
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


@numba.njit(inline="always", **JIT)
def requantize(total, mult, bias, act, requant):
    """One output of :func:`finish`, as float64."""
    scale, zero_point, low, high = requant
    y = total * mult + bias
    if act > 0 and y < 0.0:
        y = 0.0
    if act == 2 and y > 6.0:
        y = 6.0
    if scale > 0.0:
        return min(max(np.rint(y / scale) + zero_point, low), high)
    return y


@jit
def finish(acc, mult, bias, act, requant, out):
    """``out = epilogue(acc)`` for ``acc`` and ``out`` pixels x channels: ``y = acc *
    mult[k] + bias[k]``, relu or relu6 (``act`` 1 or 2), then with ``requant =
    (scale, zero_point, low, high)`` and ``scale > 0`` the code ``clip(rint(y / scale)
    + zero_point, low, high)``, else y itself; in float64."""
    P, Kg = acc.shape
    for p in range(P):
        for k in range(Kg):
            out[p, k] = requantize(acc[p, k], mult[k], bias[k], act, requant)


#: Pixels per block of :func:`finish_planes`: their sums (``PLANE_BLOCK x Kg`` int32)
#: stay in L1 while every channel's run of them is written.
PLANE_BLOCK = 16


@jit
def finish_planes(acc, mult, bias, act, requant, out, at, plane):
    """:func:`finish` into channel planes: the sums ``acc`` (pixels x channels) of
    consecutive pixels, written to the flat ``out`` at ``out[at + k * plane + p]``
    (an NCHW output).  Pixels go in blocks of ``PLANE_BLOCK`` so that each channel's
    run is a contiguous write and the block's sums are read from L1 (channel by
    channel over all the pixels, each value read cost a cache line: 2x slower)."""
    P, Kg = acc.shape
    for p0 in range(0, P, PLANE_BLOCK):
        p1 = min(p0 + PLANE_BLOCK, P)
        for k in range(Kg):
            base = at + k * plane
            for p in range(p0, p1):
                out[base + p] = requantize(acc[p, k], mult[k], bias[k], act, requant)
