"""Template for the Winograd F(m x m, 3x3) drivers, bound to one micro-kernel and tile size.

Written once per GEMM kernel (MR, NR, ISA) and output tile size m (``TILE``) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64, F(2x2, 3x3)).
"""
import numpy as np

from tilegemm.ground.contracts import EPI_BIAS_ROW, imin, inner_jit, jit
from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.registry import get_kernel, microkernel
from tilegemm.kernels.sync import next_task
from tilegemm.kernels.winograd import (make_winograd_input, make_winograd_input_nhwc,
                                       make_winograd_output, make_winograd_output_nhwc)

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
TILE = 2
SOURCE_HASH = ""
# --- end configuration ---

_KERNEL = get_kernel(DTYPE, MR, NR, ISA)
macro_kernel = _KERNEL.module.macro_kernel
ZERO = _KERNEL.module.ZERO
LANES = _KERNEL.lanes
#: Input tile side and transformed positions per tile.
ALPHA = TILE + 2
POSITIONS = ALPHA * ALPHA
winograd_input = make_winograd_input(DTYPE, LANES, TILE)
winograd_output = make_winograd_output(DTYPE, LANES, TILE)
winograd_input_nhwc = make_winograd_input_nhwc(DTYPE, LANES, TILE)
winograd_output_nhwc = make_winograd_output_nhwc(DTYPE, LANES, TILE)


_requested = set()


def request_transforms(layout):
    """Ask the tile helper for ``layout``'s transforms (those not cached), so that it
    compiles them while the task loop compiles here: the driver's call before its
    loop, which does something only the first time."""
    if layout in _requested:
        return
    _requested.add(layout)
    pair = ((winograd_input, winograd_output) if layout == "NCHW"
            else (winograd_input_nhwc, winograd_output_nhwc))
    for transform in pair:
        transform.request()


ukernel_strided = _KERNEL.module.ukernel_strided
ukernel_strided_edge = _KERNEL.module.ukernel_strided_edge
#: NCHW: the last, partial column panel of a block runs one vector of tiles at a time
#: on this kernel, reading the packed panels in place: the full NR-wide tile spent
#: on a few tiles (4 of ResNet-18 conv2_x's 196 F(4x4) tiles at batch 1) did NR/LANES
#: times the work.
ukernel_vector = microkernel(DTYPE, ISA, MR, LANES, Flavour.STRIDED)


# --- Winograd F(m x m, 3x3), NCHW: tiles as GEMM columns, vectors along the image width ---
#
# For each of the POSITIONS = (m+2)^2 positions xi:  M[xi][K, tiles] = U[xi]^T[K, C] @ V[xi][C, tiles].
# The transformed filters U^T are packed A (prepared once); the input transform writes
# V straight into packed B, LANES adjacent tiles of one tile row per vector, and the
# output transform reads LANES tiles of one output channel per vector.  A block of NB
# tiles (a multiple of NR) numbers tiles across the batch, so LANES consecutive tiles
# may span tile rows or images: each lane group is cut into *runs* of tiles sharing a
# tile row, and the masked transforms handle one run at a time.

@inner_jit
def winograd_runs(T0, nt, geom, xs, os, runs):
    """Describe tiles ``T0:T0+nt`` as runs within lane groups; returns the number of runs.

    ``runs[r] = (group_start, lo, hi, x_src, y0, col0, out_dst, out_rows, out_col0)``:
    lanes ``lo:hi`` of the group at block column ``group_start`` are tiles of one tile
    row, lane ``l`` being the tile whose input window starts at column ``col0 + TILE*l``
    of input row ``y0`` (``x_src`` = offset of that pixel in channel 0) and whose
    output starts at column ``out_col0 + TILE*l``, offset ``out_dst + TILE*l`` of
    channel 0 (``out_rows`` output rows: fewer than TILE at the bottom edge).
    """
    H, W, Ho, Wo, py, px, TH, TW = geom
    tiles = TH * TW
    count = 0
    for g in range(0, nt, LANES):
        end = imin(LANES, nt - g)
        l = 0
        while l < end:
            t = T0 + g + l
            n = t // tiles
            ty = (t % tiles) // TW
            tx = t % TW
            run = imin(end - l, TW - tx)
            y0 = TILE * ty - py
            col0 = TILE * (tx - l) - px
            runs[count, 0] = g
            runs[count, 1] = l
            runs[count, 2] = l + run
            runs[count, 3] = n * xs[0] + y0 * xs[2] + col0
            runs[count, 4] = y0
            runs[count, 5] = col0
            runs[count, 6] = n * os[0] + TILE * ty * os[2] + TILE * (tx - l)
            runs[count, 7] = imin(TILE, Ho - TILE * ty)
            runs[count, 8] = TILE * (tx - l)
            count += 1
            l += run
    return count


@inner_jit
def winograd_input_block(x, x_off, sc, s_row, H, W, runs, nruns, p0, kc, buf, slab):
    """``V`` of channels ``p0:p0+kc`` for the block's runs, into POSITIONS packed-B slabs of ``slab``."""
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
            winograd_input(x, src + runs[r, 3], (s_row, H, W),
                           (runs[r, 4], runs[r, 5], runs[r, 1], LANES), buf, dst, slab)


@inner_jit
def winograd_output_block(m, layout, runs, nruns, channels, out, o_view, Wo, epilogue):
    """``Y = A^T m A`` + bias + activation for the block's runs, output channels ``k0:k1``
    (``channels``): channel ``k`` in row ``k - k0`` of each of the POSITIONS slabs of ``m``
    (``layout`` ``(slab, ldm)``: slabs and rows that far apart), its bias at
    ``bias[b_off + k]`` (``epilogue`` ``(bias, b_off, epi)``), its output plane at
    ``out[o_off + k*sk]`` with rows ``s_row`` apart (``o_view`` ``(o_off, sk, s_row)``)."""
    slab, ldm = layout
    k0, k1 = channels
    o_off, sk, s_row = o_view
    bias, b_off, epi = epilogue
    for k in range(k0, k1):
        b = bias[b_off + k] if epi & EPI_BIAS_ROW else DTYPE(0)
        dst = o_off + k * sk
        for r in range(nruns):
            winograd_output(m, (k - k0) * ldm + runs[r, 0], slab, out, dst + runs[r, 6],
                            (s_row, Wo), (runs[r, 8], runs[r, 7], runs[r, 1], runs[r, 2]), b, epi)


@inner_jit
def tail_panel(shape, a, a_off, b, b_off, c, c_layout, beta):
    """``C[:, j0:j1] (= or +=) A B[:, j0:j1]`` one vector of columns at a time
    (:data:`ukernel_vector`): ``shape`` ``(rows, (j0, j1), kc)``, A packed MR-row panels
    at ``a_off``, B packed NR-wide panels at ``b_off`` (``j0`` a multiple of NR, ``j1``
    of LANES), C rows ``ldc`` apart at ``c_off`` (``c_layout``)."""
    rows, (j0, j1), kc = shape
    c_off, ldc = c_layout
    for ir in range(0, rows, MR):
        for jc in range(j0, j1, LANES):
            ukernel_vector(kc, a, a_off + ir * kc, 1, MR, b, b_off + (jc // NR) * NR * kc + jc % NR,
                           NR, c, c_off + ir * ldc + jc, ldc, DTYPE(1), beta, c, 0, 0, 0)


@jit
def winograd_nchw_tasks(counter, plan, x, upack, bias, epi, out, bufs):
    """Tasks taken from ``counter`` (:func:`next_task`) until the plan's ``ntasks`` are
    out, ``ntasks // groups`` per group; the loop holds the task's body (see
    ``im2col_nchw_tasks``).  A task of group ``g`` is a block of ``NB`` tiles (the
    first ``whole`` tasks) or one of the ``parts`` parts of the output channels of a
    later block: input transform, POSITIONS GEMMs, output transform.

    ``plan`` is :func:`tilegemm.conv.winograd.plan_record`'s record (its names here);
    the group reads input channels ``g*C:``, writes output channels ``g*K:`` (their
    bias too) and takes its transformed filters from ``upack[g*u_group:]``: the POSITIONS
    matrices U^T (K x C) as packed A, every row panel full (``Kp`` = K rounded up to
    MR, zero rows), block (xi, pc) at ``(xi*C + pc)*Kp``.  The ``parts`` parts of a
    block share out its row panels; each transforms the block's whole input (where
    blocks alone are too few to keep every thread busy, that repeat costs less than
    an idle thread).  ``bufs`` is the thread's ``(bpack, mbuf, runs)``: ``bpack`` (POSITIONS
    slabs of KC x NB, ``b_slab`` apart) and ``mbuf`` (POSITIONS slabs of Kp x NB, ``m_slab``
    apart) stay in L2, ``runs`` holds NB rows of 9.  ``epi``: EPI_BIAS_ROW (bias per
    output channel) and the activation flags.
    """
    r = plan[0]
    bpack, mbuf, runs = bufs
    C, Kp, K, NB, whole, parts = r.C, r.Kp, r.K, r.NB, r.whole, r.parts
    KC, b_slab, m_slab, tiles_total = r.KC, r.b_slab, r.m_slab, r.tiles_total
    geom = (r.H, r.W, r.Ho, r.Wo, r.py, r.px, r.TH, r.TW)
    xs = (r.xs_n, r.xs_c, r.xs_h, r.xs_w)
    os = (r.os_n, r.os_k, r.os_h, r.os_w)
    H, W, Ho, Wo, py, px, TH, TW = geom
    panels = Kp // MR
    per_group = r.ntasks // r.groups
    while True:
        task = next_task(counter)
        if task >= r.ntasks:
            break
        g = task // per_group
        task -= g * per_group
        x_off, u_off, o_off = g * C * r.xs_c, g * r.u_group, g * K * r.os_k
        b_off = g * K if epi & EPI_BIAS_ROW else 0
        block, part, split = task, 0, 1
        if task >= whole:
            block, part, split = whole + (task - whole) // parts, (task - whole) % parts, parts
        r0 = part * panels // split * MR
        r1 = (part + 1) * panels // split * MR
        T0 = block * NB
        nt = imin(NB, tiles_total - T0)
        full = nt // NR * NR                               # columns of whole NR panels
        ncols = full + (nt - full + LANES - 1) // LANES * LANES
        nruns = winograd_runs(T0, nt, geom, xs, os, runs)
        for pc in range(0, C, KC):
            kc = imin(KC, C - pc)
            winograd_input_block(x, x_off, xs[1], xs[2], H, W, runs, nruns, pc, kc, bpack, b_slab)
            if ncols > nt:
                # Columns past the last tile: zeros, so the GEMM never meets stale bits.
                for xi in range(POSITIONS):
                    for q in range(nt, ncols):
                        base = xi * b_slab + (q // NR) * NR * kc + q % NR
                        for p in range(kc):
                            bpack[base + p * NR] = 0
            beta = DTYPE(0) if pc == 0 else DTYPE(1)
            for xi in range(POSITIONS):
                a_off = u_off + (xi * C + pc) * Kp + r0 * kc
                if full > 0:
                    macro_kernel((r1 - r0, full, kc), upack, a_off, bpack, xi * b_slab, mbuf,
                                 xi * m_slab, NB, (DTYPE(1), beta), (bias, ZERO), (ZERO, ZERO))
                tail_panel((r1 - r0, (full, ncols), kc), upack, a_off, bpack, xi * b_slab,
                           mbuf, (xi * m_slab, NB), beta)
        winograd_output_block(mbuf, (m_slab, NB), runs, nruns, (r0, imin(r1, K)), out,
                              (o_off, os[1], os[2]), Wo, (bias, b_off, epi))



# --- Winograd F(m x m, 3x3), NHWC: tiles as GEMM rows, vectors over the channels -----------
#
# For each position xi:  M[xi][tiles, K] = V[xi][tiles, C] @ U[xi][C, K].  The input
# transform writes each tile's V[xi] as a row of channels (LANES at a time, no
# shuffles: a pixel's channels are contiguous), the strided micro-kernel reads those
# rows in place as A against U packed NR wide as B, and the output transform reads a
# row of output channels per position and writes the tile's pixels, bias and
# activation fused.

@inner_jit
def nhwc_input_block(x, x_src, geom, xs, tiles, channels, vbuf, layout):
    """``V`` of channels ``p0:p0+kc`` (``channels``) of tiles ``T0:T0+mt`` (``tiles``):
    tile ``T0+i``'s row of slab ``xi`` at ``vbuf[xi*v_slab + i*ldv]`` (``layout``).

    ``x_src`` is the offset of the group's channel 0, ``xs`` ``(sn, s_row, s_col)``."""
    H, W, Ho, Wo, py, px, TH, TW = geom
    sn, s_row, s_col = xs
    T0, mt = tiles
    p0, kc = channels
    v_slab, ldv = layout
    per_image = TH * TW
    for i in range(mt):
        t = T0 + i
        n = t // per_image
        y0 = TILE * ((t % per_image) // TW) - py
        x0 = TILE * (t % TW) - px
        src = x_src + n * sn + y0 * s_row + x0 * s_col + p0
        for c in range(0, kc, LANES):
            winograd_input_nhwc(x, src + c, (s_row, s_col, H, W), (y0, x0, imin(LANES, kc - c)),
                                vbuf, i * ldv + c, v_slab)


@inner_jit
def nhwc_products(shape, vbuf, layout, upack, u_off, mbuf, m_layout, beta):
    """``M[xi] = V[xi] U[xi] (+ M[xi] when beta is 1)`` for every position ``xi``.

    ``shape`` is ``(mt, Kp, kc)``; ``U[xi]``'s k block is packed B at ``upack[u_off +
    xi*u_step]`` (``u_off`` ``(offset, u_step)``), NR-wide panels ``NR*kc`` apart;
    ``m_layout`` ``(m_slab, ldm)``.  The last row panel runs the edge kernel (it reads
    whole panels of A: ``vbuf`` holds rows up to a multiple of MR)."""
    mt, Kp, kc = shape
    v_slab, ldv = layout
    u_base, u_step = u_off
    m_slab, ldm = m_layout
    for xi in range(POSITIONS):
        for jr in range(0, Kp, NR):
            b_off = u_base + xi * u_step + jr * kc
            for ir in range(0, mt, MR):
                a_off = xi * v_slab + ir * ldv
                c_off = xi * m_slab + ir * ldm + jr
                if ir + MR <= mt:
                    ukernel_strided(kc, vbuf, a_off, ldv, 1, upack, b_off, NR, mbuf, c_off, ldm,
                                    DTYPE(1), beta, mbuf, 0, 0, 0)
                else:
                    ukernel_strided_edge(kc, vbuf, a_off, ldv, 1, upack, b_off, NR, mbuf, c_off,
                                         ldm, DTYPE(1), beta, mbuf, 0, 0, mt - ir, NR)


@inner_jit
def nhwc_output_block(mbuf, m_layout, tiles, K, out, o_src, geom, os, epilogue):
    """``Y = A^T m A`` + bias + activation of tiles ``T0:T0+mt`` into the NHWC output:
    ``os`` ``(sn, s_row, s_col)``, ``o_src`` the offset of the group's channel 0,
    ``epilogue`` ``(bias, b_off, epi)``.  Pixels past the image are not written."""
    m_slab, ldm = m_layout
    T0, mt = tiles
    H, W, Ho, Wo, py, px, TH, TW = geom
    sn, s_row, s_col = os
    bias, b_off, epi = epilogue
    per_image = TH * TW
    for i in range(mt):
        t = T0 + i
        n = t // per_image
        oy = TILE * ((t % per_image) // TW)
        ox = TILE * (t % TW)
        dst = o_src + n * sn + oy * s_row + ox * s_col
        window = (imin(TILE, Ho - oy), imin(TILE, Wo - ox))
        for k in range(0, K, LANES):
            winograd_output_nhwc(mbuf, i * ldm + k, m_slab, out, dst + k, (s_row, s_col),
                                 (window[0], window[1], imin(LANES, K - k)), bias, b_off + k, epi)


@jit
def winograd_nhwc_tasks(counter, plan, x, upack, bias, epi, out, bufs):
    """Tasks taken from ``counter`` (:func:`next_task`) until the plan's ``ntasks`` are
    out, ``ntasks // groups`` per group: a task is a block of ``MT`` tiles of group
    ``g``, transformed, multiplied per position and transformed back.

    ``plan`` is :func:`tilegemm.conv.winograd.plan_record`'s record (its names here).
    Group ``g`` reads input channels ``g*C:``, writes output channels ``g*K:`` (their
    bias too, ``epi`` holding EPI_BIAS_ROW) and takes its transformed filters from
    ``upack[g*u_group:]``: the POSITIONS matrices U (C x K) packed as B, NR wide,
    block (xi, pc) at ``(xi*C + pc)*Kp``.  ``bufs`` is the thread's ``(vbuf, mbuf)``:
    POSITIONS slabs of V rows (``v_slab`` apart, rows ``ldv``) and of M rows
    (``m_slab`` apart, rows ``Kp``).
    """
    r = plan[0]
    vbuf, mbuf = bufs
    C, K, Kp, KC, MT = r.C, r.K, r.Kp, r.KC, r.MT
    geom = (r.H, r.W, r.Ho, r.Wo, r.py, r.px, r.TH, r.TW)
    per_group = r.ntasks // r.groups
    while True:
        task = next_task(counter)
        if task >= r.ntasks:
            break
        g = task // per_group
        T0 = (task - g * per_group) * MT
        mt = imin(MT, r.tiles_total - T0)
        for pc in range(0, C, KC):
            kc = imin(KC, C - pc)
            nhwc_input_block(x, g * C * r.xs_c, geom, (r.xs_n, r.xs_h, r.xs_w), (T0, mt),
                             (pc, kc), vbuf, (r.v_slab, r.ldv))
            nhwc_products((mt, Kp, kc), vbuf, (r.v_slab, r.ldv), upack,
                          (g * r.u_group + pc * Kp, C * Kp), mbuf, (r.m_slab, Kp),
                          DTYPE(0) if pc == 0 else DTYPE(1))
        nhwc_output_block(mbuf, (r.m_slab, Kp), (T0, mt), K, out, g * K * r.os_k, geom,
                          (r.os_n, r.os_h, r.os_w), (bias, g * K if epi & EPI_BIAS_ROW else 0, epi))
