"""int8 depthwise convolution, channels-last: lanes over channels, int32 sums.

A depthwise layer (one input and one output channel per group) has no product to
pack: each output value is a sum of kh*kw products of one channel.  Per output row
the sums of every pixel and channel are accumulated tap by tap in int32 -- each
tap's run of ``Wo`` pixels times C channels read where it lies in the NHWC input,
the inner loop over contiguous channels (with stride 1 over a tap's whole run of
pixels, the weights repeated per pixel), so it vectorises -- then the requantizing
epilogue (``kernels/requant.py``) writes the row.  The patches path (one GEMM of
k = kh*kw per channel, called per group from Python) had cost MobileNetV2's
depthwise layers 10-24 ms each.  Exact: |x - zero| <= 255 times |w| <= 128 times
kh*kw taps fits int32 for any kernel the overflow bound admits.
"""
import numpy as np

from tilegemm.ground.contracts import jit
from tilegemm.kernels.requant import finish_planes, finish_rows
from tilegemm.kernels.sync import publish


@jit
def qdepthwise_rows(x, zero, w, geom, blocks, epilogue, out, acc, gate):
    """Output rows of a depthwise convolution of the NHWC int8/uint8 ``x`` (zero point
    ``zero``) into ``out`` (NHWC, or NCHW with ``geom[-1]``), through the epilogue
    ``epilogue = (mult, bias, act, requant, folded)`` (``kernels/requant.py``): per row
    ``(n, oy0, oy1)`` of ``blocks`` (int64), rows ``oy0:oy1`` of image ``n``.  One
    thread's share in one call.

    ``w``: int32, tap ``r*kw + s`` of channel c at ``w[r*kw + s, c]``; with stride 1
    ``(kh*kw, Wo*C)``, again for every output pixel (``w[t, ox*C + c]``: a tap's run
    of pixels is one loop), else ``(kh*kw, C)``.  ``geom = (Ho, Wo, kh, kw, sy, sx, dy,
    dx, top, left, nchw)``.  ``acc``: int32 room for ``Wo * C``.  ``gate``: as ``kernels/_int8.py``
    :func:`qconv_taps_blocks`'s."""
    publish(gate, 0, 1)
    flat = out.reshape(-1)
    sums = acc[:geom[1] * x.shape[3]]
    for b in range(blocks.shape[0]):
        _image_rows(x, zero, w, geom, (blocks[b, 0], blocks[b, 1], blocks[b, 2]), epilogue,
                    flat, sums)


@jit
def _image_rows(x, zero, w, geom, rows, epilogue, flat, sums):
    """Rows ``rows = (n, oy0, oy1)`` of :func:`qdepthwise_rows` (``flat``: the output,
    flat; ``sums``: room for a row's)."""
    Ho, Wo, kh, kw, sy, sx, dy, dx, top, left, nchw = geom
    n, oy0, oy1 = rows
    H, W, C = x.shape[1], x.shape[2], x.shape[3]
    for oy in range(oy0, oy1):
        sums[:] = 0
        for r in range(kh):
            iy = oy * sy - top + r * dy
            if iy < 0 or iy >= H:
                continue
            line = x[n, iy].reshape(-1)
            for s in range(kw):
                # the output columns whose input column lies inside the image
                ox0 = max(0, -((s * dx - left) // sx))
                ox1 = min(Wo, (W - 1 - s * dx + left) // sx + 1)
                _one_tap(line, w[r * kw + s], (ox0, ox1, C, sx, s * dx - left), zero, sums)
        if nchw:
            finish_planes(sums, C, epilogue, 0, flat, n * C * Ho * Wo + oy * Wo, Ho * Wo,
                          (Wo, C))
        else:
            finish_rows(sums, 0, C, epilogue, 0, flat, (n * Ho + oy) * Wo * C, C, (Wo, C))


@jit
def _one_tap(line, tap, run, zero, sums):
    """``sums`` += one tap over output pixels ``ox0:ox1`` (``run = (ox0, ox1, C, sx,
    shift)``: pixel ox reads input column ``ox*sx + shift`` of the row ``line``)."""
    ox0, ox1, C, sx, shift = run
    if ox1 <= ox0:
        return
    if sx == 1:            # one run of pixels: one loop over all their channels
        at = (ox0 + shift) * C
        src, dst, wt = line[at:at + (ox1 - ox0) * C], sums[ox0 * C:ox1 * C], tap[ox0 * C:ox1 * C]
        for i in range(dst.size):     # int32 throughout: it vectorises
            dst[i] += np.int32(np.int32(src[i]) - zero) * wt[i]
        return
    for ox in range(ox0, ox1):
        at = (ox * sx + shift) * C
        src, dst = line[at:at + C], sums[ox * C:(ox + 1) * C]
        for c in range(C):
            dst[c] += np.int32(np.int32(src[c]) - zero) * tap[c]
