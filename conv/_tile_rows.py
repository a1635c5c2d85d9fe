"""Template for the rows drivers (A rows read in place from the image), bound to one micro-kernel.

Written once per GEMM kernel (MR, NR, ISA) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64).
"""
import numba
import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import JIT, imax, imin, inner_jit, jit
from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.registry import get_kernel, microkernel
from tilegemm.kernels.sync import next_task

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_KERNEL = get_kernel(DTYPE, MR, NR, ISA)
macro_kernel = _KERNEL.module.macro_kernel
LANES = _KERNEL.lanes
_SHARED = engine.template_module("shared", DTYPE, isa=ISA)
transpose_copy = _SHARED.transpose_copy
geom_of = _SHARED.geom_of
UNIT, FALSE = _SHARED.UNIT, _SHARED.FALSE


# --- implicit im2col, NHWC, A rows read in place: out[N*Ho*Wo, K] = col^T @ W^T ----------
#
# A row of col^T is one output pixel; under tap (i, j) its values are the channels of
# one input pixel, contiguous in NHWC.  So the rows flavour reads A straight from the
# image, one offset per pixel and tap (a negative one reads a zero row: the padding),
# and sums every tap of a channel block in registers against the packed weights.
# With every channel in one block and no groups, the kw taps of a kernel row read kw
# adjacent pixels: one run of kw*C values, so such a row is one tap of kw*C steps
# (a 3-channel 7x7 stem: 7 taps of 21 steps instead of 49 of 3).

ukernel_rows_edge = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS_EDGE)
ukernel_rows_panels = microkernel(DTYPE, ISA, MR, NR, Flavour.ROWS_PANELS)
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
    # is the rows path's overhead).
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


@inner_jit
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
        last = imin(MR, m - p0 - q * MR)              # pixels of the panel that exist
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


@numba.njit(inline='always', **JIT)
def rows_nhwc_task(task, plan, x, bpack, bias, epi, out, zeros, offs, beta0):
    """Output pixels ``task // parts * MP`` on (at most ``MP``, a multiple of MR), output
    channels ``task % parts * KS`` on (at most ``KS``, a multiple of NR) of each group.

    ``bpack`` holds group ``g``'s weights from ``g*Cg*ntaps*Np``: per KC block of input
    channels (``pc*ntaps*Np`` on), NR-column panels of ``ntaps*kc*NR`` values, each
    tap's ``kc x NR`` panel after the other.  Loops: groups, KC blocks, NC blocks of
    output channels (their weights stay in L2), then :func:`rows_panel_runs` (runs of
    row panels of pixels, whose input rows stay in L1, by NR panels).  ``runs``: a
    kernel row's taps may be read as one run (``rows.rows_merged``); ``zeros`` holds
    at least ``KC`` zeros, and ``kw*C`` with ``runs``.  ``plan`` is
    :func:`tilegemm.conv.rows.rows_plan`'s record (its names here); ``offs`` is the
    thread's.  ``beta0`` scales what ``out`` holds before the first KC block: 0, or 1
    to add the convolution to it (a residual).
    """
    r = plan[0]
    geom = geom_of(r)
    C, Cg, G, Np, K, Kg = r.C, r.Cg, r.G, r.Np, r.K, r.Kg
    KC, NC, MP, m, KS, parts, runs = r.KC, r.NC, r.MP, r.m, r.KS, r.parts, r.merged != 0
    ntaps = r.kh * r.kw
    p0 = task // parts * MP
    k0 = task % parts * KS
    k1 = imin(k0 + KS, Kg)
    count = imin(MP, m - p0)
    pixel_offsets(geom, (geom[0] * geom[1] * C, geom[1] * C, C), p0, count, m, runs, offs)
    for g in range(G):
        b_g = g * Cg * ntaps * Np
        for pc in range(0, Cg, KC):
            kc = imin(KC, Cg - pc)
            beta = beta0 if pc == 0 else DTYPE(1)
            e = epi if pc + KC >= Cg else 0
            a_at = g * Cg + pc
            b_pc = b_g + pc * ntaps * Np
            for jc in range(k0, k1, NC):
                j_end = imin(jc + NC, k1)
                rows_panel_runs(plan, x, offs, zeros, bpack, out, bias, (a_at, b_pc, kc),
                                (p0 * K + g * Kg, count, g * Kg), (jc, j_end), (beta, e))


@numba.njit(inline='always', **JIT)
def rows_panel_runs(plan, x, offs, zeros, bpack, out, bias, block, pixels, channels, finish):
    """:func:`rows_nhwc_task`'s panels of pixels times output channels of one KC block.
    ``block = (a_at, b_pc, kc)``: the block's first channel in the image and its
    weights; ``pixels = (c_at, count, k_g)``: the panels' ``count`` pixels from C's
    ``c_at`` and this group's channels from ``k_g``; ``channels = (jc, j_end)``;
    ``finish = (beta, epi)``.

    Runs of up to ``QB`` panels (every panel when one NR panel of weights covers the
    channels) are taken one NR panel at a time, so their input pixels stay in L1 from
    one NR panel to the next.  Within a run, each stretch of panels that read their
    kernel rows alike (each row as one run of ``kw*kc`` values, or tap by tap) goes
    through the panels kernel in one call: a layer of short k loops (a 1x1 layer of
    few channels, a 3-channel stem) pays the call and its set-up once per stretch
    instead of once per tile.  The last panel when it has fewer than MR pixels, and
    the last NR panel when narrower, take the edge kernel a tile at a time.
    """
    r = plan[0]
    Kg, K, QB, kh, kw = r.Kg, r.K, r.QB, r.kh, r.kw
    ntaps = kh * kw
    stride = panel_stride(ntaps)
    a_at, b_pc, kc = block
    c_at, count, k_g = pixels
    jc, j_end = channels
    beta, e = finish
    panels = (count + MR - 1) // MR
    full = count // MR                                # panels of MR pixels
    run = panels if j_end - jc <= NR else QB
    for q0 in range(0, panels, run):
        q1 = imin(q0 + run, panels)
        for jr in range(jc, j_end, NR):
            cols = imin(NR, Kg - jr)
            b_at = b_pc + jr * ntaps * kc
            q = q0
            while q < q1:
                # A stretch of panels alike: a kernel row as one tap (offsets of the
                # rows' taps j = 0, kw*MR apart) or tap by tap.
                merged = offs[q * stride + ntaps * MR]
                end = q + 1
                while end < q1 and offs[end * stride + ntaps * MR] == merged:
                    end += 1
                t_kc, t_step, t_n = (kw * kc, kw * MR, kh) if merged == 1 else (kc, MR, ntaps)
                whole = imin(end, full) if cols == NR else q
                if whole > q:
                    ukernel_rows_panels(t_kc, x, a_at, offs, q * stride, t_step, t_n, zeros,
                                        bpack, b_at, t_kc * NR, out, c_at + q * MR * K + jr, K,
                                        DTYPE(1), beta, bias, k_g + jr, e, whole - q, stride)
                for t in range(imax(q, whole), end):
                    ukernel_rows_edge(t_kc, x, a_at, offs, t * stride, t_step, t_n, zeros,
                                      bpack, b_at, t_kc * NR, out, c_at + t * MR * K + jr, K,
                                      DTYPE(1), beta, bias, k_g + jr, e,
                                      imin(MR, count - t * MR), cols)
                q = end


@jit
def rows_nhwc_tasks(counter, plan, x, bpack, bias, epi, out, zeros, offs, beta0):
    """Tasks of :func:`rows_nhwc_task` taken from ``counter`` until the plan's ``ntasks``
    are out."""
    ntasks = plan[0].ntasks
    beta0 = DTYPE(beta0)
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        rows_nhwc_task(task, plan, x, bpack, bias, epi, out, zeros, offs, beta0)


@numba.njit(inline='always', **JIT)
def rows_nchw_task(task, plan, x, bpack, bias, epi, out, zeros, bufs):
    """Output pixels ``task // parts * MP`` on, output channels ``task % parts * KS`` on, of
    an NCHW batch, on the rows kernel.

    As :func:`rows_nhwc_task` for one group, with each pixel's channels read where
    they lie, ``H*W`` apart (``zeros`` holds ``(KC-1)*H*W + 1`` zeros, the padding
    read at the same stride).  The tile of C, pixels by channels, builds up in
    ``cbuf`` (``Np`` wide, at least ``MP`` rows) and is transposed into ``out`` once,
    after the last KC block: the kernel's vectors run along the output channels.
    ``bufs`` is the thread's ``(offs, cbuf)``.
    """
    r = plan[0]
    offs, cbuf = bufs
    geom = geom_of(r)
    C, Np, K, KC, NC, MP, m, KS, parts = r.C, r.Np, r.K, r.KC, r.NC, r.MP, r.m, r.KS, r.parts
    H, W, Ho, Wo, kh, kw = r.H, r.W, r.Ho, r.Wo, r.kh, r.kw
    ntaps = kh * kw
    stride = panel_stride(ntaps)
    hw = H * W
    p0 = task // parts * MP
    k0 = task % parts * KS
    k1 = imin(k0 + KS, K)
    count = imin(MP, m - p0)
    pixel_offsets(geom, (C * hw, W, UNIT), p0, count, m, FALSE, offs)
    panels = (count + MR - 1) // MR
    for pc in range(0, C, KC):
        kc = imin(KC, C - pc)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        e = epi if pc + KC >= C else 0
        b_pc = pc * ntaps * Np
        for jc in range(k0, k1, NC):
            j_end = imin(jc + NC, k1)
            for q in range(panels):
                # Rows past the last pixel read zeros (offset -1) into rows never copied out.
                c_at = q * MR * Np
                for jr in range(jc, j_end, NR):
                    cols = imin(NR, K - jr)
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



@inner_jit
def pixels_to_planes(cbuf, ldc, p0, count, k0, k1, K, plane, out):
    """``out[n, k, q] = cbuf[(p - p0)*ldc + k]`` for batch pixels ``p = n*plane + q`` in
    ``p0 .. p0 + count`` and ``k0 <= k < k1`` (of ``K``): rows of pixels into NCHW
    channel planes."""
    p = p0
    while p < p0 + count:
        n = p // plane
        q = p - n * plane
        run = imin(p0 + count - p, plane - q)         # pixels in image n
        transpose_copy(cbuf, (p - p0) * ldc + k0, ldc, run, k1 - k0, out,
                       (n * K + k0) * plane + q, plane)
        p += run


@jit
def rows_nchw_tasks(counter, plan, x, bpack, bias, epi, out, zeros, bufs):
    """Tasks of :func:`rows_nchw_task` taken from ``counter`` until the plan's ``ntasks``
    are out."""
    ntasks = plan[0].ntasks
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        rows_nchw_task(task, plan, x, bpack, bias, epi, out, zeros, bufs)
