"""Template for the direct and depthwise convolution drivers, bound to one vector width.

They use no GEMM micro-kernel: :mod:`tilegemm.conv.engine` writes one module per
(dtype, ISA) from this file (:func:`tilegemm.conv.engine.family_module`), with the
configuration block filled in; ``SOURCE_HASH`` is a digest of the sources this code
inlines.  Importable as is (float32, AVX-512).
"""
import numba
import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import EPI_BIAS_ROW, EPI_RELU, EPI_RELU6, JIT, imax, imin, jit
from tilegemm.kernels.direct import (make_depthwise_flat, make_depthwise_nhwc,
                                     make_depthwise_nhwc3, make_depthwise_rows, make_direct_row)
from tilegemm.kernels.sync import next_task, prefetch
from tilegemm.tuning.machine import ISA_SHAPE

# --- configuration ---
DTYPE = np.float32
LANES = 16
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_SHARED = engine.template_module("shared", DTYPE, isa=ISA)
phase_split = _SHARED.phase_split
geom_of = _SHARED.geom_of
ZERO, UNIT, TRUE, FALSE = _SHARED.ZERO, _SHARED.UNIT, _SHARED.TRUE, _SHARED.FALSE
#: Vectors of an output row per direct-convolution call (independent FMA chains).
ROW_VECTORS = 4
ROW = ROW_VECTORS * LANES
direct_row = make_direct_row(DTYPE, LANES, vectors=ROW_VECTORS)
direct_row_out = make_direct_row(DTYPE, LANES, to_output=True, vectors=ROW_VECTORS)
#: Depthwise rows per call from a zero-padded channel: two rows of ROW_VECTORS vectors
#: are eight independent FMA chains.
DW_ROWS = 2
depthwise_rows = make_depthwise_rows(DTYPE, LANES, ROW_VECTORS, DW_ROWS)
depthwise_row = make_depthwise_rows(DTYPE, LANES, ROW_VECTORS, 1)
#: Output vectors per call of the depthwise kernel over rows end to end: eight
#: independent FMA chains; four for short runs and the masked vectors near the
#: top and bottom (a 7x7 channel has four vectors inside and three outside).
DW_FLAT_VECTORS = 8
DW_FLAT_SHORT = 4
depthwise_flat_inside = make_depthwise_flat(DTYPE, LANES, DW_FLAT_VECTORS, inside=True)
depthwise_flat_inside_short = make_depthwise_flat(DTYPE, LANES, DW_FLAT_SHORT, inside=True)
depthwise_flat = make_depthwise_flat(DTYPE, LANES, DW_FLAT_SHORT)
#: Depthwise NHWC: eight vectors of one pixel's channels per call (eight FMA chains,
#: each pixel's channels read in one contiguous run; several pixels, C apart, are
#: more streams than the prefetchers follow: docs/conv-paths.md).  Layers with
#: fewer channels run 2 vectors x 4 pixels, single pixels at the image's edges.
DW_NHWC_WIDE = 8
DW_NHWC_VECTORS = 2
DW_NHWC_PIXELS = 4
#: Its shapes (vectors, pixels), chosen per call: WIDE, RUN, and ONE for the edges.
WIDE, RUN, ONE = 0, 1, 2
depthwise_nhwc = make_depthwise_nhwc(DTYPE, LANES, ((DW_NHWC_WIDE, 1),
                                                    (DW_NHWC_VECTORS, DW_NHWC_PIXELS),
                                                    (DW_NHWC_VECTORS, 1)))
#: Depthwise NHWC with three kernel columns (dilation 1, stride 1 or 2: MobileNet's
#: 3x3 layers): DW3_VECTORS vectors of channels x DW3_PIXELS output pixels a call,
#: each input column loaded once per kernel row for every pixel it feeds.  The sums,
#: the row's weights and a column fill the register file: 2 x 8 pixels with 32
#: registers (16 + 6 + 2), 2 x 4 with 16 (8 + 6 + 2).  Two vectors a column halve
#: the address arithmetic per FMA (a pixel's stride C is not a constant), which
#: bounds the kernel on AVX2: 2 x 4 ran 5-10% faster than 1 x 8 on MobileNetV2's
#: layers of 7-28 pixels a row (Zen 3), alike at 56.  Pixel groups outer, channel
#: blocks inner, so each call's columns are the next stretch of three contiguous
#: input rows.  Its shapes: index ``stride - 1``.
DW3_VECTORS = 2
DW3_PIXELS = 8 if ISA_SHAPE[ISA][1] >= 32 else 4
#: Output rows per depthwise NHWC task, at most (see depthwise_nhwc_tasks).
DW_NHWC_BAND = 8
depthwise_nhwc3 = make_depthwise_nhwc3(DTYPE, LANES, ((DW3_VECTORS, DW3_PIXELS, 1),
                                                      (DW3_VECTORS, DW3_PIXELS, 2)))



# --- direct convolution, NCHW, horizontal stride 1: vectors along the output row ---------

@jit
def depthwise_plane(geom):
    """(rows, row stride) of a channel zero padded for :func:`depthwise_rows`.

    Every vector of every output row reads whole: ``ROW`` columns rounded up past the
    last output column, plus the kernel's reach to the right.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    rows = (Ho - 1) * sy + (kh - 1) * dy + 1
    cols = (Wo + ROW - 1) // ROW * ROW + (kw - 1) * dx
    return rows, (cols + LANES - 1) // LANES * LANES


@jit
def depthwise_flat_tasks(counter, plan, grid, x, planes, w, bias, epi, out, xq):
    """Depthwise channels whose output (``out_plane`` pixels) is as wide as the image's
    stride-phase planes (``Hq x Wq``), its rows end to end (:func:`depthwise_flat`);
    task ``c`` is the ``c``-th channel of the batch, ``per_tick`` at a time taken
    from ``counter``.

    With stride 1 the planes are the channel itself (``planes`` is ``x``); else
    (``copy``) the channel is split into them in ``xq`` (``planes``, with LANES of
    slack) first.  Runs of vectors that read inside their planes go first (at
    ``blocks``, ``shorts``), then the others (``starts``); the geometry is
    ``tilegemm.conv.direct.flat_geometry``'s.  One loop over the channels, the
    kernels called on one array: a small channel is a few hundred cycles, which a
    function call per channel (its arrays' reference counts) would double.

    ``plan`` is :func:`tilegemm.conv.direct.flat_plan`'s record (its names here),
    ``grid`` the geometry's arrays ``(taps, masks, starts, rows, inner, colmask,
    blocks, shorts)``; ``epi`` the epilogue flags (``EPI_BIAS_ROW``: ``bias`` per
    channel).
    """
    r = plan[0]
    taps, masks, starts, rows, inner, colmask, blocks, shorts = grid
    H, W, kh, kw, sy, sx = r.H, r.W, r.kh, r.kw, r.sy, r.sx
    ntasks, per_tick, out_plane, copy = r.ntasks, r.per_tick, r.out_plane, r.copy != 0
    Hq, Wq = r.Hq, r.Wq
    ntaps = kh * kw
    has_bias = epi & EPI_BIAS_ROW
    K = w.size // ntaps
    nvec = starts.size
    while True:
        first = next_task(counter) * per_tick
        if first >= ntasks:
            break
        k = first % K
        for c in range(first, imin(ntasks, first + per_tick)):
            dst = c * out_plane
            if copy:
                phase_split(x, (c * H * W, H * W, W), (UNIT, H, W), (sy, sx, ZERO, ZERO),
                            (Hq, Wq, sy * sx * Hq * Wq), xq, TRUE)
                src = 0
            else:
                src = c * H * W
            w_off = k * ntaps
            b = bias[k] if has_bias else DTYPE(0)
            for i in range(blocks.size):
                q0 = blocks[i]
                depthwise_flat_inside(planes, inner, ntaps, w, colmask, out,
                                      (src + q0, w_off, dst + q0), q0 % Wq, (b, epi))
            for i in range(shorts.size):
                q0 = shorts[i]
                depthwise_flat_inside_short(planes, inner, ntaps, w, colmask, out,
                                            (src + q0, w_off, dst + q0), q0 % Wq, (b, epi))
            for v0 in range(0, nvec, DW_FLAT_SHORT):
                depthwise_flat(planes, taps, ntaps, w, masks, starts, rows, out,
                               (src, w_off, dst), (v0, imin(DW_FLAT_SHORT, nvec - v0)), (b, epi))
            k = k + 1 if k + 1 < K else 0


@jit
def depthwise_nhwc_tasks(counter, tasks, x, wt, bias, epi, out, geom, C):
    """Depthwise NHWC bands of output rows, the lanes over the channels, row by row
    (:func:`depthwise_nhwc_row`); ``tasks`` is ``(ntasks, band)``, task ``n*bands +
    b`` rows ``b*band`` on of image ``n``.

    A thread's rows are consecutive, so two of the three input rows each reads are
    still in its L2 from the row above (rows dealt out one by one to two threads
    left each a third: docs/conv-paths.md).
    """
    ntasks, band = tasks
    Ho = geom[2]
    bands = (Ho + band - 1) // band
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        n, oh0 = task // bands, (task % bands) * band
        for oh in range(oh0, imin(Ho, oh0 + band)):
            depthwise_nhwc_row(x, wt, bias, epi, out, geom, C, n, oh)


@numba.njit(inline='always', **JIT)
def depthwise_nhwc_row(x, wt, bias, epi, out, geom, C, n, oh):
    """Output row ``oh`` of image ``n`` of a depthwise NHWC layer.

    ``wt`` holds the weights (kh, kw, C), ``C`` at least DW_NHWC_VECTORS*LANES; the
    last block of channels overlaps the one before, so every store is whole.  Output
    columns whose every tap lies in the image row run in groups of the kernel's
    pixels (the last group overlapping the one before); the others one at a time,
    each over its taps inside the image; with three kernel columns (dilation 1,
    stride 1 or 2) and room for a group, the groups go to :data:`depthwise_nhwc3`.
    ``epi`` carries the bias (``EPI_BIAS_COL``) and activation flags.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    three = kw == 3 and dx == 1 and sx <= 2
    P3, CB3 = DW3_PIXELS, DW3_VECTORS * LANES
    wide = C >= DW_NHWC_WIDE * LANES
    CB = (DW_NHWC_WIDE if wide else DW_NHWC_VECTORS) * LANES
    P = 1 if wide else DW_NHWC_PIXELS
    edge = WIDE if wide else ONE
    # Columns ow with 0 <= ow*sx - px and ow*sx + (kw-1)*dx - px < W.
    lo = imin(Wo, (px + sx - 1) // sx)
    reach = W - 1 - (kw - 1) * dx + px
    hi = imax(lo, imin(Wo, reach // sx + 1)) if reach >= 0 else lo
    step = P if hi - lo >= P else 1
    inner = WIDE if wide else (RUN if step == P else ONE)
    y0 = oh * sy - py
    i0 = imax(0, (dy - 1 - y0) // dy)                 # first kernel row inside the image
    i1 = imin(kh, (H - 1 - y0) // dy + 1) if y0 < H else 0
    if i1 <= i0:
        i0 = i1 = 0                                   # only padding: the bias alone
        y0 = 0
    row = (n * H + y0 + i0 * dy) * W                  # first input row read, in pixels
    dst_row = (n * Ho + oh) * Wo
    w_row = i0 * kw * C
    # Pixels outer, channel blocks inner: each pixel's channels are read in order.
    for ow in range(Wo):
        if lo <= ow < hi:
            continue
        x0 = ow * sx - px
        j0 = imax(0, (dx - 1 - x0) // dx)
        j1 = imin(kw, (W - 1 - x0) // dx + 1) if x0 < W else 0
        nj = imax(0, j1 - j0)
        src = (row + x0 + j0 * dx) * C if nj else 0
        for c in range(0, C, CB):
            c = imin(c, C - CB)
            depthwise_nhwc(edge, x, (src + c, ZERO, dy * W * C, dx * C),
                           (i1 - i0 if nj else 0, nj), wt, (w_row + j0 * C + c, C, kw), out,
                           ((dst_row + ow) * C + c, ZERO), bias, c, epi)
    if three and hi - lo >= P3:
        # Groups of P3 pixels, the last overlapping the one before.
        for ow in range(lo, hi, P3):
            ow = imin(ow, hi - P3)
            src = (row + ow * sx - px) * C
            for c in range(0, C, CB3):
                c = imin(c, C - CB3)
                depthwise_nhwc3(sx - 1, x, (src + c, dy * W * C, C), i1 - i0, wt, w_row + c,
                                out, (dst_row + ow) * C + c, bias, c, epi)
        return
    for ow in range(lo, hi, step):
        ow = imin(ow, hi - step)
        src = (row + ow * sx - px) * C
        for c in range(0, C, CB):
            c = imin(c, C - CB)
            depthwise_nhwc(inner, x, (src + c, sx * C, dy * W * C, dx * C), (i1 - i0, kw),
                           wt, (w_row + c, C, kw), out, ((dst_row + ow) * C + c, C), bias, c,
                           epi)


@numba.njit(inline='always', **JIT)
def direct_nchw_task(task, x, w, bias, has_bias, act, out, shape, geom, KB, acc):
    """One (image, group, block of <= KB output channels): every output row.

    As ``tilegemm.conv.direct._nchw_task``, with LANES output pixels of a row at a
    time through a channel's whole kernel window in one register (:func:`direct_row`,
    padding read as zero); needs a horizontal stride of 1.  ``acc`` holds KB*Wo rounded up to ROW elements
    per channel; ``shape = (N, C, K, groups)``; flat C-contiguous arrays.
    """
    N, C, K, groups = shape
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    Cg, Kg = C // groups, K // groups
    blocks = (Kg + KB - 1) // KB
    n = task // (groups * blocks)
    g = (task // blocks) % groups
    k0 = g * Kg + (task % blocks) * KB
    kn = imin(KB, (g + 1) * Kg - k0)
    lda = (Wo + ROW - 1) // ROW * ROW
    if Cg == 1 and kn == 1:
        # One input channel per output channel (depthwise): the channel is copied zero
        # padded into acc, so the row loads need no masks; each vector of the row is
        # summed, biased and activated in a register and stored straight to out.
        epi = act | (EPI_BIAS_ROW if has_bias else 0)
        Hp, Wp = depthwise_plane(geom)
        # The zero-padded copy of one channel: phase_split with a single phase.
        phase_split(x, ((n * C + g) * H * W, H * W, W), (UNIT, H, W), (UNIT, UNIT, py, px),
                    (Hp, Wp, Hp * Wp), acc, FALSE)
        # Ask for the start of the next channel now: a small channel is a few short
        # rows, too short for the hardware prefetcher to pick up before they are read.
        if (n * C + g + 1) * H * W < x.size:
            for q in range(0, imin(H * W, 4096 // x.itemsize), 64 // x.itemsize):
                prefetch(x, (n * C + g + 1) * H * W + q)
        dst = (n * K + k0) * Ho * Wo
        b = bias[k0] if has_bias else DTYPE(0)
        whole = Ho // DW_ROWS * DW_ROWS
        for t in range(0, Wo, ROW):
            count = imin(ROW, Wo - t)
            for oh in range(0, whole, DW_ROWS):
                depthwise_rows(acc, oh * sy * Wp + t, (Wp, sy * Wp), count, w, k0 * kh * kw,
                               (kh, kw, dy, dx), out, (dst + oh * Wo + t, Wo), (b, epi))
            for oh in range(whole, Ho):
                depthwise_row(acc, oh * sy * Wp + t, (Wp, sy * Wp), count, w, k0 * kh * kw,
                              (kh, kw, dy, dx), out, (dst + oh * Wo + t, Wo), (b, epi))
        return
    if Cg == 1:
        # One input channel per output channel (depthwise): each vector of the row is
        # summed, biased and activated in a register and stored straight to out.
        epi = act | (EPI_BIAS_ROW if has_bias else 0)
        for oh in range(Ho):
            y0 = oh * sy - py
            for kk in range(kn):
                src = ((n * C + g * Cg) * H + y0) * W - px
                dst = ((n * K + k0 + kk) * Ho + oh) * Wo
                b = bias[k0 + kk] if has_bias else DTYPE(0)
                for t in range(0, Wo, ROW):
                    direct_row_out(x, src + t, (W, H, W), (y0, t - px, imin(ROW, Wo - t)), w,
                                   (k0 + kk) * kh * kw, (kh, kw, dy, dx), out, dst + t, (b, epi))
        return
    for oh in range(Ho):
        acc[:kn * lda] = 0
        y0 = oh * sy - py
        for c in range(Cg):
            src = ((n * C + g * Cg + c) * H + y0) * W - px
            for kk in range(kn):
                w_off = ((k0 + kk) * Cg + c) * kh * kw
                for t in range(0, Wo, ROW):
                    direct_row(x, src + t, (W, H, W), (y0, t - px, imin(ROW, Wo - t)), w, w_off,
                               (kh, kw, dy, dx), acc, kk * lda + t)
        for kk in range(kn):
            dst = ((n * K + k0 + kk) * Ho + oh) * Wo
            b = bias[k0 + kk] if has_bias else DTYPE(0)
            for ow in range(Wo):
                y = acc[kk * lda + ow]
                if has_bias:
                    y += b
                # Compare-and-assign keeps NaN (NaN < 0 is false).
                if act & (EPI_RELU | EPI_RELU6) and y < 0:
                    y = 0
                if act & EPI_RELU6 and y > 6:
                    y = 6
                out[dst + ow] = y


@jit
def direct_nchw_tasks(counter, plan, x, w, bias, has_bias, act, out, acc):
    """Tasks of :func:`direct_nchw_task`, ``per_tick`` at a time taken from ``counter``
    (:func:`next_task`) until ``ntasks`` are out: a small depthwise channel is a
    microsecond of work, less than threads contending for the counter cost.

    ``plan`` is :func:`tilegemm.conv.direct.direct_plan`'s record (its names here).
    """
    r = plan[0]
    ntasks, per_tick, KB = r.ntasks, r.per_tick, r.KB
    shape, geom = (r.N, r.C, r.K, r.groups), geom_of(r)
    while True:
        first = next_task(counter) * per_tick
        if first >= ntasks:
            break
        for task in range(first, imin(ntasks, first + per_tick)):
            direct_nchw_task(task, x, w, bias, has_bias, act, out, shape, geom, KB, acc)

