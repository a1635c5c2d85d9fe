"""Template for the implicit im2col drivers (B packed from patches) and the 1x1 NCHW
driver (the image read in place as B), bound to one micro-kernel.

Written once per GEMM kernel (MR, NR, ISA) by
:func:`tilegemm.conv.engine.family_module`, which states what every template shares
(the configuration block, task loops over a shared counter).  Importable as is
(float32 6x64).
"""
import numba
import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import JIT, imin, jit
from tilegemm.kernels.registry import get_kernel
from tilegemm.kernels.sync import next_task
from tilegemm.packing.im2col import pack_b_im2col, row_segments

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

_KERNEL = get_kernel(DTYPE, MR, NR, ISA)
macro_kernel = _KERNEL.module.macro_kernel
gemm_small = _KERNEL.module.gemm_small
pack_b = _KERNEL.module.pack_b
LANES = _KERNEL.lanes
_SHARED = engine.template_module("shared", DTYPE, isa=ISA)
masked_copy = _SHARED.masked_copy
copy_run = _SHARED.copy_run
geom_of = _SHARED.geom_of
strides_of = _SHARED.strides_of
ZERO = _SHARED.ZERO


# --- implicit im2col, NCHW: out[n][K, Ho*Wo] = W[K, C*kh*kw] @ col(x[n]) ---------------

@numba.njit(inline='always', **JIT)
def pack_b_im2col_rows(x, x_off, xs, geom, p0, kc, j0, nc, buf, general):
    """:func:`pack_b_im2col` for NR-wide panels, with vector copies when stride and image rows allow.

    With a horizontal stride of 1 or 2 and contiguous image rows, each panel row is a
    few runs of one image row (one per output row the panel's columns cross), copied
    LANES at a time by :func:`masked_copy` (every other pixel: :func:`masked_copy2`)
    with the padding read as zero.  Other geometries go to the scalar packer.  Same
    layout and assumptions.  ``general`` None says the layer is 1x1, stride 1,
    unpadded, over contiguous planes: Numba then prunes the other packers and does
    not compile them.
    """
    H, W, Ho, Wo, kh, kw, sy, sx, py, px, dy, dx = geom
    sc, s_row = xs[1], xs[2]
    if general is None:
        pack_b(x, x_off + p0 * sc + j0, sc, 1, kc, nc, buf)
        return
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
        cols = imin(NR, nc - jr)
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
                             imin(LANES, seg - t), sx)
                out += seg
            if cols < NR:
                masked_copy(x, 0, 0, 0, buf, dst + cols, NR - cols)
                for t in range(cols + LANES, NR, LANES):
                    masked_copy(x, 0, 0, 0, buf, dst + t, imin(LANES, NR - t))
            dst += NR
            j += 1
            if j == kw:
                j = 0
                i += 1
                if i == kh:
                    i = 0
                    c += 1


@jit
def im2col_nchw_tasks(counter, plan, g, x, apack, bias, epi, out, bufs, general):
    """Tasks taken from ``counter`` (:func:`next_task`) until the plan's ``ntasks`` are
    out; a task = (image n, NC block of output pixels, slice of output channels) of
    group ``g``.  The loop holds the task's body: an inlined body would cost the
    compile a copy of its IR, a called one a compile of its own.

    ``plan`` is :func:`tilegemm.conv.im2col.packed_plan`'s record (its names below).
    ``apack`` holds the group's weights as packed A for every KC block (block ``pc``
    at ``pc*Mp``, ``Mp`` = M rounded up to MR, zero rows).  B panels are packed from
    the image by :func:`pack_b_im2col_rows` into the thread's ``bufs[0]``; bias (per
    row, ``Mp`` values) and activation ride on the last KC block.  When M is not a
    multiple of MR the last row panel runs as a full tile into ``bufs[1]`` (MR x NC
    rounded up to NR), copied out at the end, rather than through the scalar
    edge-tile path.  ``general``: None for a 1x1 stride-1 unpadded layer (see
    :func:`pack_b_im2col_rows`), else True.
    """
    r = plan[0]
    bpack, edge = bufs
    geom = geom_of(r)
    xs, os = strides_of(r)
    ckk, KC, MC, NC, Mp, M = r.ckk, r.KC, r.MC, r.NC, r.Mp, r.M
    n_jc, msplit, mstep = r.n_jc, r.msplit, r.mstep
    ld_edge = (NC + NR - 1) // NR * NR
    ldc = os[1]
    while True:
        task = next_task(counter)
        if task >= r.ntasks:
            break
        n = task // (n_jc * msplit)
        jb = (task // msplit) % n_jc
        m0 = (task % msplit) * mstep
        m1 = imin(M, m0 + mstep)
        m_full = m0 + (m1 - m0) // MR * MR
        pixels = r.Ho * r.Wo
        jc = jb * NC
        nc = imin(NC, pixels - jc)
        xo = g * r.Cg * xs[1] + n * xs[0]
        co = g * M * os[1] + n * os[0]
        for pc in range(0, ckk, KC):
            kc = imin(KC, ckk - pc)
            pack_b_im2col_rows(x, xo, xs, geom, pc, kc, jc, nc, bpack, general)
            beta = DTYPE(0) if pc == 0 else DTYPE(1)
            epi_pc = epi if pc + KC >= ckk else 0
            # Row blocks of MC, then the partial row panel as a full tile into edge: one
            # call site, as the inlined macro-kernel compiles once per site.
            ic = m0
            while ic < m1:
                if ic < m_full:
                    mc, c, c_off, ld = imin(MC, m_full - ic), out, co + ic * ldc + jc, ldc
                else:
                    mc, c, c_off, ld = MR, edge, 0, ld_edge
                macro_kernel((mc, nc, kc), apack, pc * Mp + ic * kc, bpack, ZERO, c, c_off, ld,
                             (DTYPE(1), beta), (bias, epi_pc), (ic, jc))
                ic += mc
        for i in range(m1 - m_full):
            dst = co + (m_full + i) * ldc + jc
            for j in range(nc):
                out[dst + j] = edge[i * ld_edge + j]


# --- 1x1 NCHW with the image read in place: out[n][K, H*W] = W[K, C] @ x[n][C, H*W] ------

@jit
def im2col_pointwise_tasks(counter, plan, g, x, w, bias, epi, out, packs):
    """Tasks taken from ``counter`` until the plan's ``ntasks`` are out; a task = (image
    n, block of NC output pixels) of group ``g``, one unpacked GEMM (the GEMM module's
    ``gemm_small``): the weights ``w`` (K x Cg, C-contiguous) are A, the image's
    channel planes B read in place, KC rows at a time, the tiles' next B lines
    prefetched.  ``packs`` are the thread's edge panels (MR*KC and NR*KC).  Bias per
    row and activation ride on the last k block.
    """
    r = plan[0]
    xs, os = strides_of(r)
    M, Cg, KC, NC, n_jc = r.M, r.Cg, r.KC, r.NC, r.n_jc
    pixels = r.Ho * r.Wo
    while True:
        task = next_task(counter)
        if task >= r.ntasks:
            break
        n = task // n_jc
        jc = (task % n_jc) * NC
        nc = imin(NC, pixels - jc)
        x_off = n * xs[0] + g * Cg * xs[1] + jc
        o_off = n * os[0] + g * M * os[1] + jc
        gemm_small((M, nc, Cg), (DTYPE(1), DTYPE(0)), (w, (g * M * Cg, Cg, 1)),
                   (x, (x_off, xs[1], 1)), (out, (o_off, os[1], 1)), (bias, epi), KC, packs)
