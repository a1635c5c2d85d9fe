"""Winograd F(m x m, 3x3) convolution (m = 2, 4, 6) on the engine's micro-kernels.

This module prepares the weights (``U = G g G^T``, packed once per weight array and
tile size, cached) and runs the compiled drivers, which work on blocks of tiles small
enough for the transformed input and the (m+2)^2 GEMM results to stay in L2 (NHWC:
larger where the transformed weights outgrow L2, see :func:`tile_block`): transform
a block, run the (m+2)^2 GEMMs, transform back with the bias and activation fused.
The transforms are vector code generated from the matrices
(:mod:`tilegemm.kernels.winograd`).

* NCHW (:func:`_run_nchw`): tiles are the GEMM's columns, ``M^T = U^T V``; the
  transforms run along the contiguous image width, a vector of adjacent tiles at a
  time (stride-m lane picks).
* NHWC (:func:`_run_nhwc`): tiles are the GEMM's rows, ``M = V U``; the transforms
  run over a vector of a tile's channels (no shuffles), the strided micro-kernel
  reads V's rows in place.
"""
import functools

import numpy as np

from tilegemm.conv import engine
from tilegemm.ground.contracts import EPI_BIAS_ROW, cdiv, round_up
from tilegemm.kernels.driver import gemm_into
from tilegemm.packing.winograd import pack_filter_transforms


#: NHWC: blocks of tiles per thread, at least (uneven blocks balance out).
NHWC_BLOCKS_PER_THREAD = 4
#: NHWC: tiles per block, at least, when the transformed weights outgrow L2.  Every
#: block streams all of them from L3 (or memory), so a block of a few tiles is bound
#: by that stream; the slabs of a larger block sit in L3 at less cost
#: (docs/conv-paths.md).
NHWC_STREAM_TILES = 96


def tile_block(C, Kp, KC, MR, l2_bytes, itemsize, positions=16):
    """Tiles per block: the ``positions`` slabs of packed input and of results fill about
    half of L2 -- or, where the transformed filters (``C x Kp`` each) outgrow L2, at
    least ``NHWC_STREAM_TILES`` (the slabs then in L3)."""
    per_tile = positions * (min(KC, C) + Kp) * itemsize
    return max(MR, (l2_bytes // 2 // per_tile) // MR * MR,
               stream_floor(C, Kp, MR, itemsize, l2_bytes, positions))


def nhwc_tiles(C, Kp, KC, MR, tiles_total, threads, itemsize, l2_bytes, positions=16):
    """NHWC: tiles per block of a layer of ``tiles_total`` tiles on ``threads`` threads.

    :func:`tile_block`'s size, cut so that every thread gets at least
    ``NHWC_BLOCKS_PER_THREAD`` blocks (uneven blocks balance out), but never below
    :func:`stream_floor` (a streamed weight transform) unless that would leave a
    thread without a block.  Sizes in elements, caches in bytes; ``Kp`` is K rounded
    up to MR; ``positions`` (m+2)^2 for F(m x m, 3x3).
    """
    floor = min(stream_floor(C, Kp, MR, itemsize, l2_bytes, positions),
                round_up(cdiv(tiles_total, threads), MR))
    balanced = round_up(cdiv(tiles_total, NHWC_BLOCKS_PER_THREAD * threads), MR)
    return min(tile_block(C, Kp, KC, MR, l2_bytes, itemsize, positions), max(balanced, floor))


def stream_floor(C, Kp, MR, itemsize, l2_bytes, positions=16):
    """Fewest tiles per block that :func:`tile_block` allows: ``NHWC_STREAM_TILES`` if
    the transformed filters outgrow ``l2_bytes``, else one row panel."""
    if positions * C * Kp * itemsize > l2_bytes:
        return round_up(NHWC_STREAM_TILES, MR)
    return MR


def _packed_groups(name, w, p, KC, R, tile):
    """``(buffer, Kp, u_group)``: every group's (tile+2)^2 transformed filters of
    F(tile x tile, 3x3), packed R wide by :func:`pack_filter_transforms`, in one buffer
    ``u_group`` elements apart (one launch for all groups), cached on ``w`` under
    ``name`` and the packing's numbers.

    Packed R wide along K, the U[xi] (C x K) are NHWC's B (R = NR) and their transposes
    NCHW's A (R = MR: U^T[xi][k, c] = U[xi][c, k]).  Block (xi, pc) of a group starts
    at ``(xi*C + pc)*Kp`` with ``Kp`` = K rounded up to R; the padding is zero, so the
    drivers can run every panel as a full tile.
    """
    Kg = p.Kg

    def build(w):
        packs = [pack_filter_transforms(w[g * Kg:(g + 1) * Kg], KC, R, tile, _product)
                 for g in range(p.groups)]
        buf = packs[0][0] if p.groups == 1 else np.concatenate([buf for buf, _ in packs])
        return buf, packs[0][1], packs[0][0].size

    return engine.prepared(name, w, (p.groups, KC, R, tile), build)


def _product(a, b):
    """``a @ b`` on tilegemm's GEMM (its threads, not numpy's BLAS's)."""
    return gemm_into(a, b, np.empty((a.shape[0], b.shape[1]), np.result_type(a, b)))


def nchw_block(C, KC, Kp, NR, l2_bytes, itemsize, positions=16):
    """Tiles per block: a multiple of NR with the ``positions`` B slabs and result slabs
    (16 for F(2x2, 3x3)) in ~60% of L2."""
    per_tile = positions * (min(KC, C) + Kp) * itemsize
    return max(NR, int(0.6 * l2_bytes) // per_tile // NR * NR)


#: NCHW: a block's input transform costs about as much as this many rows of its 16 GEMMs
#: (docs/conv-paths.md).
NCHW_INPUT_ROWS = 14


#: NCHW: with at least this many blocks per thread, whole blocks balance well enough.
NCHW_SPLIT_BLOCKS_PER_THREAD = 8


@functools.lru_cache(maxsize=256)
def nchw_parts(tiles_total, NB, panels, MR, NR, threads, min_parts=1, max_parts=8):
    """``(whole, parts)``: the first ``whole`` blocks of ``NB`` tiles are a task each; every
    later block is ``parts`` tasks, each with a share of the ``panels`` row panels.

    Parts let the threads share blocks that are too few to balance (ResNet-18 conv4_x at
    batch 8: 392 tiles, 7 blocks of 64 on 2 threads), at the price of one more input
    transform per part, so only the last blocks are split.  Tasks go to whichever
    thread is free (``next_task``); the choice is the plan with the earliest finish
    when each task in turn goes to the least loaded thread, a task costing its
    columns times its rows plus ``NCHW_INPUT_ROWS``.  With ``min_parts`` > 1 every
    block is split at least that far.
    """
    cols = [round_up(min(NB, tiles_total - t0), NR) for t0 in range(0, tiles_total, NB)]
    blocks = len(cols)
    if threads <= 1 or (min_parts <= 1 and blocks >= NCHW_SPLIT_BLOCKS_PER_THREAD * threads):
        return blocks, 1
    best, best_span = (blocks, 1), None
    for parts in range(max(1, min(min_parts, panels)), min(max_parts, panels) + 1):
        # How many of the last blocks are split: all of them when min_parts asks for it.
        tails = ([0] if parts == 1 else [blocks] if min_parts > 1
                 else range(1, min(blocks, 2 * threads) + 1))
        for tail in tails:
            load = [0] * threads
            for b, c in enumerate(cols):
                split = parts if b >= blocks - tail else 1
                for part in range(split):
                    share = (part + 1) * panels // split - part * panels // split
                    t = load.index(min(load))
                    load[t] += c * (share * MR + NCHW_INPUT_ROWS)
            # A plan must save more than noise to pay for its extra transforms.
            if best_span is None or max(load) < 0.98 * best_span:
                best, best_span = (blocks - tail, parts), max(load)
    return best


def nchw_blocking(tiles_total, C, KC, Kp, tile, threads, itemsize, l2_bytes, positions=16):
    """NCHW: ``(NB, whole, parts)``, the tiles per block and :func:`nchw_parts`' split.

    Parameters
    ----------
    tiles_total : int
        Output tiles of one group (all images).
    C, KC, Kp : int
        Input channels of a group, their k block, output channels rounded up to MR.
    tile : (int, int)
        The GEMM kernel's MR, NR.
    threads : (int, int)
        Threads of the launch, and those one group's tasks must keep busy.
    itemsize, l2_bytes : int
    positions : int
        Transformed positions per Winograd tile, (m+2)^2 for F(m x m, 3x3).

    Returns
    -------
    (int, int, int)
    """
    MR, NR = tile
    threads, group_threads = threads
    NB = nchw_block(C, KC, Kp, NR, l2_bytes, itemsize, positions)
    # Enough blocks for every thread, but no block smaller than one NR panel.
    NB = max(NR, min(NB, round_up(cdiv(tiles_total, group_threads), NR)))
    # Threads that each spill a block's 16 result slabs well past L2 compete for L3:
    # then at most half the rows a task (docs/conv-paths.md).
    spill = threads > 1 and positions * Kp * NB * itemsize > 1.5 * l2_bytes
    return (NB,) + nchw_parts(tiles_total, NB, Kp // MR, MR, NR, group_threads,
                              2 if spill else 1)


def _slab(size, itemsize):
    """Distance between two of the 16 slabs: ``size`` plus one cache line, rounded to lines.

    The transforms touch all 16 slabs at one offset; a power-of-two distance would put
    those 16 lines in one L1 set (4 KiB aliasing), the extra line spreads them out.
    """
    line = 64 // itemsize
    return round_up(size, line) + line


def run(x, w, bias, out, p, act, blocking=None, tile=2):
    """Winograd F(tile x tile, 3x3) convolution into ``out`` (C-contiguous in
    ``p.layout``); 3x3, stride 1, dilation 1.

    ``tile`` is one of :data:`TILES`.  ``blocking`` is the planned
    one by default (NCHW :func:`nchw_blocking`, NHWC :func:`nhwc_tiles`); given, it
    is run instead: any blocking gives the same result.
    """
    if p.layout == "NCHW":
        return _run_nchw(x, w, bias, out, p, act, blocking, tile)
    return _run_nhwc(x, w, bias, out, p, act, blocking, tile)


#: Output tile sizes m of the drivers, F(m x m, 3x3).
TILES = (2, 4, 6)


def _run_nchw(x, w, bias, out, p, act, blocking, tile):
    from tilegemm.tuning.machine import detect

    # Fewer tiles than the widest kernel's NR columns: a narrower kernel's tile.
    tiles_total = p.N * cdiv(p.Ho, tile) * cdiv(p.Wo, tile)
    kernel, blk = engine.gemm_kernel(out.dtype, tiles_total)
    mod = engine.family_module("winograd", out.dtype, tile, tiles_total)
    mod.request_transforms("NCHW")
    positions = (tile + 2) ** 2
    MR, NR = kernel.mr, kernel.nr
    KC = engine.balanced_kc(p.Cg, blk.kc)
    Kg = p.Kg
    upack, Kp, u_group = _packed_groups("winograd_nchw", w, p, KC, MR, tile)
    TH, TW = cdiv(p.Ho, tile), cdiv(p.Wo, tile)
    threads = engine.threads_for(p.flops, 1 << 30)
    # Threads a group's tasks must keep busy on their own (groups also share out).
    group_threads = cdiv(threads, p.groups)
    if blocking is None:
        blocking = nchw_blocking(tiles_total, p.Cg, KC, Kp, (MR, NR), (threads, group_threads),
                                 out.itemsize, detect().l2_bytes, positions)
    NB, whole, parts = blocking
    blocks = cdiv(tiles_total, NB)
    panels = Kp // MR
    ntasks = (whole + (blocks - whole) * parts) * p.groups
    threads = min(threads, ntasks)
    b_slab = _slab(KC * NB, out.itemsize)
    m_slab = _slab((Kp if whole else cdiv(panels, parts) * MR) * NB, out.itemsize)
    bpacks, mbufs = engine.thread_buffers(("winograd_nchw", kernel.name), max(threads, 1),
                                          (positions * b_slab, positions * m_slab), out.dtype)
    runs = [np.empty((NB, 9), np.int64) for _ in range(max(threads, 1))]
    epi = act | (EPI_BIAS_ROW if bias is not None else 0)
    xf, of = x.reshape(-1), out.reshape(-1)
    b = np.ascontiguousarray(bias) if bias is not None else np.zeros(1, out.dtype)
    plan = plan_record(p=p, ntasks=ntasks, groups=p.groups, C=p.Cg, u_group=u_group, Kp=Kp,
                       K=Kg, NB=NB, whole=whole, parts=parts, tiles_total=tiles_total, KC=KC,
                       b_slab=b_slab, m_slab=m_slab, TH=TH, TW=TW)
    engine.launch_tasks(mod.winograd_nchw_tasks, lambda t: (
        plan, xf, upack, b, epi, of, (bpacks[t], mbufs[t], runs[t])), threads)
    return out


#: The record (:func:`tilegemm.conv.engine.record`) a Winograd task loop reads, built
#: once per set of numbers.  Keyed by the numbers, not derived from ``p`` alone: the
#: blocking (:func:`nchw_blocking`, :func:`nhwc_tiles`) is chosen on every call.
plan_record = functools.lru_cache(maxsize=256)(engine.record)


def _run_nhwc(x, w, bias, out, p, act, blocking, tile):
    """NHWC F(tile x tile, 3x3): blocks of ``MT`` tiles (:func:`nhwc_tiles`; ``blocking``
    overrides it), all groups in one task loop."""
    from tilegemm.tuning.machine import detect

    # Fewer output channels than the widest kernel's NR: a narrower kernel's tile.
    kernel, blk = engine.gemm_kernel(out.dtype, p.Kg)
    mod = engine.family_module("winograd", out.dtype, tile, p.Kg)
    mod.request_transforms("NHWC")
    MR, NR = kernel.mr, kernel.nr
    positions = (tile + 2) ** 2
    KC = engine.balanced_kc(p.Cg, blk.kc)
    Kg = p.Kg
    upack, Kp, u_group = _packed_groups("winograd_nhwc", w, p, KC, NR, tile)
    TH, TW = cdiv(p.Ho, tile), cdiv(p.Wo, tile)
    tiles_total = p.N * TH * TW
    threads = engine.threads_for(p.flops, 1 << 30)
    MT = blocking
    if MT is None:
        machine = detect()
        MT = nhwc_tiles(p.Cg, Kp, KC, MR, tiles_total, cdiv(threads, p.groups), out.itemsize,
                        machine.l2_bytes, positions)
    ntasks = cdiv(tiles_total, MT) * p.groups
    threads = min(threads, ntasks)
    ldv = round_up(KC, kernel.lanes)
    v_slab = _slab(round_up(MT, MR) * ldv, out.itemsize)
    m_slab = _slab(MT * Kp, out.itemsize)
    vbufs, mbufs = engine.thread_buffers(("winograd_nhwc", kernel.name), max(threads, 1),
                                         (positions * v_slab, positions * m_slab), out.dtype)
    epi = act | (EPI_BIAS_ROW if bias is not None else 0)
    xf, of = x.reshape(-1), out.reshape(-1)
    b = np.ascontiguousarray(bias) if bias is not None else np.zeros(1, out.dtype)
    plan = plan_record(p=p, ntasks=ntasks, groups=p.groups, C=p.Cg, K=Kg, Kp=Kp, KC=KC, MT=MT,
                       ldv=ldv, v_slab=v_slab, m_slab=m_slab, u_group=u_group,
                       tiles_total=tiles_total, TH=TH, TW=TW)
    engine.launch_tasks(mod.winograd_nhwc_tasks, lambda t: (
        plan, xf, upack, b, epi, of, (vbufs[t], mbufs[t])), threads)
    return out
