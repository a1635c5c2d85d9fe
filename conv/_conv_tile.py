"""Template for the convolution drivers bound to one micro-kernel (implicit im2col and Winograd).

:mod:`tilegemm.conv.engine` writes one module per GEMM kernel from this file, with
the configuration block filled in, exactly as the kernel registry does for
``kernels/_tile.py``: MR and NR become compile-time constants and Numba caches the
machine code per kernel.  The block also records a hash of the sources this code
inlines (the kernel module and the packers), so that a change in any of them
rewrites the module and invalidates Numba's on-disk cache.  Importable as is
(float32 6x64).

Each driver is a *task* function over disjoint pieces of the output; ``*_tasks``
runs tasks taken one at a time from a counter shared by the Python threads of a
call (:func:`next_task`), each thread with its own pack buffers (the code
releases the GIL).  The packed weights are prepared once by the caller and shared
read-only.
"""
import numba
import numpy as np

from tilegemm.conv.params import PADDED, PHASED
from tilegemm.ground.contracts import EPI_BIAS_ROW, EPI_RELU, EPI_RELU6, JIT
from tilegemm.kernels.direct import (make_depthwise_flat, make_depthwise_nhwc,
                                     make_depthwise_rows, make_direct_row)
from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.sync import next_task, prefetch
from tilegemm.kernels.transforms import (make_deinterleave, make_masked_copy, make_transpose,
                                         make_winograd_input, make_winograd_output)
from tilegemm.kernels.registry import get_kernel, microkernel
from tilegemm.packing.im2col import pack_b_im2col, row_segments
from tilegemm.packing.winograd import pack_a_winograd, unpack_winograd

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_KERNEL = get_kernel(DTYPE, MR, NR, ISA)
macro_kernel = _KERNEL.module.macro_kernel
pack_b = _KERNEL.module.pack_b
LANES = _KERNEL.lanes
winograd_input = make_winograd_input(DTYPE, LANES)
winograd_output = make_winograd_output(DTYPE, LANES)
masked_copy = make_masked_copy(DTYPE, LANES)
masked_copy2 = make_masked_copy(DTYPE, LANES, step=2)
transpose = make_transpose(DTYPE, LANES)
deinterleave = make_deinterleave(DTYPE, LANES)
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
#: each pixel's channels read in one contiguous run; 1 thread, 256 channels at 28x28:
#: 1.75 ms, against 2.4 ms for 4 vectors x 2 pixels and 4.5 ms for 2 x 4, whose
#: pixels, C apart, are more streams than the prefetchers follow).  Layers with
#: fewer channels run 2 vectors x 4 pixels, single pixels at the image's edges.
DW_NHWC_WIDE = 8
DW_NHWC_VECTORS = 2
DW_NHWC_PIXELS = 4
#: Its shapes (vectors, pixels), chosen per call: WIDE, RUN, and ONE for the edges.
WIDE, RUN, ONE = 0, 1, 2
depthwise_nhwc = make_depthwise_nhwc(DTYPE, LANES, ((DW_NHWC_WIDE, 1),
                                                    (DW_NHWC_VECTORS, DW_NHWC_PIXELS),
                                                    (DW_NHWC_VECTORS, 1)))


@numba.njit(inline='always', **JIT)
def copy_run(x, src, first, W, buf, dst, count, step):
    """:func:`masked_copy` of ``count <= LANES`` pixels ``step`` (1 or 2) apart."""
    if step == 1:
        masked_copy(x, src, first, W, buf, dst, count)
    else:
        masked_copy2(x, src, first, W, buf, dst, count)


# --- implicit im2col, NCHW: out[n][K, Ho*Wo] = W[K, C*kh*kw] @ col(x[n]) ---------------

@numba.njit(**JIT)
def pack_b_im2col_rows(x, x_off, xs, geom, p0, kc, j0, nc, buf):
    """:func:`pack_b_im2col` for NR-wide panels, with vector copies when stride and image rows allow.

    With a horizontal stride of 1 or 2 and contiguous image rows, each panel row is a
    few runs of one image row (one per output row the panel's columns cross), copied
    LANES at a time by :func:`masked_copy` (every other pixel: :func:`masked_copy2`)
    with the padding read as zero.  Other geometries go to the scalar packer.  Same
    layout and assumptions.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    sc, s_row = xs[1], xs[2]
    if kh == 1 and kw == 1 and sy == 1 and sx == 1 and py == 0 and px == 0 and Wo == W \
            and xs[3] == 1 and s_row == W:
        # 1x1 over contiguous planes: the patch matrix is the image viewed as (C, H*W).
        pack_b(x, x_off + p0 * sc + j0, sc, 1, kc, nc, buf)
        return
    if sx > 2 or xs[3] != 1:
        pack_b_im2col(x, x_off, xs, geom, p0, kc, j0, nc, NR, buf)
        return
    seg_oh = np.empty(NR, np.int64)
    seg_ow = np.empty(NR, np.int64)
    seg_len = np.empty(NR, np.int64)
    for jr in range(0, nc, NR):
        cols = min(NR, nc - jr)
        nseg = row_segments(j0 + jr, cols, Wo, seg_oh, seg_ow, seg_len)
        c = p0 // (kh * kw)
        i = (p0 // kw) % kh
        j = p0 % kw
        dst = jr * kc
        for p in range(kc):
            out = dst
            for s in range(nseg):
                seg = seg_len[s]
                ih = seg_oh[s] * sy + i * dy - py
                iw0 = seg_ow[s] * sx + j * dx - px
                # A row outside the image reads as zeros: a row "width" of 0 masks every load.
                width = W if 0 <= ih < H else 0
                src = x_off + c * sc + ih * s_row + iw0
                for t in range(0, seg, LANES):
                    copy_run(x, src + sx * t, iw0 + sx * t, width, buf, out + t,
                             min(LANES, seg - t), sx)
                out += seg
            if cols < NR:
                masked_copy(x, 0, 0, 0, buf, dst + cols, NR - cols)
                for t in range(cols + LANES, NR, LANES):
                    masked_copy(x, 0, 0, 0, buf, dst + t, min(LANES, NR - t))
            dst += NR
            j += 1
            if j == kw:
                j = 0
                i += 1
                if i == kh:
                    i = 0
                    c += 1


@numba.njit(**JIT)
def im2col_nchw_task(task, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep, n_jc,
                     out, o_off, os, bias, epi, KC, MC, NC, bpack, tile, edge):
    """One task = (image n, NC block of output pixels, slice of output channels).

    ``apack`` holds the weights as packed A for every KC block (block ``pc`` at
    ``pc*Mp``, ``Mp`` = M rounded up to MR, zero rows).  B panels are packed from the
    image by :func:`pack_b_im2col_rows`; bias (per row, ``Mp`` values) and activation
    ride on the last KC block.  When M is not a multiple of MR the last row panel runs
    as a full tile into ``edge`` (MR x NC rounded up to NR), copied out at the end,
    rather than through the scalar edge-tile path.
    """
    n = task // (n_jc * msplit)
    jb = (task // msplit) % n_jc
    m0 = (task % msplit) * mstep
    m1 = min(M, m0 + mstep)
    m_full = m0 + (m1 - m0) // MR * MR
    pixels = geom[2] * geom[3]
    jc = jb * NC
    nc = min(NC, pixels - jc)
    ld_edge = (NC + NR - 1) // NR * NR
    xo = x_off + n * xs[0]
    co = o_off + n * os[0]
    ldc = os[1]
    for pc in range(0, ckk, KC):
        kc = min(KC, ckk - pc)
        pack_b_im2col_rows(x, xo, xs, geom, pc, kc, jc, nc, bpack)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        epi_pc = epi if pc + KC >= ckk else 0
        for ic in range(m0, m_full, MC):
            mc = min(MC, m_full - ic)
            macro_kernel(mc, nc, kc, apack, pc * Mp + ic * kc, bpack, 0, out, co + ic * ldc + jc,
                         ldc, DTYPE(1), beta, bias, ic, jc, epi_pc)
        if m_full < m1:
            macro_kernel(MR, nc, kc, apack, pc * Mp + m_full * kc, bpack, 0, edge, 0, ld_edge,
                         DTYPE(1), beta, bias, m_full, jc, epi_pc)
    for i in range(m1 - m_full):
        dst = co + (m_full + i) * ldc + jc
        for j in range(nc):
            out[dst + j] = edge[i * ld_edge + j]


@numba.njit(**JIT)
def im2col_nchw_tasks(counter, ntasks, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep,
                      n_jc, out, o_off, os, bias, epi, KC, MC, NC, bpack, tile, edge):
    """Tasks of :func:`im2col_nchw_task` taken from ``counter`` (:func:`next_task`) until
    ``ntasks`` are out."""
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        im2col_nchw_task(task, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep, n_jc,
                         out, o_off, os, bias, epi, KC, MC, NC, bpack, tile, edge)


# --- implicit im2col, NHWC, A rows read in place: out[N*Ho*Wo, K] = col^T @ W^T ----------
#
# A row of col^T is one output pixel; under tap (i, j) its values are the channels of
# one input pixel, contiguous in NHWC.  So the rows flavour reads A straight from the
# image, one offset per pixel and tap (a negative one reads a zero row: the padding),
# and sums every tap of a channel block in registers against the packed weights.
# With every channel in one block and no groups, the kw taps of a kernel row read kw
# adjacent pixels: one run of kw*C values, so such a row is one tap of kw*C steps
# (a 3-channel 7x7 stem: 7 taps of 21 steps instead of 49 of 3).

ukernel_rows = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS)
ukernel_rows_edge = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS_EDGE)
# Channels-first: a pixel's channels H*W apart.
ukernel_rows_strided = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS_STRIDED)
ukernel_rows_strided_edge = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS_STRIDED_EDGE)


@numba.njit(inline='always', **JIT)
def panel_stride(ntaps):
    """Entries of ``offs`` per row panel: an offset per pixel and tap, then a flag."""
    return ntaps * MR + 1


@numba.njit(inline='always', **JIT)
def _put(offs, at, value):
    # An unsigned index: Numba then skips the negative-index wraparound (this loop
    # is the rows path's overhead: 1.6 ms of a 7x7 stem's 27 ms).
    offs[np.uint64(at)] = value


@numba.njit(inline='always', **JIT)
def _next_pixel(n, oh, ow, step, Ho, Wo):
    """``(n, oh, ow)`` moved on by ``step`` pixels, ``step`` no more than to the row's end."""
    ow += step
    if ow == Wo:
        ow = 0
        oh += 1
        if oh == Ho:
            oh = 0
            n += 1
    return n, oh, ow


@numba.njit(**JIT)
def pixel_offsets(geom, strides, p0, count, m, runs, offs):
    """Where each tap of output pixels ``p0 .. p0 + count`` reads its input pixel.

    Pixels are numbered over the whole batch (``n*Ho*Wo + oh*Wo + ow``); pixel
    ``p0 + q*MR + i`` under tap ``t = i_k*kw + j_k`` gets
    ``offs[q*panel_stride(ntaps) + t*MR + i]``, the element offset of its input pixel
    (of its channel 0) in a batch whose images, rows and pixels are ``strides``
    elements apart (NHWC: ``H*W*C, W*C, C``; NCHW: ``C*H*W, W, 1``), or -1 where the
    tap falls in the padding or the pixel is past ``m`` (a partial panel).  The
    panel's last entry is 1 where ``runs`` allows (NHWC only) and every pixel's
    kernel rows lie inside the image's width: the panel's taps are then read a
    kernel row at a time (one run of ``kw*C`` values), and only the offsets of the
    rows' first taps (``j_k = 0``) are written.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    s_n, s_h, s_w = strides
    ntaps = kh * kw
    plane = Ho * Wo
    reach = (kw - 1) * dx
    n = p0 // plane
    oh = (p0 - n * plane) // Wo
    ow = p0 - n * plane - oh * Wo
    for q in range((count + MR - 1) // MR):
        at = q * panel_stride(ntaps)
        last = min(MR, m - p0 - q * MR)               # pixels of the panel that exist
        inside = runs
        o_w = ow
        for i in range(MR):
            x = o_w * sx - px
            inside &= (x >= 0) & (x + reach < W)
            o_w = o_w + 1 if o_w + 1 < Wo else 0
        _put(offs, at + ntaps * MR, 1 if inside else 0)
        row_taps = 1 if inside else kw
        if last == MR and ow + MR <= Wo:
            # The whole panel on one output row: a tap's offsets step by sx pixels.
            y, x = oh * sy - py, ow * sx - px
            pixel = n * s_n + y * s_h + x * s_w
            for ik in range(kh):
                iy = y + ik * dy
                row_ok = (iy >= 0) & (iy < H)
                for jk in range(row_taps):
                    first = pixel + ik * dy * s_h + jk * dx * s_w
                    for i in range(MR):
                        ix = x + jk * dx + i * sx
                        ok = row_ok & (ix >= 0) & (ix < W)
                        _put(offs, at + (ik * kw + jk) * MR + i, first + i * sx * s_w if ok else -1)
            n, oh, ow = _next_pixel(n, oh, ow, MR, Ho, Wo)
            continue
        for i in range(MR):
            y, x = oh * sy - py, ow * sx - px
            pixel = n * s_n + y * s_h + x * s_w
            for ik in range(kh):
                iy = y + ik * dy
                row_ok = (i < last) & (iy >= 0) & (iy < H)
                for jk in range(row_taps):
                    ix = x + jk * dx
                    ok = row_ok & (ix >= 0) & (ix < W)
                    _put(offs, at + (ik * kw + jk) * MR + i,
                         pixel + ik * dy * s_h + jk * dx * s_w if ok else -1)
            n, oh, ow = _next_pixel(n, oh, ow, 1, Ho, Wo)


@numba.njit(**JIT)
def rows_nhwc_task(task, x, geom, C, Cg, G, bpack, Np, K, Kg, out, bias, epi, KC, NC, MP, m,
                   KS, parts, runs, zeros, offs):
    """Output pixels ``task // parts * MP`` on (at most ``MP``, a multiple of MR), output
    channels ``task % parts * KS`` on (at most ``KS``, a multiple of NR) of each group.

    ``bpack`` holds group ``g``'s weights from ``g*Cg*ntaps*Np``: per KC block of input
    channels (``pc*ntaps*Np`` on), NR-column panels of ``ntaps*kc*NR`` values, each
    tap's ``kc x NR`` panel after the other.  Loops: groups, KC blocks, NC blocks of
    output channels (their weights stay in L2), row panels of pixels (their input
    rows stay in L1), NR panels.  ``runs``: a kernel row's taps may be read as one
    run (``im2col.rows_merged``); ``zeros`` holds at least ``KC`` zeros, and ``kw*C``
    with ``runs``.
    """
    kh, kw = geom[4], geom[5]
    ntaps = kh * kw
    stride = panel_stride(ntaps)
    p0 = task // parts * MP
    k0 = task % parts * KS
    k1 = min(k0 + KS, Kg)
    count = min(MP, m - p0)
    pixel_offsets(geom, (geom[0] * geom[1] * C, geom[1] * C, C), p0, count, m, runs, offs)
    panels = (count + MR - 1) // MR
    for g in range(G):
        b_g = g * Cg * ntaps * Np
        for pc in range(0, Cg, KC):
            kc = min(KC, Cg - pc)
            beta = DTYPE(0) if pc == 0 else DTYPE(1)
            e = epi if pc + KC >= Cg else 0
            a_at = g * Cg + pc
            b_pc = b_g + pc * ntaps * Np
            for jc in range(k0, k1, NC):
                j_end = min(jc + NC, k1)
                for q in range(panels):
                    pix = p0 + q * MR
                    rows = min(MR, m - pix)
                    c_at = pix * K + g * Kg
                    # A kernel row as one tap (taps j = 0 of each row, kw*MR apart).
                    merged = offs[q * stride + ntaps * MR] == 1
                    t_kc, t_step, t_n = (kw * kc, kw * MR, kh) if merged else (kc, MR, ntaps)
                    for jr in range(jc, j_end, NR):
                        cols = min(NR, Kg - jr)
                        b_at = b_pc + jr * ntaps * kc
                        if rows == MR and cols == NR:
                            ukernel_rows(t_kc, x, a_at, offs, q * stride, t_step, t_n, zeros,
                                         bpack, b_at, t_kc * NR, out, c_at + jr, K, DTYPE(1),
                                         beta, bias, g * Kg + jr, e)
                        else:
                            ukernel_rows_edge(t_kc, x, a_at, offs, q * stride, t_step, t_n,
                                              zeros, bpack, b_at, t_kc * NR, out, c_at + jr, K,
                                              DTYPE(1), beta, bias, g * Kg + jr, e, rows, cols)


@numba.njit(**JIT)
def rows_nhwc_tasks(counter, ntasks, x, geom, C, Cg, G, bpack, Np, K, Kg, out, bias, epi, KC,
                    NC, MP, m, KS, parts, runs, zeros, offs):
    """Tasks of :func:`rows_nhwc_task` taken from ``counter`` until ``ntasks`` are out."""
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        rows_nhwc_task(task, x, geom, C, Cg, G, bpack, Np, K, Kg, out, bias, epi, KC, NC, MP, m,
                       KS, parts, runs, zeros, offs)


@numba.njit(**JIT)
def rows_nchw_task(task, x, geom, C, bpack, Np, K, out, bias, epi, KC, NC, MP, m, KS, parts,
                   zeros, offs, cbuf):
    """Output pixels ``task // parts * MP`` on, output channels ``task % parts * KS`` on, of
    an NCHW batch, on the rows kernel.

    As :func:`rows_nhwc_task` for one group, with each pixel's channels read where
    they lie, ``H*W`` apart (``zeros`` holds ``(KC-1)*H*W + 1`` zeros, the padding
    read at the same stride).  The tile of C, pixels by channels, builds up in
    ``cbuf`` (``Np`` wide, at least ``MP`` rows) and is transposed into ``out`` once,
    after the last KC block: the kernel's vectors run along the output channels.
    """
    H, W, Ho, Wo, kh, kw = geom[0], geom[1], geom[2], geom[3], geom[4], geom[5]
    ntaps = kh * kw
    stride = panel_stride(ntaps)
    hw = H * W
    p0 = task // parts * MP
    k0 = task % parts * KS
    k1 = min(k0 + KS, K)
    count = min(MP, m - p0)
    pixel_offsets(geom, (C * hw, W, 1), p0, count, m, False, offs)
    panels = (count + MR - 1) // MR
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= C else 0
        b_pc = pc * ntaps * Np
        for jc in range(k0, k1, NC):
            j_end = min(jc + NC, k1)
            for q in range(panels):
                # Rows past the last pixel read zeros (offset -1) into rows never copied out.
                c_at = q * MR * Np
                for jr in range(jc, j_end, NR):
                    cols = min(NR, K - jr)
                    b_at = b_pc + jr * ntaps * kc
                    if cols == NR:
                        ukernel_rows_strided(kc, x, pc * hw, hw, offs, q * stride, MR, ntaps,
                                             zeros, bpack, b_at, kc * NR, cbuf, c_at + jr, Np,
                                             DTYPE(1), beta, bias, jr, e)
                    else:
                        ukernel_rows_strided_edge(kc, x, pc * hw, hw, offs, q * stride, MR,
                                                  ntaps, zeros, bpack, b_at, kc * NR, cbuf,
                                                  c_at + jr, Np, DTYPE(1), beta, bias, jr, e,
                                                  MR, cols)
    pixels_to_planes(cbuf, Np, p0, count, k0, k1, K, Ho * Wo, out)


@numba.njit(**JIT)
def transpose_copy(x, src, lds, rows, cols, y, dst, ldd):
    """``y[dst + j*ldd + r] = x[src + r*lds + j]`` for ``r < rows``, ``j < cols``.

    LANES x LANES blocks transposed in registers (:func:`transpose`); the last rows
    and columns one at a time.  Element by element, the copy took 1.5 ns an element.
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


@numba.njit(**JIT)
def pixels_to_planes(cbuf, ldc, p0, count, k0, k1, K, plane, out):
    """``out[n, k, q] = cbuf[(p - p0)*ldc + k]`` for batch pixels ``p = n*plane + q`` in
    ``p0 .. p0 + count`` and ``k0 <= k < k1`` (of ``K``): rows of pixels into NCHW
    channel planes."""
    p = p0
    while p < p0 + count:
        n = p // plane
        q = p - n * plane
        run = min(p0 + count - p, plane - q)          # pixels in image n
        transpose_copy(cbuf, (p - p0) * ldc + k0, ldc, run, k1 - k0, out,
                       (n * K + k0) * plane + q, plane)
        p += run


@numba.njit(**JIT)
def rows_nchw_tasks(counter, ntasks, x, geom, C, bpack, Np, K, out, bias, epi, KC, NC, MP, m,
                    KS, parts, zeros, offs, cbuf):
    """Tasks of :func:`rows_nchw_task` taken from ``counter`` until ``ntasks`` are out."""
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        rows_nchw_task(task, x, geom, C, bpack, Np, K, out, bias, epi, KC, NC, MP, m, KS, parts,
                       zeros, offs, cbuf)


# --- Winograd F(2x2, 3x3) ------------------------------------------------------------

@numba.njit(**JIT)
def winograd_task(task, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off, os,
                  bias, has_bias, act, KC, NC, a_slab, m_slab, apack, mbuf, tile, v):
    """One task = a block of ``MT`` tiles: input transform, 16 GEMMs, output transform.

    ``upack`` holds the 16 transformed filters as packed B: slab ``xi`` at
    ``xi*C*Kp``, KC block ``pc`` at ``+pc*Kp``.  ``apack`` (16 slabs of MT x KC,
    ``a_slab`` apart) and ``mbuf`` (16 slabs of MT x Kp, ``m_slab`` apart) belong to
    the calling thread.
    """
    t0 = task * MT
    mt = min(MT, tiles_total - t0)
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        pack_a_winograd(x, x_off, xs, geom, t0, mt, pc, kc, MR, apack, a_slab, v)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        for xi in range(16):
            for jc in range(0, K, NC):
                nc = min(NC, K - jc)
                macro_kernel(mt, nc, kc, apack, xi * a_slab, upack, xi * C * Kp + pc * Kp + jc * kc,
                             mbuf, xi * m_slab + jc, Kp, DTYPE(1), beta, bias, 0, 0, 0)
    unpack_winograd(mbuf, m_slab, Kp, t0, mt, K, out, o_off, os, geom, bias, has_bias, act)


@numba.njit(**JIT)
def winograd_tasks(counter, ntasks, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off,
                    os, bias, has_bias, act, KC, NC, a_slab, m_slab, apack, mbuf, tile, v):
    """Tasks of :func:`winograd_task` taken from ``counter`` (:func:`next_task`) until
    ``ntasks`` are out."""
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        winograd_task(task, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off, os,
                      bias, has_bias, act, KC, NC, a_slab, m_slab, apack, mbuf, tile, v)



# --- Winograd F(2x2, 3x3), NCHW: tiles as GEMM columns, vectors along the image width -----
#
# For each of the 16 positions xi:  M[xi][K, tiles] = U[xi]^T[K, C] @ V[xi][C, tiles].
# The transformed filters U^T are packed A (prepared once); the input transform writes
# V straight into packed B, LANES adjacent tiles of one tile row per vector, and the
# output transform reads LANES tiles of one output channel per vector.  A block of NB
# tiles (a multiple of NR) numbers tiles across the batch, so LANES consecutive tiles
# may span tile rows or images: each lane group is cut into *runs* of tiles sharing a
# tile row, and the masked transforms handle one run at a time.

@numba.njit(**JIT)
def winograd_runs(T0, nt, geom, xs, os, runs):
    """Describe tiles ``T0:T0+nt`` as runs within lane groups; returns the number of runs.

    ``runs[r] = (group_start, lo, hi, x_src, y0, col0, out_dst, out_rows, out_col0)``:
    lanes ``lo:hi`` of the group at block column ``group_start`` are tiles of one tile
    row, lane ``l`` being the tile whose input window starts at column ``col0 + 2*l``
    of input row ``y0`` (``x_src`` = offset of that pixel in channel 0) and whose
    output starts at column ``out_col0 + 2*l``, offset ``out_dst + 2*l`` of channel 0
    (``out_rows`` output rows: 1 at the bottom edge).
    """
    H, W, Ho, Wo, py, px, TH, TW = geom
    tiles = TH * TW
    count = 0
    for g in range(0, nt, LANES):
        end = min(LANES, nt - g)
        l = 0
        while l < end:
            t = T0 + g + l
            n = t // tiles
            ty = (t % tiles) // TW
            tx = t % TW
            run = min(end - l, TW - tx)
            y0 = 2 * ty - py
            col0 = 2 * (tx - l) - px
            runs[count, 0] = g
            runs[count, 1] = l
            runs[count, 2] = l + run
            runs[count, 3] = n * xs[0] + y0 * xs[2] + col0
            runs[count, 4] = y0
            runs[count, 5] = col0
            runs[count, 6] = n * os[0] + 2 * ty * os[2] + 2 * (tx - l)
            runs[count, 7] = min(2, Ho - 2 * ty)
            runs[count, 8] = 2 * (tx - l)
            count += 1
            l += run
    return count


@numba.njit(**JIT)
def winograd_input_block(x, x_off, sc, s_row, H, W, runs, nruns, p0, kc, buf, slab):
    """``V`` of channels ``p0:p0+kc`` for the block's runs, into 16 packed-B slabs of ``slab``."""
    for p in range(kc):
        src = x_off + (p0 + p) * sc
        for r in range(nruns):
            g = runs[r, 0]
            # Column g of packed B: panel g // NR, row p of the panel, column g % NR.
            dst = (g // NR) * NR * kc + p * NR + g % NR
            # Lanes from the run's first to the group's last are written: the group's
            # next run (runs go left to right) rewrites those past this one, and the
            # driver zeroes any past the block's last tile.  A run starting at lane 0
            # then stores whole vectors, never the slow partial ones.
            winograd_input(x, src + runs[r, 3], s_row, runs[r, 4], H, runs[r, 5], W,
                           runs[r, 1], LANES, buf, dst, slab)


@numba.njit(**JIT)
def winograd_output_block(m, slab, ldm, runs, nruns, k0, k1, out, o_off, sk, s_row, Wo, bias,
                          b_off, epi):
    """``Y = A^T m A`` + bias + activation for the block's runs, output channels ``k0:k1``
    (channel ``k`` in row ``k - k0`` of each of the 16 slabs of ``m``, its bias at
    ``bias[b_off + k]``)."""
    for k in range(k0, k1):
        b = bias[b_off + k] if epi & EPI_BIAS_ROW else DTYPE(0)
        dst = o_off + k * sk
        for r in range(nruns):
            winograd_output(m, (k - k0) * ldm + runs[r, 0], slab, out, dst + runs[r, 6], s_row,
                            runs[r, 8], Wo, runs[r, 7], runs[r, 1], runs[r, 2], b, epi)


@numba.njit(**JIT)
def winograd_nchw_task(task, x, x_off, xs, geom, C, upack, u_off, Kp, K, NB, whole, parts,
                       tiles_total, out, o_off, os, bias, b_off, epi, KC, b_slab, m_slab, bpack,
                       mbuf, tile, runs):
    """One task = a block of ``NB`` tiles (the first ``whole`` tasks) or one of the
    ``parts`` parts of the output channels of a later block: input transform, 16 GEMMs,
    output transform.

    ``upack[u_off:]`` holds the 16 transformed filter matrices U^T (K x C) as packed A,
    every row panel full (``Kp`` = K rounded up to MR, zero rows): block (xi, pc) at
    ``(xi*C + pc)*Kp``.  Output channel ``k``'s bias is ``bias[b_off + k]``.  The ``parts`` parts of a block share out its row panels; each
    transforms the block's whole input (where blocks alone are too few to keep every
    thread busy, that repeat costs less than an idle thread).  ``bpack`` (16 slabs of
    KC x NB, ``b_slab`` apart) and ``mbuf`` (16 slabs of Kp x NB, ``m_slab`` apart)
    belong to the calling thread and stay in L2; ``runs`` holds NB rows of 9.
    ``epi``: EPI_BIAS_ROW (bias per output channel) and the activation flags.
    """
    H, W, Ho, Wo, py, px, TH, TW = geom
    block, part, split = task, 0, 1
    if task >= whole:
        block, part, split = whole + (task - whole) // parts, (task - whole) % parts, parts
    panels = Kp // MR
    r0 = part * panels // split * MR
    r1 = (part + 1) * panels // split * MR
    T0 = block * NB
    nt = min(NB, tiles_total - T0)
    ncols = (nt + NR - 1) // NR * NR
    nruns = winograd_runs(T0, nt, geom, xs, os, runs)
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        winograd_input_block(x, x_off, xs[1], xs[2], H, W, runs, nruns, pc, kc, bpack, b_slab)
        if ncols > nt:
            # Columns past the last tile: zeros, so the GEMM never meets stale bits.
            for xi in range(16):
                for q in range(nt, ncols):
                    base = xi * b_slab + (q // NR) * NR * kc + q % NR
                    for p in range(kc):
                        bpack[base + p * NR] = 0
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        for xi in range(16):
            macro_kernel(r1 - r0, ncols, kc, upack, u_off + (xi * C + pc) * Kp + r0 * kc, bpack,
                         xi * b_slab, mbuf, xi * m_slab, NB, DTYPE(1), beta, bias, 0, 0, 0)
    winograd_output_block(mbuf, m_slab, NB, runs, nruns, r0, min(r1, K), out, o_off, os[1],
                          os[2], Wo, bias, b_off, epi)


@numba.njit(**JIT)
def winograd_nchw_tasks(counter, ntasks, groups, x, xs, geom, C, upack, u_group, Kp, K, NB,
                        whole, parts, tiles_total, out, os, bias, epi, KC, b_slab, m_slab, bpack,
                        mbuf, tile, runs):
    """Tasks of :func:`winograd_nchw_task` taken from ``counter`` (:func:`next_task`) until
    ``ntasks`` are out, ``ntasks // groups`` per group: group ``g`` reads input channels
    ``g*C:``, writes output channels ``g*K:`` (their bias too) and takes its transformed
    filters from ``upack[g*u_group:]``."""
    per_group = ntasks // groups
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        g = task // per_group
        winograd_nchw_task(task - g * per_group, x, g * C * xs[1], xs, geom, C, upack,
                           g * u_group, Kp, K, NB, whole, parts, tiles_total, out, g * K * os[1],
                           os, bias, g * K if epi & EPI_BIAS_ROW else 0, epi, KC, b_slab, m_slab,
                           bpack, mbuf, tile, runs)



# --- direct convolution, NCHW, horizontal stride 1: vectors along the output row ---------

@numba.njit(**JIT)
def depthwise_plane(geom):
    """(rows, row stride) of a channel zero padded for :func:`depthwise_rows`.

    Every vector of every output row reads whole: ``ROW`` columns rounded up past the
    last output column, plus the kernel's reach to the right.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    rows = (Ho - 1) * sy + (kh - 1) * dy + 1
    cols = (Wo + ROW - 1) // ROW * ROW + (kw - 1) * dx
    return rows, (cols + LANES - 1) // LANES * LANES


@numba.njit(**JIT)
def depthwise_flat_tasks(counter, ntasks, per_tick, x, planes, w, bias, has_bias, act, out,
                         out_plane, geom, copy, Hq, Wq, taps, masks, starts, rows, inner,
                         colmask, blocks, shorts, xq):
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
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    ntaps = kh * kw
    epi = act | (EPI_BIAS_ROW if has_bias else 0)
    K = w.size // ntaps
    nvec = starts.size
    while True:
        first = next_task(counter) * per_tick
        if first >= ntasks:
            break
        k = first % K
        for c in range(first, min(ntasks, first + per_tick)):
            dst = c * out_plane
            if copy:
                phase_split(x, c * H * W, H * W, W, 1, H, W, sy, sx, 0, 0, Hq, Wq,
                            sy * sx * Hq * Wq, xq, True)
                src = 0
            else:
                src = c * H * W
            w_off = k * ntaps
            b = bias[k] if has_bias else DTYPE(0)
            for i in range(blocks.size):
                q0 = blocks[i]
                depthwise_flat_inside(planes, src + q0, inner, ntaps, w, w_off, colmask,
                                      q0 % Wq, out, dst + q0, b, epi)
            for i in range(shorts.size):
                q0 = shorts[i]
                depthwise_flat_inside_short(planes, src + q0, inner, ntaps, w, w_off, colmask,
                                            q0 % Wq, out, dst + q0, b, epi)
            for v0 in range(0, nvec, DW_FLAT_SHORT):
                depthwise_flat(planes, src, taps, ntaps, w, w_off, masks, starts, rows, v0,
                               min(DW_FLAT_SHORT, nvec - v0), out, dst, b, epi)
            k = k + 1 if k + 1 < K else 0


@numba.njit(**JIT)
def depthwise_nhwc_tasks(counter, ntasks, x, wt, bias, epi, out, geom, C):
    """Depthwise NHWC rows (task ``n*Ho + oh``), the lanes over the channels.

    ``wt`` holds the weights (kh, kw, C), ``C`` at least DW_NHWC_VECTORS*LANES; the
    last block of channels overlaps the one before, so every store is whole.  Output
    columns whose every tap lies in the image row run in groups of the kernel's
    pixels (the last group overlapping the one before); the others one at a time,
    each over its taps inside the image.  ``epi`` carries the bias
    (``EPI_BIAS_COL``) and activation flags.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    wide = C >= DW_NHWC_WIDE * LANES
    CB = (DW_NHWC_WIDE if wide else DW_NHWC_VECTORS) * LANES
    P = 1 if wide else DW_NHWC_PIXELS
    edge = WIDE if wide else ONE
    # Columns ow with 0 <= ow*sx - px and ow*sx + (kw-1)*dx - px < W.
    lo = min(Wo, (px + sx - 1) // sx)
    reach = W - 1 - (kw - 1) * dx + px
    hi = max(lo, min(Wo, reach // sx + 1)) if reach >= 0 else lo
    step = P if hi - lo >= P else 1
    inner = WIDE if wide else (RUN if step == P else ONE)
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        n, oh = task // Ho, task % Ho
        y0 = oh * sy - py
        i0 = max(0, (dy - 1 - y0) // dy)                  # first kernel row inside the image
        i1 = min(kh, (H - 1 - y0) // dy + 1) if y0 < H else 0
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
            j0 = max(0, (dx - 1 - x0) // dx)
            j1 = min(kw, (W - 1 - x0) // dx + 1) if x0 < W else 0
            nj = max(0, j1 - j0)
            src = (row + x0 + j0 * dx) * C if nj else 0
            for c in range(0, C, CB):
                c = min(c, C - CB)
                depthwise_nhwc(edge, x, src + c, 0, dy * W * C, dx * C, i1 - i0 if nj else 0,
                               nj, wt, w_row + j0 * C + c, C, kw, out, (dst_row + ow) * C + c,
                               0, bias, c, epi)
        for ow in range(lo, hi, step):
            ow = min(ow, hi - step)
            src = (row + ow * sx - px) * C
            for c in range(0, C, CB):
                c = min(c, C - CB)
                depthwise_nhwc(inner, x, src + c, sx * C, dy * W * C, dx * C, i1 - i0, kw, wt,
                               w_row + c, C, kw, out, (dst_row + ow) * C + c, C, bias, c, epi)


@numba.njit(**JIT)
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
    kn = min(KB, (g + 1) * Kg - k0)
    lda = (Wo + ROW - 1) // ROW * ROW
    if Cg == 1 and kn == 1:
        # One input channel per output channel (depthwise): the channel is copied zero
        # padded into acc, so the row loads need no masks; each vector of the row is
        # summed, biased and activated in a register and stored straight to out.
        epi = act | (EPI_BIAS_ROW if has_bias else 0)
        Hp, Wp = depthwise_plane(geom)
        # The zero-padded copy of one channel: phase_split with a single phase.
        phase_split(x, (n * C + g) * H * W, H * W, W, 1, H, W, 1, 1, py, px, Hp, Wp, Hp * Wp,
                    acc)
        # Ask for the start of the next channel now: a small channel is a few short
        # rows, too short for the hardware prefetcher to pick up before they are read.
        if (n * C + g + 1) * H * W < x.size:
            for q in range(0, min(H * W, 4096 // x.itemsize), 64 // x.itemsize):
                prefetch(x, (n * C + g + 1) * H * W + q)
        dst = (n * K + k0) * Ho * Wo
        b = bias[k0] if has_bias else DTYPE(0)
        whole = Ho // DW_ROWS * DW_ROWS
        for t in range(0, Wo, ROW):
            count = min(ROW, Wo - t)
            for oh in range(0, whole, DW_ROWS):
                depthwise_rows(acc, oh * sy * Wp + t, Wp, sy * Wp, count, w, k0 * kh * kw, kh, kw,
                               dy, dx, out, dst + oh * Wo + t, Wo, b, epi)
            for oh in range(whole, Ho):
                depthwise_row(acc, oh * sy * Wp + t, Wp, sy * Wp, count, w, k0 * kh * kw, kh, kw,
                              dy, dx, out, dst + oh * Wo + t, Wo, b, epi)
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
                    direct_row_out(x, src + t, W, y0, H, t - px, W, min(ROW, Wo - t), w,
                                   (k0 + kk) * kh * kw, kh, kw, dy, dx, out, dst + t, b, epi)
        return
    for oh in range(Ho):
        acc[:kn * lda] = 0
        y0 = oh * sy - py
        for c in range(Cg):
            src = ((n * C + g * Cg + c) * H + y0) * W - px
            for kk in range(kn):
                w_off = ((k0 + kk) * Cg + c) * kh * kw
                for t in range(0, Wo, ROW):
                    direct_row(x, src + t, W, y0, H, t - px, W, min(ROW, Wo - t), w, w_off,
                               kh, kw, dy, dx, acc, kk * lda + t)
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


@numba.njit(**JIT)
def direct_nchw_tasks(counter, ntasks, per_tick, x, w, bias, has_bias, act, out, shape, geom,
                      KB, acc):
    """Tasks of :func:`direct_nchw_task`, ``per_tick`` at a time taken from ``counter``
    (:func:`next_task`) until ``ntasks`` are out: a small depthwise channel is a
    microsecond of work, less than threads contending for the counter cost."""
    while True:
        first = next_task(counter) * per_tick
        if first >= ntasks:
            break
        for task in range(first, min(ntasks, first + per_tick)):
            direct_nchw_task(task, x, w, bias, has_bias, act, out, shape, geom, KB, acc)


# --- im2col without patches, NCHW: B read in place from the image --------------------
#
# With the image zero padded and split into its sy*sx stride phases
# (``xq[c, a, b, r, s] = xpad[c, r*sy + a, s*sx + b]``, each phase Hq x Wq), the
# patch-matrix row of channel c and kernel tap (i, j) over the output grid
# ``q = oh*Wq + ow`` is one contiguous run of ``xq``: it starts at
# ``c*chan + phase(i, j) + (i*dy // sy)*Wq + (j*dx // sx)``.  For a fixed tap the
# rows of successive channels are ``chan`` apart, a constant stride, so the strided
# micro-kernel reads B straight from ``xq`` and one GEMM per tap accumulates into
# the output tile: the 9x (kh*kw) blow-up of packing patches never happens; the
# copy is about one image.  The grid is Wq wide, so ``Wq - Wo`` columns per output
# row are computed and dropped, and C goes through a buffer.
#
# Stride 1 with Wo == W needs no copy at all: the grid is the image plane and the
# output plane (``q = oh*W + ow``), tap (i, j) of a grid position reads
# ``(i*dy - py)*W + j*dx - px`` elements away in the image itself, and tiles store
# straight into the output.  Where that would wrap round to the neighbouring row
# (left and right edges), leave the image plane (top and bottom rows) or pass the
# last grid position, the micro-kernel's masked loads read zero instead, without
# touching the memory; taps whose reads all stay in the image may instead read
# unmasked and have their sum masked once (``panel_masks`` in ``conv/im2col.py``).
#
# Other strides whose phase planes are exactly as wide as the output
# (``ceil(W/sx) == Wo``) get the same grid from an unpadded phase copy: tap (i, j)
# reads plane ((i*dy - py) mod sy, (j*dx - px) mod sx), rows and columns away by the
# floor quotients (negative above and left), through the same masks.

ukernel_taps = microkernel(DTYPE, ISA, MR, NR, Flavour.TAPS)
#: One vector wide, for a last panel of at most LANES columns (ResNet-18 conv5_x: 49
#: columns an image, 3 panels of 16 and 1 of 8 instead of 4 of 16).
ukernel_taps_narrow = microkernel(DTYPE, ISA, MR, LANES, Flavour.TAPS)
#: The last row panel of C when the output channels are not a multiple of MR, written
#: straight to the output by kernels of 4 and 2 rows over the first rows of MR-row
#: packed panels: every power-of-two channel count from 8 on leaves 2 or 4 rows of a
#: 6-row tile (ResNet-18 conv2_x: 64 = 10*6 + 4).  Other counts take a whole tile
#: through the C buffer.
ukernel_taps_4 = (microkernel(DTYPE, ISA, 4, NR, Flavour.TAPS, a_step=MR) if MR > 4
                  else ukernel_taps)
ukernel_taps_2 = (microkernel(DTYPE, ISA, 2, NR, Flavour.TAPS, a_step=MR) if MR > 2
                  else ukernel_taps)


@numba.njit(inline='always', **JIT)
def short_rows(rows):
    """Rows of the last row panel that a short kernel writes straight to C, else 0."""
    return rows if (rows == 4 and MR > 4) or (rows == 2 and MR > 2) else 0


@numba.njit(inline='always', **JIT)
def _split_fits(t, px, W, Wq):
    """Whether grid columns ``t:t+LANES`` of both phases of a stride-2 row lie inside it."""
    return t >= 0 and t + LANES <= Wq and 2 * t - px >= 0 and 2 * (t + LANES) - px <= W


@numba.njit(**JIT)
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
        if _split_fits(t, px, W, Wq):
            deinterleave(x, src + col, xq, even + t, odd + t)
            continue
        if t + LANES > Wq and _split_fits(Wq - LANES, px, W, Wq):
            last = Wq - LANES
            deinterleave(x, src + 2 * last - px, xq, even + last, odd + last)
            continue
        count = min(LANES, Wq - t)
        copy_run(x, src + col, col, W, xq, even + t, count, 2)
        copy_run(x, src + col + 1, col + 1, W, xq, odd + t, LANES if spill else count, 2)


@numba.njit(**JIT)
def phase_split(x, x_off, sc, s_row, C, H, W, sy, sx, py, px, Hq, Wq, chan, xq, spill=False):
    """Write channels ``0:C`` of one image, zero padded and split by stride phase, into ``xq``.

    ``xq[c*chan + (a*sx + b)*Hq*Wq + r*Wq + s] = x[c, r*sy + a - py, s*sx + b - px]``
    (zero outside the image).  Assumes contiguous image rows.  With ``spill``, rows
    are written in whole vectors, up to LANES - 1 values past their end: the next
    row overwrites them, and ``xq`` has LANES of slack after the last one.  A
    partial vector store is slow microcode on Zen 3.
    """
    plane = Hq * Wq
    for c in range(C):
        for a in range(sy):
            for b in range(sx):
                base = c * chan + (a * sx + b) * plane
                for r in range(Hq):
                    dst = base + r * Wq
                    y = r * sy + a - py
                    if y < 0 or y >= H:
                        xq[dst:dst + Wq] = 0
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
                            copy_run(x, src + col, col, W, xq, dst + t,
                                     LANES if spill else min(LANES, Wq - t), sx)
                        continue
                    # Columns s with 0 <= s*sx + b - px < W.
                    lo = min(Wq, max(0, (px - b + sx - 1) // sx))
                    hi = max(lo, min(Wq, (W - 1 + px - b) // sx + 1))
                    xq[dst:dst + lo] = 0
                    for s in range(lo, hi):
                        xq[dst + s] = x[src + s * sx + b - px]
                    xq[dst + hi:dst + Wq] = 0


@numba.njit(**JIT)
def shifted_block(xq, b_base, chan, taps, ntaps, masks, sched, Cg, KC, MC, apack, a_off, Mp,
                  m0, m1, rows_full, short, j0, cols, c, c_off, ldc, tail, tail_ld, bias, b_off,
                  epi):
    """Rows ``m0:m1`` x grid columns ``j0:j0+cols`` of the output, into C.

    Sums, over KC blocks of channels and over taps, packed A (block pc at
    ``a_off + pc*Mp*ntaps``, each row panel's taps one after another) times B read in place
    at ``xq[b_base + pc*chan + taps[t] + j0:]`` (rows ``chan`` apart).  Each tile
    sums every tap of a KC block in registers (:func:`ukernel_taps`), so C is
    updated once per KC block, not once per tap.  The panel starting at grid column
    ``q`` orders and masks its taps by the schedule ``sched[q // NR]`` (see
    ``make_microkernel``).  The usual blocking: an MC x KC block of A stays in L2
    across the NR-wide column panels, each panel's image rows stay in L1 across the
    block's row panels.

    Tiles of rows below ``rows_full`` and whole NR columns go to C (row ``m0 + i``,
    column ``j0 + j`` at ``c[c_off + i*ldc + j]``), and so do the first ``short``
    rows (:func:`short_rows`) of the row panel at ``rows_full`` in whole NR columns;
    the others (a partial row panel, a partial last column panel) whole into
    ``tail`` at ``i*tail_ld + j``, in the same pass over A and B.  A last panel of
    at most LANES columns runs the one-vector kernel.  ``j0``, ``m0``, ``m1``,
    ``rows_full`` and ``MC`` are multiples of NR or MR; beta 0 on the first KC block,
    ``epi`` on the last.
    """
    full = cols // NR * NR
    for pc in range(0, Cg, KC):
        kc = min(KC, Cg - pc)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= Cg else 0
        for ic in range(m0, m1, MC):
            ic_end = min(ic + MC, m1)
            for jr in range(0, cols, NR):
                tm = sched[(j0 + jr) // NR]
                narrow = jr == full and cols - full <= LANES < NR
                b_at = b_base + pc * chan + j0 + jr
                for ir in range(ic, ic_end, MR):
                    a_at = a_off + (pc * Mp + ir * kc) * ntaps
                    if ir < rows_full and jr < full:
                        dst, c_at, ld = c, c_off + (ir - m0) * ldc + jr, ldc
                    elif ir == rows_full and short and jr < full:
                        c_at = c_off + (ir - m0) * ldc + jr
                        if short == 4:
                            ukernel_taps_4(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                           masks, 0, tm, c, c_at, ldc, DTYPE(1), beta, bias,
                                           b_off + ir, e)
                        else:
                            ukernel_taps_2(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                           masks, 0, tm, c, c_at, ldc, DTYPE(1), beta, bias,
                                           b_off + ir, e)
                        continue
                    else:
                        dst, c_at, ld = tail, (ir - m0) * tail_ld + jr, tail_ld
                    if narrow:
                        ukernel_taps_narrow(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                            masks, 0, tm, dst, c_at, ld, DTYPE(1), beta, bias,
                                            b_off + ir, e)
                    else:
                        ukernel_taps(kc, apack, a_at, MR * kc, xq, b_at, chan, taps, ntaps,
                                     masks, 0, tm, dst, c_at, ld, DTYPE(1), beta, bias, b_off + ir,
                                     e)


@numba.njit(**JIT)
def _copy_rows(cbuf, ldb, out, dst, ldo, rows, cols):
    """``out[dst + k*ldo : +cols] = cbuf[k*ldb : +cols]`` for ``k < rows``."""
    for k in range(rows):
        out[dst + k * ldo:dst + k * ldo + cols] = cbuf[k * ldb:k * ldb + cols]


@numba.njit(**JIT)
def shifted_task(n, part, parts, copy, x, x_off, xs, geom, Cg, taps, ntaps, masks, sched,
                 apack, a_off, Mp, M, out, o_off, os, bias, b_off, epi, KC, MC, NCB, Hq, Wq,
                 layout, direct, chan, slack, q_end, xq, cbuf):
    """Part ``part`` of ``parts`` of image ``n``: its share of the column blocks of the
    output grid's first ``q_end`` columns.

    ``layout`` FLAT (stride 1 and ``Wq == Wo == W``): the grid is the image plane and
    the output plane, B is read from ``x`` itself, channels ``chan`` apart.  PHASED:
    the same grid (``Wq == Wo``), B read from an unpadded stride-split copy in
    ``xq`` after ``slack`` zeros.  For both, with ``direct`` whole tiles go straight
    into ``out``, only the partial row panel and last column panel through
    ``cbuf``; without, C goes through ``cbuf``.  PADDED: the image is split by
    stride phase, zero padded, into ``xq``, every tile goes through ``cbuf`` and the
    valid columns are copied out.  A thread whose previous task had the same image
    skips the copy (``copy`` False).  ``taps`` holds each kernel tap's offset from
    a grid position, ``masks`` and ``sched`` the masks and each panel's tap
    schedule (see :func:`shifted_block`); ``cbuf`` is an ``Mp x NCB`` block of C
    (``NCB`` a multiple of NR); the column blocks are cut into ``parts`` runs.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    if layout == PHASED:
        # Unpadded planes (the taps reach across their edges through masks), after
        # ``slack`` zeros: B starts there.
        if copy:
            phase_split(x, x_off + n * xs[0], xs[1], xs[2], Cg, H, W, sy, sx, 0, 0, Hq, Wq,
                        chan, xq[slack:])
        src, src_off = xq, slack
    else:
        if copy and layout == PADDED:
            phase_split(x, x_off + n * xs[0], xs[1], xs[2], Cg, H, W, sy, sx, py, px, Hq, Wq,
                        chan, xq)
        src, src_off = x, x_off + n * xs[0]
    co = o_off + n * os[0]
    sk = os[1]
    grid = q_end
    m_full = M // MR * MR
    blocks = (grid + NCB - 1) // NCB
    per_part = (blocks + parts - 1) // parts
    for blk in range(part * per_part, min(blocks, (part + 1) * per_part)):
        j0 = blk * NCB
        cols = min(NCB, grid - j0)
        panels = (cols + NR - 1) // NR * NR
        if layout != PADDED and not direct:
            # A tile's rows would share L1 sets in out (channels a whole number of pages
            # apart): C goes through cbuf, copied out once.
            shifted_block(src, src_off, chan, taps, ntaps, masks, sched, Cg, KC, MC, apack,
                          a_off, Mp, 0, Mp, 0, 0, j0, cols, cbuf, 0, NCB, cbuf, NCB, bias, b_off,
                          epi)
            _copy_rows(cbuf, NCB, out, co + j0, sk, M, cols)
            continue
        if layout != PADDED:
            # The grid is the output plane: whole tiles straight in, the partial row
            # panel and last column panel through cbuf.
            short = short_rows(M - m_full)
            shifted_block(src, src_off, chan, taps, ntaps, masks, sched, Cg, KC, MC, apack,
                          a_off, Mp, 0, Mp, m_full, short, j0, cols, out, co + j0, sk, cbuf, NCB,
                          bias, b_off, epi)
            full = cols // NR * NR
            if full < cols:
                _copy_rows(cbuf[full:], NCB, out, co + j0 + full, sk, m_full, cols - full)
            if m_full < M:
                done = full if short else 0     # whole columns the short kernel wrote
                _copy_rows(cbuf[m_full * NCB + done:], NCB, out, co + m_full * sk + j0 + done, sk,
                           M - m_full, cols - done)
            continue
        shifted_block(xq, 0, chan, taps, ntaps, masks, sched, Cg, KC, MC, apack, a_off, Mp, 0,
                      Mp, 0, 0, j0, panels, cbuf, 0, NCB, cbuf, NCB, bias, b_off, epi)
        # The valid columns, one output-row run at a time.
        q = j0
        while q < j0 + cols:
            oh = q // Wq
            ow = q % Wq
            run = min(Wq - ow, j0 + cols - q)
            if ow < Wo:
                _copy_rows(cbuf[q - j0:], NCB, out, co + oh * Wo + ow, sk, M, min(run, Wo - ow))
            q += run


@numba.njit(**JIT)
def pack_tails(x, x_off, xs0, xs1, N, reads, ntaps, tail, pc, kc, bpack):
    """B of :func:`shifted_tails` for channels ``pc:pc+kc``, as NR-wide packed panels.

    Column ``j = n*tail + i`` is tail column ``i`` of image ``n``; row ``t*kc + k``
    is what tap ``t`` reads there in channel ``pc + k``: the pixel ``reads[t, i]``
    elements into the channel, zero where that is -1 (outside the image).  Columns
    past ``N*tail`` are zero.
    """
    ncols = N * tail
    rows = ntaps * kc
    for jp in range(0, ncols, NR):
        panel = bpack[jp * rows:(jp + NR) * rows]
        for j in range(NR):
            if jp + j >= ncols:
                for r in range(rows):
                    panel[r * NR + j] = 0
                continue
            n, i = (jp + j) // tail, (jp + j) % tail
            base = x_off + n * xs0 + pc * xs1
            for t in range(ntaps):
                src = base + reads[t, i]
                for k in range(kc):
                    panel[(t * kc + k) * NR + j] = x[src + k * xs1] if reads[t, i] >= 0 else 0


@numba.njit(**JIT)
def shifted_tails(x, x_off, xs, N, Cg, reads, ntaps, q0, tail, KC, apack, a_off, Mp, M, m0, m1,
                  out, o_off, os, bias, b_off, epi, bpack, cbuf):
    """Rows ``m0:m1`` (MR multiples) of grid columns ``q0:q0+tail`` (the part of a panel
    after the last whole one) of every image, as one GEMM with columns from all the
    images.

    Each image's own tail panel would run mostly idle lanes (ResNet-18 conv4_x: 4
    of 16 columns, 5% of the layer's time; conv5_x: 1 column, 19%).  A is the taps
    kernel's (each row panel's taps are one packed panel of ``ntaps*kc``), B is
    packed from the images by :func:`pack_tails`, C goes through ``cbuf`` into
    each image.
    """
    ldc = (N * tail + NR - 1) // NR * NR
    for pc in range(0, Cg, KC):
        kc = min(KC, Cg - pc)
        pack_tails(x, x_off, xs[0], xs[1], N, reads, ntaps, tail, pc, kc, bpack)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= Cg else 0
        macro_kernel(m1 - m0, ldc, ntaps * kc, apack, a_off + (pc * Mp + m0 * kc) * ntaps, bpack,
                     0, cbuf, m0 * ldc, ldc, DTYPE(1), beta, bias, b_off + m0, 0, e)
    for n in range(N):
        _copy_rows(cbuf[m0 * ldc + n * tail:], ldc, out, o_off + n * os[0] + m0 * os[1] + q0,
                   os[1], min(m1, M) - m0, tail)


@numba.njit(**JIT)
def shifted_tasks(counter, ntasks, parts, groups, a_group, bias_group, x, x_off, xs, geom, Cg,
                  taps, ntaps, masks, sched, apack, Mp, M, out, o_off, os, bias, epi, KC, MC, NCB,
                  Hq, Wq, layout, direct, chan, slack, q_end, reads, tail_tasks, tail_parts,
                  tail_imgs, xq, cbuf, bpack):
    """Tasks taken from ``counter`` until ``ntasks`` are out, ``ntasks // groups`` per group.

    Group ``g`` reads channels ``g*Cg:`` of ``x``, writes its ``M`` output channels from
    ``g*M``, its packed weights start at ``apack[g*a_group]`` and its bias at
    ``bias[g*bias_group]``.  In a group, the first ``tail_tasks`` run
    :func:`shifted_tails` over the grid columns from ``q_end`` on (``reads``: where
    their taps read in a channel): ``tail_imgs`` images per GEMM, each cut into
    ``tail_parts`` shares of its row panels so threads split that work too.  The
    others are image * parts + part, up to ``q_end``.
    """
    grid = geom[2] * Wq
    per_group = ntasks // groups
    N = (per_group - tail_tasks) // parts
    last = -1
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        g = task // per_group
        task -= g * per_group
        xg, og = x_off + g * Cg * xs[1], o_off + g * M * os[1]
        ag, bg = g * a_group, g * bias_group
        if task < tail_tasks:
            n0 = task // tail_parts * tail_imgs
            per = (Mp // MR + tail_parts - 1) // tail_parts * MR
            m0 = task % tail_parts * per
            if m0 < Mp:
                shifted_tails(x, xg + n0 * xs[0], xs, min(tail_imgs, N - n0), Cg, reads, ntaps,
                              q_end, grid - q_end, KC, apack, ag, Mp, M, m0, min(Mp, m0 + per),
                              out, og + n0 * os[0], os, bias, bg, epi, bpack, cbuf)
            continue
        task -= tail_tasks
        n = task // parts
        image = g * N + n               # the copy in xq is of this image's group
        shifted_task(n, task % parts, parts, image != last, x, xg, xs, geom, Cg, taps, ntaps,
                     masks, sched, apack, ag, Mp, M, out, og, os, bias, bg, epi, KC, MC, NCB,
                     Hq, Wq, layout, direct, chan, slack, q_end, xq, cbuf)
        last = image


# --- im2col without patches, NHWC grouped: each group's channels copied as planes ---------
#
# In NHWC a group's few channels are interleaved with every other group's, so the
# taps kernel cannot read them in place.  A task (image, group) copies the group's
# channels into planes (a per-thread buffer laid out as an NCHW image of ``Cg``
# channels), runs the taps kernel over them exactly as on an NCHW image read in
# place (stride 1, the output as wide as the image), and writes each block of C
# back interleaved: the copies are of one group of one image, never the whole array.


@numba.njit(**JIT)
def shifted_nhwc_tasks(counter, ntasks, groups, G, a_group, bias_group, x, C, pixels, out_pixels,
                       Cg, taps, ntaps, masks, sched, apack, Mp, Kg, K, out, bias, epi, KC, MC,
                       NCB, xq, cbuf):
    """Tasks (image, block of ``G`` groups) taken from ``counter`` until ``ntasks`` are out.

    Group ``g``'s packed weights start at ``apack[g*a_group]``, its bias at
    ``bias[g*bias_group]``; ``taps``, ``masks`` and ``sched`` are those of an NCHW
    image of ``Cg`` channels read in place (``pixels`` per input plane, ``out_pixels``
    per output plane: the grid is the output plane, as wide as the input's but not
    necessarily as high).  A block's groups
    are copied together, so each pixel's run of their channels is read whole, and
    written back together: for each block of ``NCB`` output pixels, group ``i`` of
    the block writes its whole row panels into ``cbuf`` from row ``i*Kg`` (the next
    group's rows overwrite the padding rows), so the block's output channels are
    consecutive rows, then into ``out`` (NHWC, ``K`` channels).  ``cbuf`` holds
    ``(G - 1)*Kg + Mp`` rows of ``NCB``.
    """
    blocks = (groups + G - 1) // G
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        n, g0 = task // blocks, task % blocks * G
        ng = min(G, groups - g0)
        transpose_copy(x, n * pixels * C + g0 * Cg, C, pixels, ng * Cg, xq, 0, pixels)
        for j0 in range(0, out_pixels, NCB):
            cols = min(NCB, out_pixels - j0)
            for i in range(ng):
                g = g0 + i
                shifted_block(xq, i * Cg * pixels, pixels, taps, ntaps, masks, sched, Cg, KC, MC,
                              apack, g * a_group, Mp, 0, Mp, 0, 0, j0, cols, cbuf, 0, NCB,
                              cbuf[i * Kg * NCB:], NCB, bias, g * bias_group, epi)
            transpose_copy(cbuf, 0, NCB, ng * Kg, cols, out,
                           (n * out_pixels + j0) * K + g0 * Kg, K)
