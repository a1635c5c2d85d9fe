"""The packed path (B panels packed from patches) and 1x1 pointwise convolutions.

NCHW, per image and group: ``out[K, Ho*Wo] = W[K, C*kh*kw] @ col`` -- the weights
are packed A (once, cached), the patch matrix is packed B straight from the image
(:func:`tilegemm.packing.im2col.pack_b_im2col`), the bias is per row.  It serves
every NCHW layer; the planner takes it where neither the rows nor the taps path
applies.  Cost: the GEMM plus packing ``C*kh*kw`` rows of patches per pixel
block.  The drivers are ``conv/_tile_im2col.py``.

A 1x1 stride-1 unpadded convolution needs no patches at all (:func:`pointwise`):
the image itself, viewed as (C, H*W) in NCHW or (N*H*W, C) in NHWC, is the GEMM
operand, read in place.  In NCHW that suits layers of few output channels, whose
products stream the image once (:func:`reads_in_place`); the others pack it as B
(:func:`run`, the packed path with the GEMM's own B packer).
"""
import collections
import functools

import numpy as np

from tilegemm.conv import engine
from tilegemm.kernels.driver import STREAM_ROWS, gemm_into, unpacked_kc
from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW, cdiv, round_up

#: Pixels per block of the packed path, at least, where blocks are cut finer for the
#: threads (see ``engine.TASKS_PER_THREAD``): its tasks also pack B.
IM2COL_PART_COLUMNS = 256

#: Pixels per task of the 1x1 NCHW path reading the image in place, at least, where
#: blocks are cut finer for the threads: each task reads all of the weights.
POINTWISE_PART_COLUMNS = 256

#: 1x1 NCHW layers with output planes of at most this many pixels read the image in
#: place whatever their output channels (see reads_in_place).
IN_PLACE_PIXELS = 256


def _pack_weights_a(w2, KC, MR):
    """Pack ``w2`` (M x ckk) as A for every KC block: block ``pc`` at ``pc*Mp``.

    The layout of :func:`tilegemm.packing.pack_a` (a block's MR-row panels one after
    another, each column by column, zero rows past M), in numpy: called once per
    weight array, a jitted packer would only add its compile time on a cold cache.
    """
    M, ckk = w2.shape
    Mp = round_up(M, MR)
    buf = np.zeros(Mp * ckk + 1, w2.dtype)
    rows = np.zeros((Mp, ckk), w2.dtype)
    rows[:M] = w2
    for pc in range(0, ckk, KC):
        kc = min(KC, ckk - pc)
        panels = rows[:, pc:pc + kc].reshape(Mp // MR, MR, kc).transpose(0, 2, 1)
        buf[pc * Mp:pc * Mp + Mp * kc] = panels.reshape(-1)
    return buf, Mp


def _bias_slices(bias, p, dtype, length=None):
    """Per-group contiguous bias (or a one-element dummy) and whether it is used.

    ``length`` pads each slice with zeros (for kernels that read a whole row panel).
    """
    if bias is None:
        dummy = np.zeros(1, dtype)
        return [dummy] * p.groups, False
    out = []
    for g in range(p.groups):
        b = np.zeros(max(length or p.Kg, p.Kg), dtype)
        b[:p.Kg] = bias[g * p.Kg:(g + 1) * p.Kg]
        out.append(b)
    return out, True


def reads_in_place(p):
    """Whether the 1x1 NCHW layer ``p`` runs on :func:`pointwise` (the image read in
    place) rather than :func:`run` (the image packed as B).

    Up to the GEMM's ``STREAM_ROWS`` output channels per group the product streams
    the image once whatever the path, so packing it only costs a pass (ResNet-50's
    256->64 at 56x56, MobileNet's 32->16 at 112x112: docs/conv-paths.md); with more,
    each packed panel serves enough tiles to pay for itself -- but on small planes
    (``IN_PLACE_PIXELS``: ResNet-50's 14x14 and 7x7 stages) the in-place path still
    ran 8-37% faster.
    """
    return (p.layout == "NCHW" and p.pointwise
            and (p.Kg <= STREAM_ROWS or p.Ho * p.Wo <= IN_PLACE_PIXELS))


def pointwise(x, w, bias, out, p, act, accumulate=False):
    """1x1 stride-1 convolution: the image is the GEMM operand, read in place.

    NCHW: per image and group the weights (Kg x Cg) are A and the image's channel
    planes B, on the GEMM's unpacked kernels (:func:`_pointwise_nchw`); NHWC is one
    GEMM per group over the whole batch, which with ``accumulate`` (NHWC only) adds
    to ``out``'s values (beta = 1, a residual summed in the epilogue).
    """
    if p.layout == "NCHW":
        return _pointwise_nchw(x, w, bias, out, p, act)
    biases, has_bias = _bias_slices(bias, p, out.dtype)
    epi = act | (EPI_BIAS_COL if has_bias else 0)

    def build(w):
        # Each group's W^T (Cg x Kg) contiguous: with B's rows contiguous the GEMM reads
        # the image in place (its unpacked path) rather than packing it every call
        # (ResNet-50's 1x1 256->64 at 56x56: 111 -> 155 GFLOPS, 1 thread, AVX-512).
        return [np.ascontiguousarray(w[g * p.Kg:(g + 1) * p.Kg, :, 0, 0].T)
                for g in range(p.groups)]

    weights = engine.prepared("pointwise_nhwc", w, (p.groups,), build)
    for g in range(p.groups):
        c = slice(g * p.Cg, (g + 1) * p.Cg)
        k = slice(g * p.Kg, (g + 1) * p.Kg)
        gemm_into(x.reshape(-1, p.C)[:, c], weights[g], out.reshape(-1, p.K)[:, k],
                  beta=1.0 if accumulate else 0.0, bias=biases[g], epi=epi)
    return out



def _pointwise_nchw(x, w, bias, out, p, act):
    """1x1 NCHW: tasks of (image, pixel block) on the GEMM's unpacked path, the weights
    as A in place, the image's planes as B in place."""
    kernel, _ = engine.gemm_kernel(out.dtype)
    mod = engine.family_module("im2col", out.dtype)
    threads = engine.threads_for(p.flops // p.groups, 1 << 30)
    plan = pointwise_plan(p, kernel, threads, engine.TASKS_PER_THREAD, POINTWISE_PART_COLUMNS)
    biases, has_bias = _bias_slices(bias, p, out.dtype)
    epi = act | (EPI_BIAS_ROW if has_bias else 0)
    xf, wf, of = x.reshape(-1), w.reshape(-1), out.reshape(-1)
    apacks, bpacks = engine.thread_buffers(("pointwise_nchw", kernel.name), plan.threads,
                                           plan.sizes, out.dtype)
    for g in range(p.groups):
        engine.launch_tasks(mod.im2col_pointwise_tasks, lambda t: (
            plan.numbers, g, xf, wf, biases[g], epi, of, (apacks[t], bpacks[t])), plan.threads)
    return out


PointwisePlan = collections.namedtuple("PointwisePlan", "threads sizes numbers")


@functools.lru_cache(maxsize=256)
def pointwise_plan(p, kernel, threads, tasks_per_thread, part_columns):
    """Tasks and k blocks of :func:`_pointwise_nchw`, once per layer shape and kernel.

    KC is the unpacked GEMM's for the whole image (:func:`unpacked_kc`), balanced;
    one task per image on one thread, finer pixel blocks (whole NR panels, none
    under ``part_columns``) for several.
    """
    pixels = p.Ho * p.Wo
    KC = engine.balanced_kc(p.Cg, unpacked_kc(kernel, p.Kg, pixels, p.Cg))
    n_jc = 1
    if threads > 1:
        n_jc = max(1, min(cdiv(tasks_per_thread * threads, p.N), pixels // part_columns))
    NC = round_up(cdiv(pixels, n_jc), kernel.nr)
    n_jc = cdiv(pixels, NC)
    ntasks = p.N * n_jc
    numbers = engine.record(ntasks=ntasks, KC=KC, NC=NC, n_jc=n_jc, M=p.Kg, Cg=p.Cg, p=p)
    return PointwisePlan(max(1, min(threads, ntasks)), (kernel.mr * KC, kernel.nr * KC), numbers)


def run(x, w, bias, out, p, act):
    """Convolution of ``p`` (NCHW) into ``out`` on B panels packed from the image."""
    kernel, blk = engine.gemm_kernel(out.dtype)
    mod = engine.family_module("im2col", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    plan = packed_plan(p, out.dtype.str, engine.threads_for(p.flops // p.groups, 1 << 30), MR, NR,
                      blk.kc, blk.mc, blk.nc, engine.TASKS_PER_THREAD, IM2COL_PART_COLUMNS)
    ckk, KC = plan.ckk, plan.KC

    def build(w):
        return [_pack_weights_a(w[g * p.Kg:(g + 1) * p.Kg].reshape(p.Kg, ckk), KC, MR)
                for g in range(p.groups)]

    packed = engine.prepared("im2col_nchw", w, (p.groups, KC, MR), build)
    biases, has_bias = _bias_slices(bias, p, out.dtype, plan.Mp)
    epi = act | (EPI_BIAS_ROW if has_bias else 0)
    xf, of = x.reshape(-1), out.reshape(-1)
    # None: the image is the patch matrix, only the GEMM's B packer is compiled in.
    general = None if p.pointwise else True
    bpacks, tiles, edges = engine.thread_buffers(("im2col_nchw", kernel.name), plan.threads,
                                                 plan.sizes, out.dtype)
    for g in range(p.groups):
        apack, bias_g = packed[g][0], biases[g]
        engine.launch_tasks(mod.im2col_nchw_tasks, lambda t: (
            plan.numbers, g, xf, apack, bias_g, epi, of, (bpacks[t], edges[t]), general),
            plan.threads)
    return out


PackedPlan = collections.namedtuple("PackedPlan", "ckk KC Mp NC n_jc msplit mstep ntasks threads "
                                                "sizes numbers")


@functools.lru_cache(maxsize=256)
def packed_plan(p, dtype, threads, MR, NR, kc, mc, nc, tasks_per_thread, part_columns):
    """What :func:`run` derives from the geometry alone, once per layer shape.

    ``threads`` is the most the call may use (one launch per group), ``kc``, ``mc``
    and ``nc`` the GEMM blocking; the tuning constants are arguments so that
    changing them takes effect.
    """
    ckk = p.Cg * p.kh * p.kw
    pixels = p.Ho * p.Wo
    KC = engine.balanced_kc(ckk, kc)
    Mp = round_up(p.Kg, MR)
    # Balance the pixel blocks: NC no larger than the blocking's, as equal as possible.
    n_jc = cdiv(pixels, nc)
    if threads > 1:
        # Finer pixel blocks for enough tasks to balance the threads (see
        # engine.TASKS_PER_THREAD), none under IM2COL_PART_COLUMNS: each task streams all of A.
        n_jc = max(n_jc, min(cdiv(tasks_per_thread * threads, p.N), pixels // part_columns))
    NC = round_up(cdiv(pixels, n_jc), NR)
    n_jc = cdiv(pixels, NC)
    # With few (image, pixel block) pairs, split the output channels too so every thread works.
    msplit = 1
    if p.N * n_jc < threads:
        msplit = min(cdiv(threads, p.N * n_jc), cdiv(p.Kg, MR))
    mstep = round_up(cdiv(p.Kg, msplit), MR)
    msplit = cdiv(p.Kg, mstep)
    ntasks = p.N * n_jc * msplit
    sizes = (KC * round_up(NC, NR), MR * NR, MR * round_up(NC, NR))
    numbers = engine.record(ntasks=ntasks, ckk=ckk, KC=KC, MC=mc, NC=NC, Mp=Mp, M=p.Kg, Cg=p.Cg,
                            n_jc=n_jc, msplit=msplit, mstep=mstep, p=p)
    return PackedPlan(ckk, KC, Mp, NC, n_jc, msplit, mstep, ntasks,
                      max(1, min(threads, ntasks)), sizes, numbers)
