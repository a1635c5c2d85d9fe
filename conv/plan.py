"""algorithm="auto": a cost model over the three algorithms, and the plan it produces.

Each algorithm's time is estimated from the shape as

    GEMM flops / (efficiency x peak)  +  elements moved by packing or transforms / rate

where the GEMM efficiency falls with the fraction of each register tile the shape
leaves empty (few output channels, few pixels) and with a short reduction (the
micro-kernel's fixed cost of loading and storing its tile is amortised over the
k loop).  The constants below were fitted with ``tilegemm bench --op conv`` on the
development machine (AVX-512, fp32); only their ratios matter, since the choice
compares estimates with each other.  ``TILEGEMM_CONV_ALGORITHM`` forces a choice.
"""
import os
from dataclasses import dataclass, field

import numpy as np

from tilegemm.conv import taps
from tilegemm.conv.direct import flat_applies, nhwc_vector_applies
from tilegemm.conv.params import conv_params
from tilegemm.conv.paths import PLANES, ROWS, TAPS, im2col_route, path_of
from tilegemm.conv.rows import rows_kc, rows_merged
from tilegemm.ground.contracts import round_up
from tilegemm.ground.threads import get_num_threads
from tilegemm.ground.validate import check_threads

#: Fraction of peak the GEMM micro-kernel sustains on full tiles with a long k loop.
GEMM_EFFICIENCY = 0.80
#: Reduction length at which the micro-kernel's tile load/store costs as much as its k loop.
K_HALF = 24
#: Fraction of peak of the scalar direct loops (NHWC, or a horizontal stride > 1): ~1-1.5%.
DIRECT_EFFICIENCY = 0.015
#: ... and of the vector direct loop (NCHW, horizontal stride 1): ~3.5% on MobileNet depthwise.
DIRECT_VECTOR_EFFICIENCY = 0.035
#: ... and of depthwise rows run end to end (``tilegemm.conv.direct.flat_applies``);
#: with stride 2 each channel is split by stride phase first.
DIRECT_FLAT_EFFICIENCY = 0.06
DIRECT_FLAT_COPY_EFFICIENCY = 0.035
#: ... and of depthwise NHWC layers on vectors of channels.
DIRECT_NHWC_VECTOR_EFFICIENCY = 0.15
#: Seconds of Python-side set-up per group (Winograd, and im2col's packing path, launch
#: their task loops once per group).
GROUP_OVERHEAD = 20e-6
#: Elements per nanosecond per thread written by the im2col packers (scalar / vector rows).
PACK_RATE = 2.0
PACK_RATE_VECTOR = 3.0
#: Elements per nanosecond per thread of the taps path's stride-split image copy.
COPY_RATE = 2.0
#: ... and of the NHWC grouped path's copies into planes and back (transposed blocks).
PLANES_COPY_RATE = 1.5
#: How much faster than ``_gemm_seconds`` says the taps kernel runs (its short row
#: panels write only their rows; every tap of a channel block per C update).  Applied
#: where the estimate competes with NHWC Winograd, whose model matches it: NHWC
#: grouped layers.  On NCHW layers the estimate already ranks the algorithms as
#: measured.
TAPS_SPEEDUP = 1.4
#: The same for the NHWC rows kernel (``tilegemm.conv.rows.run``), against NHWC
#: Winograd.
ROWS_SPEEDUP = 1.55
#: Winograd F(m x m, 3x3): nanoseconds per vector transform, input and output, by m.
#: NCHW: one channel of a run of up to `lanes` adjacent tiles of one tile row; NHWC:
#: `lanes` channels of one tile.  Measured on the development machine (AVX-512, fp32)
#: with blocks in L2, but F(6x6): NHWC fitted to whole layers (timed alone, 290 and 230
#: ns, it ranked above F(4x4) on layers where it ran 0.88x its speed), NCHW input
#: raised from 360 ns (VGG-16 conv1_2 ranked it first at 0.85x F(4x4)'s speed).
WINOGRAD_VECTOR_IN_NS = {"NCHW": {2: 35, 4: 120, 6: 420}, "NHWC": {2: 85, 4: 180, 6: 450}}
WINOGRAD_VECTOR_OUT_NS = {"NCHW": {2: 18, 4: 60, 6: 220}, "NHWC": {2: 18, 4: 80, 6: 350}}
#: Bytes per second one thread streams the transformed weights at, once per block of
#: tiles, from L3 (they outgrow L2) and from memory (over half of L3).
WINOGRAD_WEIGHT_L3_RATE = 12e9
WINOGRAD_WEIGHT_MEMORY_RATE = 8e9


@dataclass(frozen=True)
class ConvPlan:
    """What ``conv2d(..., algorithm="auto")`` would do for a shape, and why.

    Attributes
    ----------
    algorithm : str
        The choice: ``"im2col"``, ``"winograd"`` or ``"direct"``.
    path : str
        What runs, in words (e.g. ``"im2col (1x1 stride 1: plain GEMM on the image)"``).
    route : str
        The name of the loop nest that runs, one of :data:`tilegemm.conv.paths.PATHS`
        (e.g. ``"im2col.rows"``): the name tests force through ``conv2d``'s ``_path``.
    estimates : dict
        Estimated seconds of every applicable algorithm.
    params : ConvParams
        The validated geometry.
    threads : int
    reason : str
    winograd_tile : int
        The output tile size m of F(m x m, 3x3) that Winograd runs with (or would,
        when another algorithm is chosen); 0 where Winograd does not apply.
    winograd_estimates : dict
        Estimated seconds of Winograd per tile size m (2, 4 and 6).
    """

    algorithm: str
    path: str
    estimates: dict = field(compare=False)
    params: object = field(compare=False)
    threads: int = 1
    reason: str = ""
    route: str = ""
    winograd_tile: int = 0
    winograd_estimates: dict = field(default_factory=dict, compare=False)


def _tile_fill(rows, cols, mr, nr):
    """Fraction of the MR x NR register tiles the GEMM's rows x cols fill."""
    return (rows / round_up(rows, mr)) * (cols / round_up(cols, nr))


def _gemm_seconds(flops, rows, cols, depth, mr, nr, peak):
    eff = GEMM_EFFICIENCY * _tile_fill(rows, cols, mr, nr) * depth / (depth + K_HALF)
    return flops / (eff * peak)


def estimates(p, dtype=np.float32, threads=1, target=None):
    """Estimated seconds per algorithm for :class:`ConvParams` ``p`` (applicable ones only)
    on ``target`` (:data:`tilegemm.conv.engine.Target`, the host's by default)."""
    from tilegemm.conv.engine import host_target
    from tilegemm.tuning.peak import nominal_peak_gflops

    target = host_target(dtype) if target is None else target
    mr, nr = target.mr, target.nr
    peak = nominal_peak_gflops(dtype, threads) * 1e9
    ns = 1e-9 / threads
    ckk = p.Cg * p.kh * p.kw
    pixels = p.Ho * p.Wo
    out = {}
    im2col_path = im2col_route(p, dtype, target)
    if p.layout == "NCHW" or im2col_path == PLANES:
        gemm = _gemm_seconds(p.flops, p.Kg, pixels, ckk, mr, nr, peak)
    else:
        gemm = _gemm_seconds(p.flops, p.N * pixels, p.Kg, ckk, mr, nr, peak)
    vector_rows = p.layout == "NCHW" and p.sx == 1
    if im2col_path == ROWS:
        # The rows kernel: every tap of a channel block per tile, pixels read in place.
        # Its k loops run KC channels per tap, kw*C where a kernel row is one run.
        # NCHW writes C through a transposing copy.
        KC = rows_kc(p, np.dtype(dtype).itemsize, mr, target.l1d_bytes)
        depth = p.kw * p.Cg if rows_merged(p, KC) else KC
        copy = p.N * p.K * pixels * ns / PLANES_COPY_RATE if p.layout == "NCHW" else 0
        out["im2col"] = (_gemm_seconds(p.flops, p.N * pixels, p.Kg, depth, mr, nr, peak)
                         / ROWS_SPEEDUP + copy)
    elif im2col_path == TAPS:
        # The taps kernel reads B in place (no patches), all groups in one task loop;
        # strides other than 1 read a stride-split copy of each image.
        copy = p.N * p.C * p.H * p.W * ns / COPY_RATE if taps.copies(p) else 0
        out["im2col"] = gemm + copy
    elif im2col_path == PLANES:
        # NHWC grouped: the taps kernel on each group's channels copied as planes, the
        # output copied back interleaved.
        moved = p.N * (p.C * p.H * p.W + p.K * pixels)
        out["im2col"] = gemm / TAPS_SPEEDUP + moved * ns / PLANES_COPY_RATE
    else:
        pack = p.N * p.groups * ckk * pixels * ns / (PACK_RATE_VECTOR if vector_rows
                                                     else PACK_RATE)
        out["im2col"] = gemm + pack + p.groups * GROUP_OVERHEAD
    if p.winograd_ok:
        out["winograd"] = min(winograd_estimates(p, dtype, threads, target).values())
    if flat_applies(p, target.lanes):
        efficiency = DIRECT_FLAT_EFFICIENCY if p.sy == p.sx == 1 else DIRECT_FLAT_COPY_EFFICIENCY
    elif nhwc_vector_applies(p, dtype, target.lanes):
        efficiency = DIRECT_NHWC_VECTOR_EFFICIENCY
    else:
        efficiency = DIRECT_VECTOR_EFFICIENCY if vector_rows else DIRECT_EFFICIENCY
    out["direct"] = p.flops / (efficiency * peak)
    return out


def winograd_estimates(p, dtype=np.float32, threads=1, target=None):
    """Estimated seconds of Winograd on the layer ``p`` per output tile size m.

    For every m of :data:`tilegemm.conv.winograd.TILES`: the (m+2)^2 GEMMs (NCHW: the
    tiles are their columns; NHWC: their rows, the output channels their columns; a
    side narrower than the widest kernel's NR runs on a narrower kernel, whose tile it
    may still leave part empty), the vector transforms (``WINOGRAD_VECTOR_IN_NS`` /
    ``_OUT_NS``: NCHW one per channel and run of adjacent tiles of a tile row, NHWC
    one per tile and vector of channels) and, where the transformed weights outgrow
    L2, the GEMMs at least as long as streaming them once per block of tiles
    (``WINOGRAD_WEIGHT_*_RATE``).
    """
    from tilegemm.conv import winograd
    from tilegemm.conv.engine import host_target
    from tilegemm.tuning.machine import detect
    from tilegemm.tuning.peak import nominal_peak_gflops

    target = host_target(dtype) if target is None else target
    peak = nominal_peak_gflops(dtype, threads) * 1e9
    itemsize = np.dtype(dtype).itemsize
    l3 = detect().l3_bytes or 0
    lanes = target.lanes
    out = {}
    for m in winograd.TILES:
        TH, tiles, positions = -(-p.Ho // m), p.tiles_of(m), (m + 2) ** 2
        if p.layout == "NCHW":
            tile_mr, tile_nr = _narrow_tile(tiles, target)
            # The last, partial panel of tiles runs a vector of columns at a time.
            computed = tiles // tile_nr * tile_nr + round_up(tiles % tile_nr, lanes)
            gemm = (_gemm_seconds(p.winograd_flops_of(m), p.Kg, tile_nr, p.Cg, tile_mr,
                                  tile_nr, peak) * computed / tiles)
            runs = min(tiles, -(-tiles // lanes) + p.N * TH)
            vectors_in, vectors_out = runs * p.C, runs * p.K
        else:
            tile_mr, tile_nr = _narrow_tile(p.Kg, target)
            gemm = _gemm_seconds(p.winograd_flops_of(m), tiles, p.Kg, p.Cg, tile_mr, tile_nr,
                                 peak)
            vectors_in = tiles * -(-p.Cg // lanes) * p.groups
            vectors_out = tiles * -(-p.Kg // lanes) * p.groups
        weights = positions * p.Cg * p.Kg * p.groups * itemsize
        if weights > target.l2_bytes:
            Kp = round_up(p.Kg, tile_mr if p.layout == "NCHW" else tile_nr)
            block = (winograd.nchw_block(p.Cg, p.Cg, Kp, tile_nr, target.l2_bytes, itemsize,
                                         positions) if p.layout == "NCHW" else
                     winograd.tile_block(p.Cg, Kp, p.Cg, tile_mr, target.l2_bytes, itemsize,
                                         positions))
            rate = WINOGRAD_WEIGHT_MEMORY_RATE if weights > l3 // 2 else WINOGRAD_WEIGHT_L3_RATE
            gemm = max(gemm, -(-tiles // block) * weights / (rate * threads))
        transforms = (vectors_in * WINOGRAD_VECTOR_IN_NS[p.layout][m]
                      + vectors_out * WINOGRAD_VECTOR_OUT_NS[p.layout][m]) * 1e-9 / threads
        out[m] = gemm + transforms + p.groups * GROUP_OVERHEAD
    return out


def _narrow_tile(columns, target):
    """(MR, NR) of the kernel a GEMM of ``columns`` columns runs on (as
    :func:`tilegemm.kernels.driver.kernel_for` picks: the narrowest tile covering
    them, the widest for a wide product)."""
    from tilegemm.tuning.blocking import register_tiles
    from tilegemm.tuning.machine import detect
    if columns >= target.nr:
        return target.mr, target.nr
    tiles = [t for t in register_tiles(detect().vector_registers, target.lanes)
             if t[1] >= columns]
    return min(tiles, key=lambda t: t[1]) if tiles else (target.mr, target.nr)


#: What each path does, for :attr:`ConvPlan.path` (pointwise, NCHW rows and the taps
#: path's layouts are described by :func:`_describe`).
DESCRIPTIONS = {
    "im2col.rows": "im2col (all taps per tile, each pixel's channels read in place)",
    "im2col.planes": ("im2col (all taps per tile, each group's channels copied as planes, the "
                      "output written back interleaved)"),
    "im2col.packed": "im2col (implicit: B panels packed from the image)",
}


def _describe(route, p):
    """A one-line description of ``route`` for the layer ``p``."""
    if route == "im2col.pointwise":
        return ("im2col (1x1 stride 1: GEMM reading the image's planes in place as B)"
                if p.layout == "NCHW" else "im2col (1x1 stride 1: plain GEMM on the image)")
    if route == "im2col.packed" and p.pointwise:
        return "im2col (1x1 stride 1: the image rows packed as B, no patches)"
    if route == "im2col.rows" and p.layout == "NCHW":
        return ("im2col (all taps per tile, each pixel's channels read in place, the "
                "tiles of C transposed into the output planes)")
    if route == "im2col.taps":
        return {taps.FLAT: "im2col (all taps per tile, B read in place from the image through "
                      "load masks)",
                taps.PHASED: "im2col (all taps per tile, B read in place from an unpadded "
                        "stride-split image copy through load masks)"}.get(
            taps.layout_of(p), "im2col (all taps per tile, B read in place from a stride-split "
                        "image copy)")
    return DESCRIPTIONS.get(route) or route.partition(".")[0]


def choose(p, dtype=np.float32, threads=None, target=None):
    """The :class:`ConvPlan` for validated parameters ``p`` on ``target`` (the host's
    by default)."""
    threads = get_num_threads() if threads is None else int(threads)
    est = estimates(p, dtype, threads, target)
    forced = os.environ.get("TILEGEMM_CONV_ALGORITHM")
    if forced in est:
        algorithm, reason = forced, "forced by TILEGEMM_CONV_ALGORITHM"
    else:
        algorithm = min(est, key=est.get)
        ranked = sorted(est, key=est.get)
        reason = "lowest estimated time" + (
            f" ({est[ranked[0]] / est[ranked[1]]:.2f}x of {ranked[1]})" if len(ranked) > 1 else "")
    route_name = path_of(p, algorithm, dtype, target)
    wino = winograd_estimates(p, dtype, threads, target) if p.winograd_ok else {}
    tile = min(wino, key=wino.get) if wino else 0
    path = _describe(route_name, p)
    if algorithm == "winograd":
        path += f" F({tile}x{tile}, 3x3)"
    return ConvPlan(algorithm, path, est, p, threads, reason, route_name, tile, wino)


def conv_plan(input_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1, *,
              layout="NCHW", dtype=np.float32, threads=None):
    """The algorithm ``conv2d(..., algorithm="auto")`` picks for these shapes, with its estimates.

    Parameters
    ----------
    input_shape, weight_shape : tuple of int
        As the arrays ``conv2d`` would receive (input in ``layout``).
    stride, padding, dilation, groups, layout
        As for :func:`tilegemm.conv2d`.
    dtype : float32 or float64
    threads : int, optional
        Defaults to :func:`tilegemm.get_num_threads`.

    Returns
    -------
    ConvPlan
        ``.algorithm`` is the choice, ``.estimates`` the estimated seconds of each
        applicable algorithm, ``.reason`` a one-line justification.

    Examples
    --------
    >>> conv_plan((8, 64, 56, 56), (64, 64, 3, 3), padding=1).algorithm  # doctest: +SKIP
    'winograd'
    """
    p = conv_params(input_shape, weight_shape, stride, padding, dilation, groups, layout,
                    func="conv_plan")
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"conv_plan: dtype must be float32 or float64, got {dtype}")
    return choose(p, dtype, check_threads(threads, "conv_plan"))
