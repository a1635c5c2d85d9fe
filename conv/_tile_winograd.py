"""Template for the Winograd F(m x m, 3x3) drivers, bound to one micro-kernel and tile size.

Written once per GEMM kernel (MR, NR, ISA) and output tile size m (``TILE``) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64, F(2x2, 3x3)).  The NHWC task (:func:`winograd_task`) serves
TILE = 2 only.
"""
import numba
import numpy as np

from tilegemm.ground.contracts import EPI_BIAS_ROW, JIT, imin, inner_jit, jit
from tilegemm.kernels.registry import get_kernel
from tilegemm.kernels.sync import next_task
from tilegemm.kernels.winograd import make_winograd_input, make_winograd_output
from tilegemm.packing.winograd import pack_a_winograd, unpack_winograd

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


# --- Winograd F(2x2, 3x3) ------------------------------------------------------------

@numba.njit(inline='always', **JIT)
def winograd_task(task, plan, g, x, upack, epilogue, out, bufs):
    """One task = a block of ``MT`` tiles of group ``g``: input transform, 16 GEMMs,
    output transform.

    ``plan`` is :func:`tilegemm.conv.winograd.plan_record`'s record (its names here),
    ``epilogue`` ``(bias, has_bias, act)`` of the group, ``bufs`` the thread's
    ``(apack, mbuf, v)``.  ``upack`` holds the group's 16 transformed filters as
    packed B: slab ``xi`` at ``xi*C*Kp``, KC block ``pc`` at ``+pc*Kp``.  ``apack``
    (16 slabs of MT x KC, ``a_slab`` apart) and ``mbuf`` (16 slabs of MT x Kp,
    ``m_slab`` apart) belong to the calling thread.
    """
    r = plan[0]
    bias = epilogue[0]
    apack, mbuf, v = bufs
    C, Kp, K, MT, KC, NC, a_slab, m_slab = r.C, r.Kp, r.K, r.MT, r.KC, r.NC, r.a_slab, r.m_slab
    geom = (r.H, r.W, r.Ho, r.Wo, r.py, r.px, r.TH, r.TW)
    xs = (r.xs_n, r.xs_c, r.xs_h, r.xs_w)
    os = (r.os_n, r.os_k, r.os_h, r.os_w)
    x_off, o_off = g * C * r.xs_c, g * K * r.os_k
    t0 = task * MT
    mt = imin(MT, r.tiles_total - t0)
    for pc in range(0, C, KC):
        kc = imin(KC, C - pc)
        pack_a_winograd(x, x_off, xs, geom, t0, mt, pc, kc, MR, apack, a_slab, v)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        for xi in range(16):
            for jc in range(0, K, NC):
                nc = imin(NC, K - jc)
                macro_kernel((mt, nc, kc), apack, xi * a_slab, upack,
                             xi * C * Kp + pc * Kp + jc * kc, mbuf, xi * m_slab + jc, Kp,
                             (DTYPE(1), beta), (bias, ZERO), (ZERO, ZERO))
    unpack_winograd(mbuf, (m_slab, Kp), (t0, mt), K, out, o_off, os, geom, epilogue)


@jit
def winograd_tasks(counter, plan, g, x, upack, epilogue, out, bufs):
    """Tasks of :func:`winograd_task` taken from ``counter`` (:func:`next_task`) until
    the plan's ``ntasks`` are out."""
    ntasks = plan[0].ntasks
    while True:
        task = next_task(counter)
        if task >= ntasks:
            break
        winograd_task(task, plan, g, x, upack, epilogue, out, bufs)



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
        ncols = (nt + NR - 1) // NR * NR
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
                macro_kernel((r1 - r0, ncols, kc), upack, u_off + (xi * C + pc) * Kp + r0 * kc,
                             bpack, xi * b_slab, mbuf, xi * m_slab, NB, (DTYPE(1), beta),
                             (bias, ZERO), (ZERO, ZERO))
        winograd_output_block(mbuf, (m_slab, NB), runs, nruns, (r0, imin(r1, K)), out,
                              (o_off, os[1], os[2]), Wo, (bias, b_off, epi))
