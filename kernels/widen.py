"""Widening a quantized input's rows for the taps kernel (``kernels/_int8.py``).

The taps kernel reads a convolution's input as channels-last rows of 32-bit words,
padded: int16 ``x - zero`` for the pair kinds, unsigned bytes for the byte kinds.
:func:`widen_rows` makes them from an NHWC or an NCHW input, one image row at a
time; nothing here depends on the kernel's tile, so one compiled copy serves every
kind.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, jit
from tilegemm.kernels.int8 import load_u64, store_u64


@jit
def widen_rows(x, n, geom, add, pad, r0, r1, out, nchw):
    """Rows ``r0:r1`` of image ``n`` of the input ``x`` (NCHW with ``nchw``, else NHWC)
    padded with ``pad``, as channels-last values ``x + add`` of ``out``'s dtype:
    ``out[((r - r0) * Wp + col) * Cp + c]`` for row ``r`` and column ``col`` of the
    padded image (``geom = (py, px, Wp, Cp)``), the taps kernel's A.  GROUP channels
    are its 32-bit words: ``Cp`` is C, or C rounded up to GROUP with zero channels.
    int16 ``x - zero`` padded with 0 for the pair kinds; bytes ``x + 128`` (int8) or
    ``x`` (uint8) padded with the zero point's byte for the byte kinds."""
    H, W = (x.shape[2], x.shape[3]) if nchw else (x.shape[1], x.shape[2])
    py, px, Wp, Cp = geom
    add = np.int16(add)
    for r in range(r0, r1):
        row = out[(r - r0) * Wp * Cp:(r - r0 + 1) * Wp * Cp]
        iy = r - py
        if not 0 <= iy < H:
            row[:] = pad
            continue
        row[:px * Cp] = pad
        row[(px + W) * Cp:] = pad
        body = row[px * Cp:(px + W) * Cp]
        if nchw:
            _pixels_from_nchw(x, n, iy, add, body, Cp)
        else:
            _pixels_from_nhwc(x[n, iy].reshape(-1), x.shape[3], add, body, Cp)


@jit
def _pixels_from_nhwc(src, C, add, body, Cp):
    """``body``: the ``C``-channel pixels of the run ``src`` plus ``add``, ``Cp``
    values apart."""
    if Cp == C:     # one run: the loop vectorises
        for i in range(src.size):
            body[i] = np.int16(src[i]) + add
    else:           # no slices per pixel: they cost more than the values
        for j in range(src.size // C):
            for c in range(Cp):
                body[j * Cp + c] = np.int16(src[j * C + c]) + add if c < C else 0


@jit
def _pixels_from_nchw(x, n, iy, add, body, Cp):
    """``body``: the pixels of row ``iy`` of image ``n`` of the NCHW ``x``, transposed
    while widened (no channels-last copy of the input first).  Bytes (the byte kinds)
    go as 8 x 8 blocks of 64-bit words (:func:`_bytes_from_nchw`: ResNet-50's 1x1
    input, 256 x 56 x 56, 0.43 -> 0.22 ms); the rest pixel by pixel, its channels
    written in a run (the reads stride across the channels' planes, but each line
    read serves the next pixels: 1.5x faster than channel by channel)."""
    C, W = x.shape[1], x.shape[3]
    j8, c8 = (W // 8 * 8, C // 8 * 8) if body.itemsize == 1 else (0, 0)
    if j8 > 0 and c8 > 0:
        _bytes_from_nchw(x, n, iy, add != 0, body, Cp, (j8, c8))
    else:
        j8 = 0
    for j in range(W):
        pixel = body[j * Cp:(j + 1) * Cp]
        for c in range(c8 if j < j8 else 0, C):
            pixel[c] = np.int16(x[n, c, iy, j]) + add
        for c in range(C, Cp):
            pixel[c] = 0


@numba.njit(inline="always", **JIT)
def _swap_pairs(w, mask, shift):
    """One round of an 8 x 8 byte transpose on the 8 words ``w``: in each pair (w[0],
    w[1]), (w[2], w[3]), ..., the ``mask`` bytes of the second swapped with those of
    the first ``shift`` bits up."""
    t0 = ((w[0] >> shift) ^ w[1]) & mask
    t1 = ((w[2] >> shift) ^ w[3]) & mask
    t2 = ((w[4] >> shift) ^ w[5]) & mask
    t3 = ((w[6] >> shift) ^ w[7]) & mask
    return (w[0] ^ (t0 << shift), w[1] ^ t0, w[2] ^ (t1 << shift), w[3] ^ t1,
            w[4] ^ (t2 << shift), w[5] ^ t2, w[6] ^ (t3 << shift), w[7] ^ t3)


@jit
def _bytes_from_nchw(x, n, iy, flip, body, Cp, extent):
    """``body[j*Cp + c] = x[n, c, iy, j] (^ 0x80 with flip)`` for pixels and channels
    below ``extent = (j8, c8)`` (multiples of 8), uint8 ``body``: each block of 8
    channels x 8 pixels read as eight 64-bit words (a channel's 8 pixels each),
    transposed in registers by three rounds of swaps (bytes, pairs, quads between
    words 1, 2 and 4 apart) into each pixel's 8 channels, written as eight words."""
    j8, c8 = extent
    W = x.shape[3]
    plane = x.shape[2] * W
    src = x.reshape(-1)
    base = (n * x.shape[1] * x.shape[2] + iy) * W
    flips = np.uint64(0x8080808080808080) if flip else np.uint64(0)
    m1, m2, m4 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFFFFFF)
    s1, s2, s4 = np.uint64(8), np.uint64(16), np.uint64(32)
    for c0 in range(0, c8, 8):
        at = base + c0 * plane
        for j0 in range(0, j8, 8):
            w0, w1 = load_u64(src, at + j0), load_u64(src, at + plane + j0)
            w2, w3 = load_u64(src, at + 2 * plane + j0), load_u64(src, at + 3 * plane + j0)
            w4, w5 = load_u64(src, at + 4 * plane + j0), load_u64(src, at + 5 * plane + j0)
            w6, w7 = load_u64(src, at + 6 * plane + j0), load_u64(src, at + 7 * plane + j0)
            # bytes between words 1 apart, pairs 2 apart, quads 4 apart
            w0, w1, w2, w3, w4, w5, w6, w7 = _swap_pairs((w0, w1, w2, w3, w4, w5, w6, w7), m1, s1)
            w0, w2, w1, w3, w4, w6, w5, w7 = _swap_pairs((w0, w2, w1, w3, w4, w6, w5, w7), m2, s2)
            w0, w4, w1, w5, w2, w6, w3, w7 = _swap_pairs((w0, w4, w1, w5, w2, w6, w3, w7), m4, s4)
            out = j0 * Cp + c0
            for i, w in enumerate((w0, w1, w2, w3, w4, w5, w6, w7)):
                store_u64(body, out + i * Cp, w ^ flips)
