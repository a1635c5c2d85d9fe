"""The planes path: NHWC grouped layers, each group's channels copied as planes.

Serves NHWC layers other than 1x1 stride 1, with stride 1 and the output as wide
as the image, whose copied planes fit ``TAPS_MAX_BYTES`` (:func:`serves`); the
planner takes it for groups of fewer output channels than NR (:func:`applies`),
which would leave most of each rows-kernel tile empty.

Cost: the taps kernel's GEMM on each group, plus copying the input into planes
and the output back interleaved (about the input and the output once each).
The drivers are ``conv/_tile_planes.py`` (they call the taps path's).
"""
import collections
import dataclasses
import functools

import numpy as np

from tilegemm.conv import engine, taps
from tilegemm.conv.taps import (column_block, group_bias, panel_masks, phase_geometry,
                                reads_image, taps_kc, weights)
from tilegemm.ground.contracts import cdiv
from tilegemm.tuning.machine import detect


def applies(p, dtype=np.float32, target=None):
    """Whether :func:`run` serves ``p`` (:func:`serves`) and wins: groups
    of fewer output channels than NR.

    The rows kernel's tiles are NR output channels of one group: with fewer, most of
    each tile is empty; from NR on, rows win (docs/conv-paths.md).
    """
    target = engine.host_target(dtype) if target is None else target
    return p.groups > 1 and p.Kg < target.nr and serves(p, dtype)


def serves(p, dtype):
    """Whether :func:`run` computes ``p``: NHWC, not 1x1, stride 1 with
    ``Wo == W``, and a task's planes of at most ``TAPS_MAX_BYTES``."""
    itemsize = np.dtype(dtype).itemsize
    return (p.layout == "NHWC" and not p.pointwise and reads_image(p)
            and groups_per_task(p, itemsize) * p.Cg * p.H * p.W * itemsize <= taps.TAPS_MAX_BYTES)


#: Bytes of input channels a task of the NHWC grouped path copies per pixel, at least:
#: whole cache lines, read once, and runs long enough for the copy to stream
#: (docs/conv-paths.md).
PLANES_RUN_BYTES = 256


def groups_per_task(p, itemsize):
    """Groups per task of :func:`run`: a cache line of each pixel's channels."""
    return max(1, min(p.groups, cdiv(PLANES_RUN_BYTES, p.Cg * itemsize)))


@functools.lru_cache(maxsize=256)
def group_image(p):
    """One group of one image as an NCHW layer: the geometry of the planes copied."""
    return dataclasses.replace(p, N=1, C=p.Cg, K=p.Kg, groups=1, layout="NCHW")


def run(x, w, bias, out, p, act):
    """NHWC grouped convolution: tasks (image, block of groups, see ``PLANES_RUN_BYTES``)
    copy the block's channels as planes (``transpose_copy``), run the taps kernel over
    each group as over an NCHW image read in place (:func:`tilegemm.conv.taps.run`) and write C
    back interleaved (``transpose_copy`` again)."""
    kernel, blk = engine.gemm_kernel(out.dtype)
    mod = engine.family_module("planes", out.dtype)
    MR, NR = kernel.mr, kernel.nr
    q = group_image(p)
    KC = taps_kc(q, MR, NR, out.itemsize, detect().l1d_bytes)
    apack, Mp, finite = weights(w, p.groups, KC, MR)
    plan = planes_plan(p, out.dtype.str, NR, KC, Mp, blk.mc, finite, taps.TAPS_C_BYTES)
    epilogue = group_bias(bias, p, Mp, out.dtype, act)
    threads = min(engine.threads_for(p.flops, 1 << 30), plan.ntasks)
    xqs, cbufs = engine.thread_buffers(("im2col_planes", kernel.name), threads, plan.sizes,
                                       out.dtype)
    grid, x1, out1 = (plan.taps, plan.masks, plan.sched), x.reshape(-1), out.reshape(-1)
    engine.launch_tasks(mod.planes_tasks, lambda t: (plan.numbers, grid, x1, apack, epilogue,
                                                     out1, (xqs[t], cbufs[t])), threads)
    return out


PlanesPlan = collections.namedtuple("PlanesPlan", "ntasks sizes taps masks sched numbers")


@functools.lru_cache(maxsize=256)
def planes_plan(p, dtype, NR, KC, Mp, MC, finite, c_bytes):
    """What :func:`run` derives from the geometry alone, once per layer shape: the
    task split, the buffer sizes, the taps kernel's grid of one group's planes and
    the record the task loop reads (:func:`tilegemm.conv.engine.record`)."""
    itemsize = np.dtype(dtype).itemsize
    q = group_image(p)
    _, _, _, offsets = phase_geometry(q)
    masks, sched = panel_masks(q, NR, dtype, group=finite)
    pixels, out_pixels = p.H * p.W, p.Ho * p.Wo
    NCB = column_block(out_pixels, 1, Mp, itemsize, NR, c_bytes)
    G = groups_per_task(p, itemsize)
    ntasks = p.N * cdiv(p.groups, G)
    numbers = engine.record(ntasks=ntasks, groups=p.groups, G=G,
                            a_group=len(offsets) * p.Cg * Mp + 1, C=p.C, pixels=pixels,
                            out_pixels=out_pixels, Cg=p.Cg, ntaps=len(offsets), Mp=Mp, Kg=p.Kg,
                            K=p.K, KC=KC, MC=MC, NCB=NCB)
    sizes = (G * p.Cg * pixels, ((G - 1) * p.Kg + Mp) * NCB)
    return PlanesPlan(ntasks, sizes, offsets, masks, sched, numbers)
