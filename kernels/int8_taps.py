"""Where the int8 taps tiles read and write: a convolution's runs of k, and the
rows of pixels ``amx`` tiles run over.

The taps tiles (``kernels/int8.py``) read a convolution's input from its widened
rows in place: k comes in runs, each a tap's channels (:func:`tap_runs`).  A vector
tile reads each row from its pixel's offset; an AMX tile loads 16 rows a constant
stride apart, so ``amx`` computes pixels of rows whose pixels follow on at one
stride (:func:`amx_rows`), some of which the layer does not have; each tile's rows
and where they go in C are listed once per call (:func:`amx_tile_places`).  An
input whose rows need no widening is read where it lies, up to the pixels whose
tiles would read past its end (:func:`in_place_end`).  A QDQ residual sum after the
conv adds a chunk's codes to the residual's (:func:`add_residual`).
"""
import numba

from tilegemm.ground.contracts import JIT
from tilegemm.kernels.requant import add_codes

#: intp an ``amx`` tile's places take (:func:`amx_tile_places`): its two A tiles' first
#: words, their row stride, then each of its 32 rows' place in C.
TILE_PLACES = 3 + 32


@numba.njit(**JIT)
def amx_rows(Wp, Wo, sy, sx):
    """The width of the rows of output pixels an ``amx`` taps tile runs over, for a
    padded width ``Wp``, output width ``Wo`` and stride ``(sy, sx)``: an AMX tile
    loads 16 rows a constant stride apart, so each of its two A tiles is 16 pixels of
    these rows, of which only the first ``Wo`` exist (the rest computed and dropped).

    Where ``sy * Wp / sx`` is a whole width of at least ``Wo`` (every stride-1 layer)
    a row's pixels continue into the next row's: rows of that width, tiles anywhere
    (ResNet-18's 3x3 at 56: 58, 3.5% dropped).  Otherwise rows of ``Wo`` rounded up
    to 16, tiles starting at multiples of 16 (a stride-2 layer: 28 -> 32).  The width
    that drops fewer pixels."""
    whole = Wo + (-Wo) % 16
    if (sy * Wp) % sx == 0 and Wo <= sy * Wp // sx < whole:
        return sy * Wp // sx
    return whole


@numba.njit(**JIT)
def amx_first(p0, widths, stride):
    """Where the first tile of an ``amx`` call from output pixel ``p0`` starts among
    :func:`amx_rows`'s pixels (``widths = (Wv, Wo, Wp)``: those rows', the output's,
    the padded input's): at ``p0``'s where the rows continue one into the next, else
    at a multiple of 16."""
    (Wv, Wo, Wp), (sy, sx) = widths, stride
    v0 = (p0 // Wo) * Wv + p0 % Wo
    return v0 if Wv * sx == sy * Wp else v0 - v0 % 16


@numba.njit(**JIT)
def amx_rows_past(Wp, Wo, kernel, stride):
    """Rows of the padded image past the last output pixel's rows an ``amx`` taps call
    may read (``kernel = (kw, dx)``, ``stride = (sy, sx)``): its last tile runs up to
    31 pixels of :func:`amx_rows`'s rows further, each a row's last pixel at most."""
    (kw, dx), (sy, sx) = kernel, stride
    Wv = amx_rows(Wp, Wo, sy, sx)
    return (Wo + 30) // Wv * sy + ((Wv - 1) * sx + (kw - 1) * dx) // Wp + 1


@numba.njit(**JIT)
def amx_places(m, Wo, Wv):
    """intp words an ``amx`` taps call on ``m`` output pixels needs for its tiles'
    places (:func:`amx_tile_places`): TILE_PLACES per tile of 32 pixels of
    :func:`amx_rows`'s rows, over every row the pixels touch."""
    return TILE_PLACES * ((((m + Wo - 1) // Wo + 1) * Wv + 16) // 32 + 1)


@numba.njit(**JIT)
def amx_tile_places(rows, span, ld, a_at):
    """Per tile of 32 pixels from ``v0`` (``span = (v0, v1, p0, p1)``, pixels of the rows
    ``rows = (Wv, Wo, Wp, Cw, sy, sx, row0)``), TILE_PLACES intp in ``a_at``: its two A tiles'
    first words in the widened image, their row stride in words, then per row its
    offset in C (output pixel ``p``'s: ``(p - p0) * ld``), or -1 where the layer has no
    such pixel or it is outside ``p0:p1``."""
    Wv, Wo, Wp, Cw, sy, sx, row0 = rows
    v0, v1, p0, p1 = span
    for vt in range(v0, v1, 32):
        at = (vt - v0) // 32 * TILE_PLACES
        for h in range(2):
            v = vt + 16 * h
            a_at[at + h] = (((v // Wv) * sy - row0) * Wp + (v % Wv) * sx) * Cw
        a_at[at + 2] = sx * Cw
        for i in range(32):
            v = vt + i
            q = (v // Wv) * Wo + v % Wv
            a_at[at + 3 + i] = (q - p0) * ld if v % Wv < Wo and p0 <= q < p1 else -1


@numba.njit(**JIT)
def tap_runs(g0, g1, cgw, geom, c0w, seg):
    """The runs of groups ``g0:g1`` of k (tap by tap, ``cgw`` groups each) as the taps
    tile reads them: ``seg[2s]`` the run's first word relative to a pixel's, ``seg[2s+1]``
    its groups.  Taps whose words follow on (a kernel row's, all the channels taken,
    no dilation) make one run: a 3-channel stem's 7x7 is 7 runs of 14 groups, not 49
    of 2.  Returns the number of runs."""
    Wp, Cw, kw, dy, dx = geom
    s = 0
    for t in range(g0 // cgw, (g1 - 1) // cgw + 1):
        lo, hi = max(g0, t * cgw), min(g1, (t + 1) * cgw)
        r, q = t // kw, t % kw
        start = (r * dy * Wp + q * dx) * Cw + c0w + lo - t * cgw
        if s > 0 and seg[2 * s - 2] + seg[2 * s - 1] == start:
            seg[2 * s - 1] += hi - lo
        else:
            seg[2 * s] = start
            seg[2 * s + 1] = hi - lo
            s += 1
    return s


@numba.njit(**JIT)
def in_place_end(rows, pixels, geom, past, amx):
    """The end ``ps`` of the output pixels ``p0:ps`` of ``pixels = (p0, p1)`` whose input
    rows, and the ``past`` rows more a call on them may read (:func:`amx_rows_past`),
    lie within the first ``rows`` rows from the image's first (unpadded: output row
    ``oy`` reads up to row ``oy*sy + (kh - 1)*dy``; ``geom = (Wo, kh, sy, dy, Wp,
    sx)``): ``p1``, the end of an output row, or ``p0`` when none fits.  With ``amx``
    the end of a row where one of the tiles from ``p0`` ends (the tile across a
    split would be computed twice: 8 tiles instead of 7 on a 14 x 14 output); a
    block of several chunks starts its tiles again at each chunk, so there the cut
    may still split one (correct, a tile's work more)."""
    p0, p1 = pixels
    Wo, kh, sy, dy, Wp, sx = geom
    fit = (rows - past - (kh - 1) * dy - 1) // sy + 1      # the output rows oy < fit
    ps = max(p0, min(p1, fit * Wo)) if fit > 0 else p0
    if amx and p0 < ps < p1:
        Wv = amx_rows(Wp, Wo, sy, sx)
        v0 = amx_first(p0, (Wv, Wo, Wp), (sy, sx))
        while ps > p0 and ((ps // Wo) * Wv - v0) % 32:
            ps -= Wo
    return max(ps, p0)


@numba.njit(**JIT)
def add_residual(codes, part, groups, summed, out):
    """``out`` = the QDQ sum (:func:`~tilegemm.kernels.requant.add_codes`) of a chunk's
    codes (NHWC pixels ``q0:q1`` of image ``n`` from ``codes``'s start, each group's
    channels ``j0:j1``; ``part = (n, q0, q1, j0, j1)``) and the residual's, both NHWC."""
    residual, scales, zeros, relu, low, high, conv_first = summed
    n, q0, q1, j0, j1 = part
    K = out.shape[3]
    Kg = K // groups
    at = (n * out.shape[1] * out.shape[2] + q0) * K
    flat = out.reshape(-1)
    # whole pixels: one run; else each pixel's run of each group's channels
    runs, width = ((1, (q1 - q0) * K) if j1 - j0 == Kg else ((q1 - q0) * groups, j1 - j0))
    for r in range(runs):
        c = r * K if j1 - j0 == Kg else (r // groups) * K + (r % groups) * Kg + j0
        mine, other = codes[c:c + width], residual[at + c:at + c + width]
        if conv_first:
            add_codes(mine, other, scales, zeros, relu, low, high, flat[at + c:at + c + width])
        else:
            add_codes(other, mine, scales, zeros, relu, low, high, flat[at + c:at + c + width])
