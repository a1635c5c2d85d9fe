"""Template for the copies several convolution families share, bound to one vector width.

:mod:`tilegemm.conv.engine` writes one module per (dtype, ISA) from this file
(:func:`tilegemm.conv.engine.template_module`); the family templates take these
functions from it, so each is compiled once per vector width.  Importable as is
(float32, AVX-512).
"""
import numba
import numpy as np

from tilegemm.ground.contracts import JIT, imax, imin, inner_jit
from tilegemm.kernels.transforms import make_deinterleave, make_masked_copy, make_transpose

# --- configuration ---
DTYPE = np.float32
LANES = 16
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

masked_copy = make_masked_copy(DTYPE, LANES)
masked_copy2 = make_masked_copy(DTYPE, LANES, step=2)
transpose = make_transpose(DTYPE, LANES)
deinterleave = make_deinterleave(DTYPE, LANES)
#: Constants for calls between jitted functions: a literal 0, 1 or bool is typed
#: ``Literal[...]`` and would compile the callee once more per pattern of literals.
ZERO, UNIT = np.intp(0), np.intp(1)
TRUE, FALSE = np.bool_(True), np.bool_(False)


@numba.njit(inline='always', **JIT)
def geom_of(r):
    """A plan record's geometry as :meth:`ConvParams.geom`'s tuple (see ``engine.record``)."""
    return (r.H, r.W, r.Ho, r.Wo, r.kh, r.kw, r.sy, r.sx, r.py, r.px, r.dy, r.dx)


@numba.njit(inline='always', **JIT)
def strides_of(r):
    """A plan record's input and output strides, ``(xs, os)``, each ``(n, c, y, x)``."""
    return (r.xs_n, r.xs_c, r.xs_h, r.xs_w), (r.os_n, r.os_k, r.os_h, r.os_w)


@numba.njit(inline='always', **JIT)
def copy_run(x, src, first, W, buf, dst, count, step):
    """:func:`masked_copy` of ``count <= LANES`` pixels ``step`` (1 or 2) apart."""
    if step == 1:
        masked_copy(x, src, first, W, buf, dst, count)
    else:
        masked_copy2(x, src, first, W, buf, dst, count)


@inner_jit
def transpose_copy(x, src, lds, rows, cols, y, dst, ldd):
    """``y[dst + j*ldd + r] = x[src + r*lds + j]`` for ``r < rows``, ``j < cols``.

    LANES x LANES blocks transposed in registers (:func:`transpose`); the last rows
    and columns one at a time (an element at a time was slow: docs/conv-paths.md).
    """
    full_r = rows // LANES * LANES
    full_j = cols // LANES * LANES
    for r0 in range(0, full_r, LANES):
        for j0 in range(0, full_j, LANES):
            transpose(x, src + r0 * lds + j0, lds, y, dst + j0 * ldd + r0, ldd)
    for r in range(rows):
        s = src + r * lds
        for j in range(0 if r >= full_r else full_j, cols):
            y[dst + j * ldd + r] = x[s + j]



@numba.njit(inline='always', **JIT)
def split_fits(t, px, W, Wq):
    """Whether grid columns ``t:t+LANES`` of both phases of a stride-2 row lie inside it."""
    return t >= 0 and t + LANES <= Wq and 2 * t - px >= 0 and 2 * (t + LANES) - px <= W


@numba.njit(inline='always', **JIT)
def split_row(x, src, px, W, Wq, xq, even, odd, spill):
    """A stride-2 row's two column phases: ``xq[even + s] = x[src + 2*s - px]`` and
    ``xq[odd + s] = x[src + 2*s + 1 - px]`` for ``s < Wq`` (zero off the row's ``W``
    pixels).

    Whole vectors inside the row are :func:`deinterleave` d (each pixel read once); a
    last partial vector is redone whole, overlapping the one before, when it fits
    inside the row, else copied masked (a partial store, slow on Zen 3).  ``spill``:
    see :func:`phase_split`; only the odd phase's row spills, into its next row.
    """
    for t in range(0, Wq, LANES):
        col = 2 * t - px
        if split_fits(t, px, W, Wq):
            deinterleave(x, src + col, xq, even + t, odd + t)
            continue
        if t + LANES > Wq and split_fits(Wq - LANES, px, W, Wq):
            last = Wq - LANES
            deinterleave(x, src + 2 * last - px, xq, even + last, odd + last)
            continue
        count = imin(LANES, Wq - t)
        masked_copy2(x, src + col, col, W, xq, even + t, count)
        masked_copy2(x, src + col + 1, col + 1, W, xq, odd + t, LANES if spill else count)


@inner_jit
def phase_split(x, view, image, phases, split, xq, spill):
    """Write channels ``0:C`` of one image, zero padded and split by stride phase, into ``xq``.

    ``view`` is ``(x_off, sc, s_row)``: channel ``c``'s row ``y`` starts at
    ``x[x_off + c*sc + y*s_row]``; ``image`` is ``(C, H, W)``, ``phases`` ``(sy, sx,
    py, px)`` (strides and padding), ``split`` ``(Hq, Wq, chan)`` (each phase plane's
    size and the channels' distance in ``xq``).
    ``xq[c*chan + (a*sx + b)*Hq*Wq + r*Wq + s] = x[c, r*sy + a - py, s*sx + b - px]``
    (zero outside the image).  Assumes contiguous image rows.  With ``spill`` (pass
    ``TRUE`` or ``FALSE``, see ``ZERO``), rows
    are written in whole vectors, up to LANES - 1 values past their end: the next
    row overwrites them, and ``xq`` has LANES of slack after the last one.  A
    partial vector store is slow microcode on Zen 3.
    """
    x_off, sc, s_row = view
    C, H, W = image
    sy, sx, py, px = phases
    Hq, Wq, chan = split
    plane = Hq * Wq
    for c in range(C):
        for a in range(sy):
            for b in range(sx):
                base = c * chan + (a * sx + b) * plane
                for r in range(Hq):
                    dst = base + r * Wq
                    y = r * sy + a - py
                    if y < 0 or y >= H:
                        for s in range(Wq):
                            xq[dst + s] = 0
                        continue
                    src = x_off + c * sc + y * s_row
                    if sx == 2 and b == 0:
                        split_row(x, src, px, W, Wq, xq, dst, dst + plane, spill)
                        continue
                    if sx == 2:
                        continue               # written with phase 0 by split_row
                    if sx == 1:
                        # LANES columns per masked copy, the padding read as zero.
                        for t in range(0, Wq, LANES):
                            col = sx * t + b - px
                            masked_copy(x, src + col, col, W, xq, dst + t,
                                        LANES if spill else imin(LANES, Wq - t))
                        continue
                    # Columns s with 0 <= s*sx + b - px < W.
                    lo = imin(Wq, imax(0, (px - b + sx - 1) // sx))
                    hi = imax(lo, imin(Wq, (W - 1 + px - b) // sx + 1))
                    for s in range(Wq):
                        xq[dst + s] = x[src + s * sx + b - px] if lo <= s < hi else 0

