"""Winograd F(m x m, 3x3): transforms against the explicit matrices, and the blocking
(conv/winograd.py) planned and forced."""
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tilegemm

from conv_cases import RNG, numba_threads, record_arg, run_case
from jitted import trampoline
from reference import reference_conv
from test_winograd_points import ERROR_BOUND
from tilegemm.conv import engine
from tilegemm.conv.params import conv_params
from tilegemm.packing.winograd import AT, BT, G, transform_matrices, weight_transform

#: The output tile sizes of the NCHW drivers.
TILES = (2, 4, 6)


# --- Winograd transforms against the explicit matrices --------------------------------

def test_weight_transform_matches_G():
    w = RNG.standard_normal((3, 2, 3, 3))
    u = weight_transform(w)
    for k in range(3):
        for c in range(2):
            np.testing.assert_allclose(u[:, c, k].reshape(4, 4), G @ w[k, c] @ G.T, atol=1e-12)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C", [3, 16, 37])
def test_nhwc_input_transform_matches_BT(dtype, C, tile):
    """The NHWC input transform (B^T d B, lanes of channels) writes each tile's row of V
    exactly, pixels off the image (padding, the last tiles' overhang) read as zero."""
    H, W, pad = 7, 9, 1
    alpha = tile + 2
    _, _, bt = transform_matrices(tile)
    mod, geom, TH, TW = _vector_transform_case(dtype, H, W, pad, tile)
    N = 2
    x = RNG.standard_normal((N, H, W, C)).astype(dtype)
    tiles = N * TH * TW
    p0, kc = (1, C - 2) if C > 3 else (0, C)
    ldv = kc + 5
    slab = tiles * ldv + 3
    buf = np.full(alpha * alpha * slab, np.nan, dtype)
    trampoline(mod.nhwc_input_block)(x.reshape(-1), 0, geom, (H * W * C, W * C, C), (0, tiles),
                                     (p0, kc), buf, (slab, ldv))
    xp = np.zeros((N, H + 2 * alpha, W + 2 * alpha, C))
    xp[:, pad:pad + H, pad:pad + W] = x
    for t in range(tiles):
        n, r = divmod(t, TH * TW)
        ty, tx = divmod(r, TW)
        d = xp[n, tile * ty:tile * ty + alpha, tile * tx:tile * tx + alpha, p0:p0 + kc]
        want = np.einsum("ia,abc,jb->ijc", bt, d, bt).reshape(alpha * alpha, kc)
        got = buf[(np.arange(alpha * alpha) * slab + t * ldv)[:, None] + np.arange(kc)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"tile {t}")
        # Nothing past the row's kc channels is written.
        assert np.isnan(buf[np.arange(alpha * alpha) * slab + t * ldv + kc]).all()


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("activation", [0, 4, 8])
def test_nhwc_output_transform_matches_AT(dtype, activation, tile):
    """The NHWC output transform (A^T m A + bias + activation, lanes of output channels)
    writes each tile's pixels and channels of the image and nothing else."""
    from tilegemm.ground.contracts import EPI_BIAS_ROW
    Ho, Wo, K = 7, 9, 21
    alpha = tile + 2
    at, _, _ = transform_matrices(tile)
    mod, geom, TH, TW = _vector_transform_case(dtype, Ho + 2, Wo + 2, 0, tile)
    N = 2
    tiles = N * TH * TW
    ldm = K + 3
    m = (RNG.standard_normal((alpha * alpha, tiles, ldm)) * 4).astype(dtype)
    bias = RNG.standard_normal(K + 4).astype(dtype)
    out = np.full((N, Ho, Wo, K + 2), np.nan, dtype)        # 2 channels past K, untouched
    trampoline(mod.nhwc_output_block)(m.reshape(-1), (tiles * ldm, ldm), (0, tiles), K,
                                      out.reshape(-1), 0, geom, (Ho * Wo * (K + 2), Wo * (K + 2), K + 2),
                                      (bias, 4, activation | EPI_BIAS_ROW))
    want = np.zeros((N, TH * tile, TW * tile, K))
    for t in range(tiles):
        n, r = divmod(t, TH * TW)
        ty, tx = divmod(r, TW)
        y = np.einsum("ia,abk,jb->ijk", at, m[:, t, :K].reshape(alpha, alpha, K).astype(np.float64), at)
        want[n, tile * ty:tile * ty + tile, tile * tx:tile * tx + tile] = y + bias[4:4 + K]
    want = want[:, :Ho, :Wo]
    if activation:
        want = np.maximum(want, 0)
    if activation == 8:
        want = np.minimum(want, 6)
    np.testing.assert_allclose(out[..., :K], want, rtol=1e-5, atol=1e-5 * tile ** 3)
    assert np.isnan(out[..., K:]).all()


def _vector_transform_case(dtype, H, W, pad, tile=2):
    """Geometry, strides and the run table of the vector transforms for an NCHW image."""
    from tilegemm.conv import engine
    mod = engine.family_module("winograd", dtype, tile)
    Ho, Wo = H + 2 * pad - 2, W + 2 * pad - 2
    TH, TW = -(-Ho // tile), -(-Wo // tile)
    geom = (H, W, Ho, Wo, pad, pad, TH, TW)
    return mod, geom, TH, TW


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, pad", [(9, 9, 1), (6, 40, 1), (5, 3, 0), (4, 70, 1), (1, 1, 1),
                                       (13, 150, 1)])
def test_vector_input_transform_matches_BT(dtype, H, W, pad, tile):
    """The NCHW input transform (B^T d B, lanes of tiles) writes packed B exactly."""
    from tilegemm.conv import engine
    mod, geom, TH, TW = _vector_transform_case(dtype, H, W, pad, tile)
    _, _, bt = transform_matrices(tile)
    alpha = tile + 2
    NR = engine.gemm_kernel(dtype)[0].nr
    N, C = 2, 3
    x = RNG.standard_normal((N, C, H, W)).astype(dtype)
    xs = (C * H * W, H * W, W, 1)
    tiles = N * TH * TW
    T0 = 1 if tiles > 1 else 0                       # a block not starting at tile 0
    nt = tiles - T0
    NB = -(-nt // NR) * NR
    runs = np.empty((NB, 9), np.int64)
    nruns = trampoline(mod.winograd_runs)(T0, nt, geom, xs, (0, 0, 0, 0), runs)
    p0, kc = 1, 2                                      # channels 1 and 2
    slab = kc * NB
    buf = np.full(alpha * alpha * slab, np.nan, dtype)
    trampoline(mod.winograd_input_block)(x.reshape(-1), 0, xs[1], xs[2], H, W, runs, nruns, p0, kc, buf, slab)
    xp = np.zeros((N, C, H + 2 * alpha + 2 * pad, W + 2 * alpha + 2 * pad))
    xp[:, :, pad:pad + H, pad:pad + W] = x
    for j in range(nt):
        n, r = divmod(T0 + j, TH * TW)
        ty, tx = divmod(r, TW)
        for p in range(kc):
            d = xp[n, p0 + p, tile * ty:tile * ty + alpha, tile * tx:tile * tx + alpha]
            got = buf[np.arange(alpha * alpha) * slab + (j // NR) * NR * kc + p * NR + j % NR]
            want = bt @ d @ bt.T
            np.testing.assert_allclose(got.reshape(alpha, alpha), want, rtol=1e-5,
                                       atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"tile {T0 + j}, channel {p0 + p}")


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Ho, Wo", [(7, 7), (2, 33), (5, 2), (1, 1), (9, 100)])
@pytest.mark.parametrize("activation", [0, 4, 8])
def test_vector_output_transform_matches_AT(dtype, Ho, Wo, activation, tile):
    """The NCHW output transform (A^T m A + bias + activation) writes only the image."""
    from tilegemm.conv import engine
    from tilegemm.ground.contracts import EPI_BIAS_ROW
    mod, _, _, _ = _vector_transform_case(dtype, Ho, Wo, 1, tile)
    at, _, _ = transform_matrices(tile)
    alpha = tile + 2
    TH, TW = -(-Ho // tile), -(-Wo // tile)
    geom = (Ho, Wo, Ho, Wo, 1, 1, TH, TW)
    lanes = engine.gemm_kernel(dtype)[0].lanes
    N, K = 2, 3
    tiles = N * TH * TW
    NB = -(-tiles // lanes) * lanes
    os_ = (K * Ho * Wo, Ho * Wo, Wo, 1)
    runs = np.empty((NB, 9), np.int64)
    nruns = trampoline(mod.winograd_runs)(0, tiles, geom, (0, 0, 0, 0), os_, runs)
    m = RNG.standard_normal((alpha * alpha, K, NB)).astype(dtype) * 4
    bias = RNG.standard_normal(K).astype(dtype)
    out = np.full((N, K, Ho, Wo), np.nan, dtype)
    trampoline(mod.winograd_output_block)(m.reshape(-1), (K * NB, NB), runs, nruns, (0, K), out.reshape(-1),
                              (0, os_[1], os_[2]), Wo, (bias, 0, activation | EPI_BIAS_ROW))
    want = np.zeros((N, K, tile * TH, tile * TW))
    for t in range(tiles):
        n, r = divmod(t, TH * TW)
        ty, tx = divmod(r, TW)
        for k in range(K):
            want[n, k, tile * ty:tile * ty + tile, tile * tx:tile * tx + tile] = \
                at @ m[:, k, t].reshape(alpha, alpha).astype(np.float64) @ at.T + bias[k]
    want = want[:, :, :Ho, :Wo]
    if activation:
        want = np.maximum(want, 0)
    if activation == 8:
        want = np.minimum(want, 6)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * tile ** 3)


def test_winograd_identity():
    """A^T[(G g G^T) * (B^T d B)]A is the 2x2 valid correlation of d with g."""
    d = RNG.standard_normal((4, 4))
    g = RNG.standard_normal((3, 3))
    y = AT @ ((G @ g @ G.T) * (BT @ d @ BT.T)) @ AT.T
    direct = np.array([[np.sum(d[i:i + 3, j:j + 3] * g) for j in range(2)] for i in range(2)])
    np.testing.assert_allclose(y, direct, atol=1e-12)


def _winograd(x, w, b, layout, activation, blocking, tile=2):
    """``winograd.run`` with a given blocking (``conv2d`` runs the planned one)."""
    from tilegemm.conv import winograd
    from tilegemm.ground.contracts import EPI_RELU6
    p = conv_params(x.shape, w.shape, padding=1, layout=layout)
    out = np.empty(p.output_shape(), x.dtype)
    act = EPI_RELU6 if activation == "relu6" else 0
    return winograd.run(x, w, b, out, p, act, blocking, tile)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [12, 18, 66])
def test_winograd_nhwc_blocks_past_the_l2_budget(threads, block):
    """NHWC Winograd whatever its blocks of tiles (a floor above the L2 budget is taken
    when the transformed weights stream from memory): 90 tiles in blocks of 12 to 66,
    partial last blocks included, give the reference."""
    x = RNG.standard_normal((3, 9, 11, 24)).astype(np.float32)
    w = RNG.standard_normal((20, 24, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(20).astype(np.float32)
    want = reference_conv(x.transpose(0, 3, 1, 2), w, b, padding=1).transpose(0, 2, 3, 1)
    with numba_threads(threads):
        got = _winograd(x, w, b, "NHWC", None, block)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_winograd_nhwc_tiles_floor():
    """NHWC blocks: a few per thread, never below one row panel, nor below
    ``NHWC_STREAM_TILES`` once the transformed weights outgrow L2 -- unless that
    would leave a thread without a block."""
    from tilegemm.conv import winograd
    MR, l2 = 6, 2 << 20
    assert winograd.nhwc_tiles(24, 24, 24, MR, 90, 2, 4, l2) == 12
    assert winograd.nhwc_tiles(24, 24, 24, MR, 6, 2, 4, l2) == MR
    big = 16 * 512 * 512 * 4           # bytes of the transformed weights, 512 x 512
    stream = -(-winograd.NHWC_STREAM_TILES // MR) * MR
    assert winograd.stream_floor(512, 512, MR, 4, big - 1) == stream
    assert winograd.stream_floor(512, 512, MR, 4, big) == MR
    assert winograd.nhwc_tiles(512, 512, 256, MR, 600, 2, 4, big - 1) == stream
    # 128 tiles on 2 threads: a block each rather than one of 96 and an idle thread.
    assert winograd.nhwc_tiles(512, 512, 256, MR, 128, 2, 4, big - 1) == 66


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("plan", [(3, 1), (0, 2), (2, 2), (1, 3), (0, 8)])
def test_winograd_nchw_blocks_split_by_output_channels(dtype, threads, plan, tile):
    """NCHW Winograd with any blocks split into parts of the output channels (whole
    blocks first, then parts; 8 parts of 4 row panels leave some empty): 3 blocks of
    tiles, the last one partial, 20 channels (a partial row panel), bias and relu6,
    give the reference, whatever the tile size."""
    nr = engine.gemm_kernel(dtype)[0].nr
    tiles = 3 * nr - 3                                  # the last block is partial
    x = RNG.standard_normal((1, 16, tile * 3, tile * tiles // 3)).astype(dtype)
    w = RNG.standard_normal((20, 16, 3, 3)).astype(dtype)
    b = RNG.standard_normal(20).astype(dtype)
    want = reference_conv(x, w, b, padding=1, activation="relu6")
    with numba_threads(threads):
        got = _winograd(x, w, b, "NCHW", "relu6", (nr,) + plan, tile)   # NR tiles a block
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * tile ** 2)


def test_winograd_nchw_parts_plan():
    """The split rule on ResNet-18 conv4_x at batch 8 (392 tiles, 7 blocks of 64, 43 row
    panels): whole blocks on 1 thread; on 2, the last block in two parts; every block
    at least in two when asked; whole blocks again once there are plenty."""
    from tilegemm.conv.winograd import NCHW_SPLIT_BLOCKS_PER_THREAD, nchw_parts
    assert nchw_parts(392, 64, 43, 6, 64, 1) == (7, 1)
    assert nchw_parts(392, 64, 43, 6, 64, 2) == (6, 2)
    assert nchw_parts(392, 64, 43, 6, 64, 2, 2)[0] == 0
    many = 2 * NCHW_SPLIT_BLOCKS_PER_THREAD * 64
    assert nchw_parts(many, 64, 43, 6, 64, 2) == (2 * NCHW_SPLIT_BLOCKS_PER_THREAD, 1)
    # Two blocks on two threads already balance.
    assert nchw_parts(128, 64, 86, 6, 64, 2) == (2, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [
    ((3, 32, 9, 17), (32, 3, 3), dict(padding=1, groups=8)),       # ResNeXt-like
    ((2, 12, 10, 11), (12, 3, 3), dict(padding=1, groups=12)),     # depthwise
    ((2, 18, 7, 8), (27, 3, 3), dict(padding=(0, 1), groups=3)),   # 9 channels a group
])
def test_grouped_winograd_nchw_runs_every_group_in_one_task_loop(shape, threads, dtype,
                                                                 monkeypatch):
    """NCHW Winograd on grouped layers gives the reference (bias, relu6, no bias) with one
    task loop for all the groups, as the engine launches for any other layer."""
    groups = record_arg(monkeypatch, "winograd_nchw_tasks", 1, dtype, field="groups")
    with numba_threads(threads):
        run_case(shape, "winograd", "NCHW", dtype, bias=True, activation="relu6")
        run_case(shape, "winograd", "NCHW", dtype, bias=False)
    assert groups and set(groups) == {shape[2]["groups"]}


# --- tile sizes: conv2d's winograd_tile and the plan's choice ----------------------------

@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [
    ((2, 5, 9, 11), (6, 3, 3), dict(padding=1)),
    ((1, 16, 30, 31), (13, 3, 3), dict(padding=(0, 2))),
    ((3, 24, 7, 40), (20, 3, 3), dict(padding=1, groups=4)),
    ((1, 3, 3, 3), (2, 3, 3), dict(padding=2)),                      # fewer pixels than a tile
    ((2, 40, 6, 7), (70, 3, 3), dict(padding=1)),                    # channels past a vector
])
def test_conv2d_runs_every_winograd_tile_size(shape, threads, dtype, tile, layout):
    """``winograd_tile`` m in 2, 4, 6 gives the reference in both layouts on odd sizes,
    groups, padding past the image, bias and relu6, within the float32 error of
    F(m x m, 3x3)."""
    (N, C, H, W), (K, kh, kw), kwargs = shape
    groups = kwargs.get("groups", 1)
    x = RNG.standard_normal((N, C, H, W)).astype(dtype)
    w = RNG.standard_normal((K, C // groups, kh, kw)).astype(dtype)
    b = RNG.standard_normal(K).astype(dtype)
    want = reference_conv(x, w, b, activation="relu6", **kwargs)
    xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    with numba_threads(threads):
        got = tilegemm.conv2d(xin, w, b, activation="relu6", algorithm="winograd",
                              winograd_tile=tile, layout=layout, **kwargs)
    if layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    bound = _tile_bound(x, w, b, tile, kwargs) * (1 if dtype == np.float32 else 1e-8)
    assert (np.abs(got - want) <= bound).all()


def _tile_bound(x, w, b, tile, kwargs):
    """Twice the float32 bound docs/conv-paths.md states for F(tile x tile, 3x3), of the
    largest sum |x||w| (+ |b|) in each output tile: the stated bound is measured on
    post-ReLU layers of many channels, and mixed signs, few channels and padded
    edges round up to 1.5x worse relative to it."""
    mag = reference_conv(np.abs(x), np.abs(w), None if b is None else np.abs(b), **kwargs)
    N, K, Ho, Wo = mag.shape
    TH, TW = -(-Ho // tile), -(-Wo // tile)
    padded = np.zeros((N, K, TH * tile, TW * tile))
    padded[:, :, :Ho, :Wo] = mag
    tile_max = padded.reshape(N, K, TH, tile, TW, tile).max(axis=(3, 5))
    tile_max = np.repeat(np.repeat(tile_max, tile, axis=2), tile, axis=3)[:, :, :Ho, :Wo]
    return 2 * ERROR_BOUND[tile] * tile_max


def test_the_plan_names_its_tile_and_conv2d_runs_it():
    """conv_plan shows the tile size with the estimate of each, picks the cheapest, and
    conv2d with ``algorithm="winograd"`` alone runs that tile, bit for bit."""
    x = RNG.standard_normal((1, 32, 40, 40)).astype(np.float32)
    w = RNG.standard_normal((32, 32, 3, 3)).astype(np.float32)
    plan = tilegemm.conv_plan(x.shape, w.shape, padding=1)
    assert set(plan.winograd_estimates) == set(TILES)
    assert plan.winograd_tile == min(plan.winograd_estimates, key=plan.winograd_estimates.get)
    assert plan.estimates["winograd"] == plan.winograd_estimates[plan.winograd_tile]
    chosen = tilegemm.conv2d(x, w, padding=1, algorithm="winograd")
    forced = tilegemm.conv2d(x, w, padding=1, algorithm="winograd",
                             winograd_tile=plan.winograd_tile)
    np.testing.assert_array_equal(chosen, forced)
    if plan.algorithm == "winograd":
        assert f"F({plan.winograd_tile}x{plan.winograd_tile}" in plan.path
    nhwc = tilegemm.conv_plan((1, 40, 40, 32), w.shape, padding=1, layout="NHWC")
    assert set(nhwc.winograd_estimates) == set(TILES)
    assert nhwc.winograd_tile == min(nhwc.winograd_estimates, key=nhwc.winograd_estimates.get)
    assert tilegemm.conv_plan((1, 32, 40, 40), w.shape, stride=2).winograd_tile == 0


def test_the_plan_takes_larger_tiles_where_they_pay():
    """A tile larger than 2x2 on a wide 3x3 layer of many tiles; on a 7x7 image at batch
    1 (ResNet-18 conv5_x: 16 tiles of 2x2, 4 of 6x6) F(6x6) is estimated slowest: its
    few tiles leave the register tile mostly empty and stream 4x the transformed
    weights of F(2x2) for them.  (Which of F(2x2) and F(4x4) wins there depends on the
    kernels' widths: F(2x2) on AVX-512.)"""
    for layout, shape in (("NCHW", (8, 64, 56, 56)), ("NHWC", (8, 56, 56, 64))):
        wide = tilegemm.conv_plan(shape, (64, 64, 3, 3), padding=1, threads=1, layout=layout)
        assert wide.winograd_tile > 2
    deep = tilegemm.conv_plan((1, 512, 7, 7), (512, 512, 3, 3), padding=1, threads=1)
    assert max(deep.winograd_estimates, key=deep.winograd_estimates.get) == 6


@pytest.mark.parametrize("call, error, words", [
    (dict(algorithm="winograd", winograd_tile=3), ValueError, "(2, 4, 6)"),
    (dict(algorithm="winograd", winograd_tile=4.0), TypeError, "integer"),
    (dict(algorithm="winograd", winograd_tile=True), TypeError, "integer"),
    (dict(algorithm="im2col", winograd_tile=4), ValueError, "algorithm='winograd'"),
    (dict(winograd_tile=2), ValueError, "algorithm='winograd'"),
    (dict(_tile=4), TypeError, "unexpected keyword argument '_tile'"),
])
def test_winograd_tile_errors_name_the_problem(call, error, words):
    x = np.zeros((1, 4, 6, 6), np.float32)
    if call.get("layout") == "NHWC":
        x = np.zeros((1, 6, 6, 4), np.float32)
    with pytest.raises(error, match=re.escape(words)):
        tilegemm.conv2d(x, np.zeros((4, 4, 3, 3), np.float32), padding=1, **call)


def test_tile_sizes_from_several_python_threads():
    """Python threads running the three tile sizes on one weight array at once (each
    tile size packs its own transformed weights) all get the reference."""
    x = RNG.standard_normal((2, 16, 21, 23)).astype(np.float32)
    w = RNG.standard_normal((24, 16, 3, 3)).astype(np.float32)
    want = reference_conv(x, w, None, padding=1)

    def run(i):
        tile = TILES[i % len(TILES)]
        return tile, tilegemm.conv2d(x, w, padding=1, algorithm="winograd", winograd_tile=tile)

    with ThreadPoolExecutor(6) as pool:
        for tile, got in pool.map(run, range(18)):
            bound = _tile_bound(x, w, None, tile, dict(padding=1))
            assert (np.abs(got - want) <= bound).all(), tile
