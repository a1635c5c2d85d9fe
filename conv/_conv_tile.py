"""Template for the convolution drivers bound to one micro-kernel (implicit im2col and Winograd).

:mod:`tilegemm.conv.engine` writes one module per GEMM kernel from this file, with
the configuration block filled in, exactly as the kernel registry does for
``kernels/_tile.py``: MR and NR become compile-time constants and Numba caches the
machine code per kernel.  The block also records a hash of the sources this code
inlines (the kernel module and the packers), so that a change in any of them
rewrites the module and invalidates Numba's on-disk cache.  Importable as is
(float32 6x64).

Each driver is a *task* function over disjoint pieces of the output; ``*_tasks``
runs tasks ``first, first+step, ...``, so thread ``t`` of ``T`` Python threads
takes ``first=t, step=T`` with its own pack buffers (the code releases the GIL).  The packed weights are
prepared once by the caller and shared read-only.
"""
import numba
import numpy as np

from tilegemm.config import JIT
from tilegemm.kernels.registry import get_kernel
from tilegemm.packing.im2col import pack_a_im2col, pack_b_im2col
from tilegemm.packing.winograd import pack_a_winograd, unpack_winograd

# --- configuration ---
DTYPE = np.float32
MR = 6
NR = 64
ISA = "avx512"
SOURCE_HASH = ""
# --- end configuration ---

macro_kernel = get_kernel(DTYPE, MR, NR, ISA).module.macro_kernel


# --- implicit im2col, NCHW: out[n][K, Ho*Wo] = W[K, C*kh*kw] @ col(x[n]) ---------------

@numba.njit(**JIT)
def im2col_nchw_task(task, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep, n_jc,
                     out, o_off, os, bias, epi, KC, MC, NC, bpack, tile):
    """One task = (image n, NC block of output pixels, slice of output channels).

    ``apack`` holds the weights as packed A for every KC block (block ``pc`` at
    ``pc*Mp``, ``Mp`` = M rounded up to MR).  B panels are packed from the image by
    :func:`pack_b_im2col`; bias (per row) and activation ride on the last KC block.
    """
    n = task // (n_jc * msplit)
    jb = (task // msplit) % n_jc
    m0 = (task % msplit) * mstep
    m1 = min(M, m0 + mstep)
    pixels = geom[2] * geom[3]
    jc = jb * NC
    nc = min(NC, pixels - jc)
    xo = x_off + n * xs[0]
    co = o_off + n * os[0]
    ldc = os[1]
    for pc in range(0, ckk, KC):
        kc = min(KC, ckk - pc)
        pack_b_im2col(x, xo, xs, geom, pc, kc, jc, nc, NR, bpack)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        epi_pc = epi if pc + KC >= ckk else 0
        for ic in range(m0, m1, MC):
            mc = min(MC, m1 - ic)
            macro_kernel(mc, nc, kc, apack[pc * Mp + ic * kc:], bpack, 0, out, co + ic * ldc + jc,
                         ldc, DTYPE(1), beta, bias, ic, jc, epi_pc, tile)


@numba.njit(**JIT)
def im2col_nchw_tasks(first, step, ntasks, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep, n_jc,
                       out, o_off, os, bias, epi, KC, MC, NC, bpack, tile):
    """Tasks ``first, first+step, ...`` of :func:`im2col_nchw_task` on the calling thread."""
    for task in range(first, ntasks, step):
        im2col_nchw_task(task, x, x_off, xs, geom, ckk, apack, Mp, M, msplit, mstep, n_jc,
                         out, o_off, os, bias, epi, KC, MC, NC, bpack, tile)



# --- implicit im2col, NHWC: out[N*Ho*Wo, K] = col^T @ W^T ------------------------------

@numba.njit(**JIT)
def im2col_nhwc_task(task, x, x_off, xs, geom, channels, ckk, bpack, Np, K, out, o_off, ldc,
                     bias, epi, KC, MC, NC, m, apack, tile):
    """One task = one MC block of output pixels (rows) times every output channel.

    ``bpack`` holds the weights as packed B for every KC block (block ``pc`` at
    ``pc*Np``); A panels are packed from the image by :func:`pack_a_im2col`; the bias
    is per column.
    """
    ic = task * MC
    mc = min(MC, m - ic)
    for pc in range(0, ckk, KC):
        kc = min(KC, ckk - pc)
        pack_a_im2col(x, x_off, xs, geom, channels, ic, mc, pc, kc, MR, apack)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        epi_pc = epi if pc + KC >= ckk else 0
        for jc in range(0, K, NC):
            nc = min(NC, K - jc)
            macro_kernel(mc, nc, kc, apack, bpack, pc * Np + jc * kc, out, o_off + ic * ldc + jc,
                         ldc, DTYPE(1), beta, bias, ic, jc, epi_pc, tile)


@numba.njit(**JIT)
def im2col_nhwc_tasks(first, step, ntasks, x, x_off, xs, geom, channels, ckk, bpack, Np, K, out, o_off, ldc,
                       bias, epi, KC, MC, NC, m, apack, tile):
    """Tasks ``first, first+step, ...`` of :func:`im2col_nhwc_task` on the calling thread."""
    for task in range(first, ntasks, step):
        im2col_nhwc_task(task, x, x_off, xs, geom, channels, ckk, bpack, Np, K, out, o_off, ldc,
                         bias, epi, KC, MC, NC, m, apack, tile)



# --- Winograd F(2x2, 3x3) ------------------------------------------------------------

@numba.njit(**JIT)
def winograd_task(task, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off, os,
                  bias, has_bias, act, KC, NC, apack, mbuf, tile, v):
    """One task = a block of ``MT`` tiles: input transform, 16 GEMMs, output transform.

    ``upack`` holds the 16 transformed filters as packed B: slab ``xi`` at
    ``xi*C*Kp``, KC block ``pc`` at ``+pc*Kp``.  ``apack`` (16 slabs of MT x KC) and
    ``mbuf`` (16 slabs of MT x Kp) belong to the calling thread and stay in L2.
    """
    t0 = task * MT
    mt = min(MT, tiles_total - t0)
    a_slab = MT * KC
    m_slab = MT * Kp
    for pc in range(0, C, KC):
        kc = min(KC, C - pc)
        pack_a_winograd(x, x_off, xs, geom, t0, mt, pc, kc, MR, apack, a_slab, v)
        beta = DTYPE(0) if pc == 0 else DTYPE(1)
        for xi in range(16):
            for jc in range(0, K, NC):
                nc = min(NC, K - jc)
                macro_kernel(mt, nc, kc, apack[xi * a_slab:], upack, xi * C * Kp + pc * Kp + jc * kc,
                             mbuf, xi * m_slab + jc, Kp, DTYPE(1), beta, bias, 0, 0, 0, tile)
    unpack_winograd(mbuf, m_slab, Kp, t0, mt, K, out, o_off, os, geom, bias, has_bias, act)


@numba.njit(**JIT)
def winograd_tasks(first, step, ntasks, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off,
                    os, bias, has_bias, act, KC, NC, apack, mbuf, tile, v):
    """Tasks ``first, first+step, ...`` of :func:`winograd_task` on the calling thread."""
    for task in range(first, ntasks, step):
        winograd_task(task, x, x_off, xs, geom, C, upack, Kp, K, MT, tiles_total, out, o_off, os,
                      bias, has_bias, act, KC, NC, apack, mbuf, tile, v)
