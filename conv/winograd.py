"""Winograd F(2x2, 3x3) convolution on the engine's micro-kernels.

The transforms are in :mod:`tilegemm.packing.winograd`; this module prepares the
weights (``U = G g G^T`` packed as B, once per weight array, cached) and runs the
compiled driver, which works on blocks of tiles small enough for the transformed
input and the 16 GEMM results to stay in L2: transform a block into packed A,
run the 16 GEMMs, transform back with the bias and activation fused.
"""
import numpy as np

from tilegemm.conv import engine
from tilegemm.packing import pack_b
from tilegemm.packing.winograd import weight_transform


def _pack_transformed(w, KC, NR):
    """Transform one group's filters and pack each of the 16 (C x K) matrices as B."""
    u = weight_transform(w)                      # (16, C, K)
    C, K = u.shape[1:]
    Kp = engine.round_up(K, NR)
    buf = np.zeros(16 * C * Kp + 1, w.dtype)
    for xi in range(16):
        flat = u[xi].reshape(-1)
        for pc in range(0, C, KC):
            kc = min(KC, C - pc)
            pack_b(flat, pc * K, K, 1, kc, K, NR, buf[xi * C * Kp + pc * Kp:])
    return buf, Kp


def prepare(w, groups, dtype):
    """The packed transformed weights of every group (cached on the weight array)."""
    kernel, blk = engine.plan(dtype)
    Cg = w.shape[1]
    KC = min(blk.kc, Cg)
    Kg = w.shape[0] // groups

    def build():
        return [_pack_transformed(w[g * Kg:(g + 1) * Kg], KC, kernel.nr) for g in range(groups)]

    return engine.prepared("winograd", w, (groups, KC, kernel.nr), build), KC


def tile_block(C, Kp, KC, MR, l2_bytes, itemsize):
    """Tiles per block: the 16 slabs of packed input and of results fill about half of L2."""
    per_tile = 16 * (min(KC, C) + Kp) * itemsize
    return max(MR, (l2_bytes // 2 // per_tile) // MR * MR)


def run(x, w, bias, out, p, act):
    """Winograd convolution into ``out`` (C-contiguous in ``p.layout``); 3x3, stride 1, dilation 1."""
    from tilegemm.tuning.machine import detect

    kernel, blk = engine.plan(out.dtype)
    mod = engine.conv_module(out.dtype)
    MR, NR = kernel.mr, kernel.nr
    packed, KC = prepare(w, p.groups, out.dtype)
    Kp = packed[0][1]
    NC = min(blk.nc, Kp)
    TH, TW = -(-p.Ho // 2), -(-p.Wo // 2)
    tiles_total = p.N * TH * TW
    threads = engine.threads_for(p.flops, 1 << 30)
    MT = tile_block(p.Cg, Kp, KC, MR, detect().l2_bytes, out.itemsize)
    # At least a few blocks per thread so that uneven blocks balance out.
    MT = max(MR, min(MT, engine.round_up(-(-tiles_total // (4 * threads)), MR)))
    ntasks = -(-tiles_total // MT)
    threads = min(threads, ntasks)
    apacks, mbufs, tiles, vs = engine.thread_buffers(
        ("winograd", kernel.name), max(threads, 1), (16 * MT * KC, 16 * MT * Kp, MR * NR, 16 + 4 * (2 * MR + 2)),
        out.dtype)
    has_bias = bias is not None
    xf, of = x.reshape(-1), out.reshape(-1)
    xs, os_ = p.input_strides(), p.output_strides()
    geom = (p.H, p.W, p.Ho, p.Wo, p.top, p.left, TH, TW)
    for g in range(p.groups):
        upack, _ = packed[g]
        b = (np.ascontiguousarray(bias[g * p.Kg:(g + 1) * p.Kg]) if has_bias
             else np.zeros(1, out.dtype))
        args = (ntasks, xf, g * p.Cg * xs[1], xs, geom, p.Cg, upack, Kp, p.Kg, MT, tiles_total,
                of, g * p.Kg * os_[1], os_, b, has_bias, act, KC, NC)
        engine.launch(lambda t, step: mod.winograd_tasks(t, step, *args, apacks[t], mbufs[t],
                                                         tiles[t], vs[t]),
                      threads)
    return out
