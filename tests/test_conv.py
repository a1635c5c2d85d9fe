"""conv2d: every algorithm against a float64 direct reference, transforms, packers, errors."""
import contextlib
import dataclasses
import sys
import threading
import time

import numba
import numpy as np
import pytest

import tilegemm
from reference import reference_conv
from tilegemm.conv import engine, paths
from tilegemm.conv.engine import Target
from tilegemm.conv.params import conv_params
from tilegemm.ground.contracts import round_up
from tilegemm.packing.im2col import im2col, pack_b_im2col
from tilegemm.packing.winograd import (AT, BT, G, input_tile_transform, unpack_winograd,
                                       weight_transform)

RNG = np.random.default_rng(1234)

#: Machine facts of the AVX-512 Zen 4 the routing thresholds were measured on (float32:
#: 16 lanes, 6x64 tile, 32 KiB L1d, 1 MiB L2): routing tests pass it explicitly, so
#: they check the rule, not the host.
ZEN4_AVX512 = Target(lanes=16, mr=6, nr=64, l1d_bytes=32 << 10, l2_bytes=1 << 20)





def _tolerance(x, w, dtype):
    """Error bound growing with the reduction: eps * sum |x||w| over the largest window."""
    eps = np.finfo(dtype).eps
    scale = np.abs(x).max() * np.abs(w).sum(axis=(1, 2, 3)).max() if x.size and w.size else 1
    return 8 * eps * (scale + 1)


def run_case(shape, algorithm, layout, dtype=np.float32, bias=True, activation=None, path=None):
    """Compare ``conv2d`` with the reference on ``shape``; ``path`` forces a path of
    :data:`tilegemm.conv.paths.PATHS` (``algorithm`` is then ignored)."""
    (N, C, H, W), (K, kh, kw), kw_args = shape
    groups = kw_args.get("groups", 1)
    x = RNG.standard_normal((N, C, H, W)).astype(dtype)
    w = RNG.standard_normal((K, C // groups, kh, kw)).astype(dtype)
    b = RNG.standard_normal(K).astype(dtype) if bias else None
    expected = reference_conv(x, w, b, activation=activation, **_ref_args(kw_args, (kh, kw)))
    xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    x_before, w_before = xin.copy(), w.copy()
    got = tilegemm.conv2d(xin, w, b, activation=activation, algorithm=algorithm, layout=layout,
                          _path=path, **kw_args)
    np.testing.assert_array_equal(xin, x_before)   # inputs never modified
    np.testing.assert_array_equal(w, w_before)
    if layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    assert got.dtype == dtype
    assert got.shape == expected.shape
    err = np.abs(got - expected).max() if got.size else 0
    tol = _tolerance(x, w, dtype)
    assert err <= tol, (f"{algorithm}/{layout}: max error {err:.3g} > {tol:.3g} "
                        f"at {np.unravel_index(np.abs(got - expected).argmax(), got.shape)}")


def _ref_args(kw, kernel):
    args = {k: v for k, v in kw.items() if k in ("stride", "dilation", "groups")}
    padding = kw.get("padding", 0)
    if padding == "same":
        d = kw.get("dilation", 1)
        d = (d, d) if np.isscalar(d) else d
        pads = []
        for k, dd in zip(kernel, d):
            total = dd * (k - 1)
            pads += [total // 2, total - total // 2]
        padding = tuple(pads)
    elif padding == "valid":
        padding = 0
    args["padding"] = padding
    return args


# (input NCHW, (K, kh, kw), keyword arguments): real layers at small batch/spatial sizes ...
REAL = {
    "resnet18_conv2": ((1, 64, 9, 9), (64, 3, 3), dict(padding=1)),
    "resnet18_conv4": ((2, 256, 4, 5), (256, 3, 3), dict(padding=1)),
    "resnet18_down": ((1, 64, 9, 9), (128, 3, 3), dict(stride=2, padding=1)),
    "resnet18_stem": ((1, 3, 15, 15), (16, 7, 7), dict(stride=2, padding=3)),
    "resnet50_1x1": ((2, 256, 7, 7), (64, 1, 1), {}),
    "resnet50_1x1_s2": ((1, 128, 8, 8), (256, 1, 1), dict(stride=2)),
    "vgg_conv1": ((1, 3, 12, 12), (64, 3, 3), dict(padding=1)),
    "vgg_conv1_2": ((1, 64, 10, 10), (64, 3, 3), dict(padding=1)),
    "mobilenet_dw": ((2, 32, 10, 10), (32, 3, 3), dict(padding=1, groups=32)),
    "mobilenet_dw_s2": ((1, 64, 11, 11), (64, 3, 3), dict(stride=2, padding=1, groups=64)),
}
# ... and odd ones.
ODD = {
    "image_1x1": ((2, 5, 1, 1), (7, 1, 1), {}),
    "image_1x1_pad": ((1, 4, 1, 1), (3, 3, 3), dict(padding=1)),
    "primes": ((1, 7, 13, 11), (5, 3, 3), dict(padding=(2, 1))),
    "rect_kernel_stride": ((1, 3, 9, 14), (4, 2, 5), dict(stride=(3, 1), padding=(1, 2))),
    "dilation": ((1, 4, 12, 10), (6, 3, 3), dict(dilation=(2, 3), padding=2)),
    "groups": ((2, 12, 7, 8), (18, 3, 3), dict(groups=3, padding=1)),
    "groups_1x1": ((1, 8, 5, 5), (8, 1, 1), dict(groups=4)),
    "depthwise_multiplier": ((2, 6, 9, 21), (12, 3, 3), dict(groups=6, padding=1)),
    "depthwise_dilated_rows": ((1, 5, 11, 40), (5, 3, 5), dict(groups=5, padding=(2, 3),
                                                              dilation=(2, 1), stride=(2, 1))),
    # More pixels than any NC block and channels in several KC blocks: 1x1 packs B as a GEMM.
    "pointwise_large": ((1, 400, 3, 1100), (9, 1, 1), {}),
    "same": ((1, 3, 6, 7), (5, 4, 2), dict(padding="same")),
    "valid_wide": ((1, 2, 3, 70), (130, 3, 3), dict(padding="valid")),
    "large_stride": ((1, 3, 17, 17), (8, 3, 3), dict(stride=4)),
    # Stride 2 with few channels and many pixels: a stride-split copy of each image.
    "stride2_packed": ((1, 5, 40, 37), (6, 3, 3), dict(stride=2, padding=1)),
    "wide_tiles": ((3, 5, 6, 75), (9, 3, 3), dict(padding=1)),
    "narrow_tiles": ((5, 9, 11, 3), (13, 3, 3), dict(padding=(0, 1))),
}
CASES = {**REAL, **ODD}


def _algorithms(shape):
    p = conv_params(*_shapes(shape), **shape[2])
    return ["im2col", "direct", "auto"] + (["winograd"] if p.winograd_ok else [])


def _shapes(shape):
    (N, C, H, W), (K, kh, kw), kw_args = shape
    return (N, C, H, W), (K, C // kw_args.get("groups", 1), kh, kw)


PARAMS = []
for _i, (_name, _shape) in enumerate(CASES.items()):
    for _alg in _algorithms(_shape):
        for _layout in ("NCHW", "NHWC"):
            # Cycle bias/activation through the cases so every combination appears.
            _bias = (_i + len(PARAMS)) % 2 == 0
            _act = (None, "relu", "relu6")[(_i + len(PARAMS)) % 3]
            PARAMS.append(pytest.param(_shape, _alg, _layout, _bias, _act,
                                       id=f"{_name}-{_alg}-{_layout}-{'b' if _bias else 'nb'}-{_act}"))


@pytest.mark.parametrize("shape, algorithm, layout, bias, activation", PARAMS)
def test_conv_matches_reference(shape, algorithm, layout, bias, activation):
    run_case(shape, algorithm, layout, np.float32, bias, activation)


@pytest.mark.parametrize("name", ["resnet18_conv2", "groups", "dilation", "mobilenet_dw"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv_float64(name, layout):
    for alg in _algorithms(CASES[name]):
        run_case(CASES[name], alg, layout, np.float64, True, "relu")


def test_mixed_dtypes_promote():
    x = RNG.standard_normal((1, 3, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 3))
    y = tilegemm.conv2d(x, w)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, reference_conv(x, w), rtol=1e-12, atol=1e-12)


# --- NaN / Inf ------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["im2col", "winograd", "direct"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_nan_propagates(algorithm, layout, activation):
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    x[0, 1, 3, 4] = np.nan
    x[0, 2, 0, 0] = np.inf
    w = RNG.standard_normal((5, 4, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, padding=1, activation=activation)
    xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    got = tilegemm.conv2d(xin, w, padding=1, activation=activation, algorithm=algorithm,
                          layout=layout)
    if layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    if algorithm == "winograd":
        # The transforms mix a 4x4 input tile, so a NaN or Inf poisons (with NaN or Inf)
        # every output of its 2x2 tiles: non-finite where the reference is, never finite
        # and wrong elsewhere.
        assert not np.isfinite(got[~np.isfinite(expected)]).any()
        finite = np.isfinite(got)
        assert finite.sum() >= np.isfinite(expected).sum() - 4 * 4 * 5
    else:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
        finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


# --- Winograd transforms against the explicit matrices --------------------------------

def test_weight_transform_matches_G():
    w = RNG.standard_normal((3, 2, 3, 3))
    u = weight_transform(w)
    for k in range(3):
        for c in range(2):
            np.testing.assert_allclose(u[:, c, k].reshape(4, 4), G @ w[k, c] @ G.T, atol=1e-12)


def test_input_transform_matches_BT():
    d = RNG.standard_normal((6, 7))
    v = np.empty(16)
    flat = d.reshape(-1)
    for y0, x0 in [(0, 0), (1, 2), (2, 3), (-1, -2), (4, 5), (-3, 4)]:
        padded = np.zeros((4, 4))
        for a in range(4):
            for b in range(4):
                if 0 <= y0 + a < 6 and 0 <= x0 + b < 7:
                    padded[a, b] = d[y0 + a, x0 + b]
        src = y0 * 7 + x0
        input_tile_transform(flat, src, 7, 1, y0, x0, 6, 7, v)
        np.testing.assert_allclose(v.reshape(4, 4), BT @ padded @ BT.T, atol=1e-12,
                                   err_msg=f"tile at ({y0}, {x0})")


def test_output_transform_matches_AT():
    K = 3
    m = RNG.standard_normal((16, 1, K))                      # one tile, K channels
    bias = RNG.standard_normal(K)
    out = np.full((1, K, 2, 2), np.nan)
    geom = (4, 4, 2, 2, 0, 0, 1, 1)
    unpack_winograd(m.reshape(-1), K, K, 0, 1, K, out.reshape(-1), 0, (4 * K, 4, 2, 1), geom,
                    bias, True, 0)
    for k in range(K):
        np.testing.assert_allclose(out[0, k], AT @ m[:, 0, k].reshape(4, 4) @ AT.T + bias[k],
                                   atol=1e-12)


def _vector_transform_case(dtype, H, W, pad, N=2):
    """Geometry, strides and the run table of the vector transforms for an NCHW image."""
    from tilegemm.conv import engine
    mod = engine.family_module("winograd", dtype)
    Ho, Wo = H + 2 * pad - 2, W + 2 * pad - 2
    TH, TW = -(-Ho // 2), -(-Wo // 2)
    geom = (H, W, Ho, Wo, pad, pad, TH, TW)
    return mod, geom, TH, TW


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, pad", [(9, 9, 1), (6, 40, 1), (5, 3, 0), (4, 70, 1), (1, 1, 1)])
def test_vector_input_transform_matches_BT(dtype, H, W, pad):
    """The NCHW input transform (B^T d B, lanes of tiles) writes packed B exactly."""
    from tilegemm.conv import engine
    mod, geom, TH, TW = _vector_transform_case(dtype, H, W, pad)
    NR = engine.gemm_kernel(dtype)[0].nr
    N, C = 2, 3
    x = RNG.standard_normal((N, C, H, W)).astype(dtype)
    xs = (C * H * W, H * W, W, 1)
    tiles = N * TH * TW
    T0 = 1 if tiles > 1 else 0                       # a block not starting at tile 0
    nt = tiles - T0
    NB = -(-nt // NR) * NR
    runs = np.empty((NB, 9), np.int64)
    nruns = mod.winograd_runs(T0, nt, geom, xs, (0, 0, 0, 0), runs)
    p0, kc = 1, 2                                      # channels 1 and 2
    slab = kc * NB
    buf = np.full(16 * slab, np.nan, dtype)
    mod.winograd_input_block(x.reshape(-1), 0, xs[1], xs[2], H, W, runs, nruns, p0, kc, buf, slab)
    xp = np.zeros((N, C, H + 4 + 2 * pad, W + 4 + 2 * pad))
    xp[:, :, pad:pad + H, pad:pad + W] = x
    for j in range(nt):
        n, r = divmod(T0 + j, TH * TW)
        ty, tx = divmod(r, TW)
        for p in range(kc):
            d = xp[n, p0 + p, 2 * ty:2 * ty + 4, 2 * tx:2 * tx + 4]
            got = buf[np.arange(16) * slab + (j // NR) * NR * kc + p * NR + j % NR]
            np.testing.assert_allclose(got.reshape(4, 4), BT @ d @ BT.T, rtol=1e-5, atol=1e-5,
                                       err_msg=f"tile {T0 + j}, channel {p0 + p}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Ho, Wo", [(7, 7), (2, 33), (5, 2), (1, 1)])
@pytest.mark.parametrize("activation", [0, 4, 8])
def test_vector_output_transform_matches_AT(dtype, Ho, Wo, activation):
    """The NCHW output transform (A^T m A + bias + activation) writes only the image."""
    from tilegemm.conv import engine
    from tilegemm.ground.contracts import EPI_BIAS_ROW
    mod, _, _, _ = _vector_transform_case(dtype, Ho, Wo, 1)
    TH, TW = -(-Ho // 2), -(-Wo // 2)
    geom = (Ho, Wo, Ho, Wo, 1, 1, TH, TW)
    lanes = engine.gemm_kernel(dtype)[0].lanes
    N, K = 2, 3
    tiles = N * TH * TW
    NB = -(-tiles // lanes) * lanes
    os_ = (K * Ho * Wo, Ho * Wo, Wo, 1)
    runs = np.empty((NB, 9), np.int64)
    nruns = mod.winograd_runs(0, tiles, geom, (0, 0, 0, 0), os_, runs)
    m = RNG.standard_normal((16, K, NB)).astype(dtype) * 4
    bias = RNG.standard_normal(K).astype(dtype)
    out = np.full((N, K, Ho, Wo), np.nan, dtype)
    mod.winograd_output_block(m.reshape(-1), K * NB, NB, runs, nruns, 0, K, out.reshape(-1), 0,
                              os_[1], os_[2], Wo, bias, 0, activation | EPI_BIAS_ROW)
    want = np.zeros((N, K, 2 * TH, 2 * TW))
    for t in range(tiles):
        n, r = divmod(t, TH * TW)
        ty, tx = divmod(r, TW)
        for k in range(K):
            want[n, k, 2 * ty:2 * ty + 2, 2 * tx:2 * tx + 2] = \
                AT @ m[:, k, t].reshape(4, 4).astype(np.float64) @ AT.T + bias[k]
    want = want[:, :, :Ho, :Wo]
    if activation:
        want = np.maximum(want, 0)
    if activation == 8:
        want = np.minimum(want, 6)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_winograd_identity():
    """A^T[(G g G^T) * (B^T d B)]A is the 2x2 valid correlation of d with g."""
    d = RNG.standard_normal((4, 4))
    g = RNG.standard_normal((3, 3))
    y = AT @ ((G @ g @ G.T) * (BT @ d @ BT.T)) @ AT.T
    direct = np.array([[np.sum(d[i:i + 3, j:j + 3] * g) for j in range(2)] for i in range(2)])
    np.testing.assert_allclose(y, direct, atol=1e-12)


# --- implicit im2col packers against the explicit matrix ------------------------------

@pytest.mark.parametrize("geom", [
    dict(kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1)),
    dict(kernel=(2, 5), stride=(2, 3), padding=(0, 1, 2, 1), dilation=(2, 1)),
])
def test_pack_b_im2col_matches_explicit(geom):
    C, H, W, NR = 3, 7, 9, 16
    x = RNG.standard_normal((C, H, W))
    col = im2col(x, geom["kernel"], geom["stride"], geom["padding"], geom["dilation"])
    p = conv_params((1, C, H, W), (1, C) + geom["kernel"], geom["stride"],
                    (geom["padding"][0], geom["padding"][2]), geom["dilation"])
    p = dataclasses.replace(p, bottom=geom["padding"][1], right=geom["padding"][3])
    assert col.shape == (C * p.kh * p.kw, p.Ho * p.Wo)
    for p0, kc, j0, nc in [(0, col.shape[0], 0, col.shape[1]), (2, 5, 3, 20), (7, 4, 5, 1)]:
        kc = min(kc, col.shape[0] - p0)
        nc = min(nc, col.shape[1] - j0)
        buf = np.full(-(-nc // NR) * NR * kc, np.nan)
        pack_b_im2col(x.reshape(-1), 0, (0, H * W, W, 1), p.geom(), p0, kc, j0, nc, NR, buf)
        for q in range(-(-nc // NR)):
            panel = buf[q * NR * kc:(q + 1) * NR * kc].reshape(kc, NR)
            want = np.zeros((kc, NR))
            cols = min(NR, nc - q * NR)
            want[:, :cols] = col[p0:p0 + kc, j0 + q * NR:j0 + q * NR + cols]
            np.testing.assert_array_equal(panel, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", [
    dict(kernel=(3, 3), stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), W=9),
    dict(kernel=(3, 2), stride=(1, 1), padding=(2, 0, 3, 1), dilation=(2, 3), W=40),
    dict(kernel=(2, 5), stride=(2, 3), padding=(0, 1, 2, 1), dilation=(2, 1), W=9),
    # Horizontal stride 2: every-other-pixel vector copies, runs longer than a vector.
    dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1, 1, 1), dilation=(1, 1), W=75),
    dict(kernel=(7, 7), stride=(2, 2), padding=(3, 3, 3, 3), dilation=(1, 1), W=40),
    dict(kernel=(3, 2), stride=(1, 2), padding=(0, 2, 1, 0), dilation=(1, 3), W=38),
])
def test_vector_pack_b_im2col_matches_explicit(dtype, geom):
    """The generated NCHW packer (vector row copies) writes the explicit patch matrix."""
    from tilegemm.conv import engine
    mod = engine.family_module("im2col", dtype)
    NR = engine.gemm_kernel(dtype)[0].nr
    C, H, W = 3, 7, geom["W"]
    x = RNG.standard_normal((C, H, W)).astype(dtype)
    col = im2col(x, geom["kernel"], geom["stride"], geom["padding"], geom["dilation"])
    p = conv_params((1, C, H, W), (1, C) + geom["kernel"], geom["stride"],
                    (geom["padding"][0], geom["padding"][2]), geom["dilation"])
    p = dataclasses.replace(p, bottom=geom["padding"][1], right=geom["padding"][3])
    for p0, kc, j0, nc in [(0, col.shape[0], 0, col.shape[1]), (2, 5, 3, 20), (7, 4, 5, 1)]:
        kc = min(kc, col.shape[0] - p0)
        nc = min(nc, col.shape[1] - j0)
        buf = np.full(-(-nc // NR) * NR * kc, np.nan, dtype)
        mod.pack_b_im2col_rows(x.reshape(-1), 0, (0, H * W, W, 1), p.geom(), p0, kc, j0, nc, buf,
                               True)
        for q in range(-(-nc // NR)):
            panel = buf[q * NR * kc:(q + 1) * NR * kc].reshape(kc, NR)
            want = np.zeros((kc, NR))
            cols = min(NR, nc - q * NR)
            want[:, :cols] = col[p0:p0 + kc, j0 + q * NR:j0 + q * NR + cols]
            np.testing.assert_array_equal(panel, want)


# --- fold_batchnorm -------------------------------------------------------------------

@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_batchnorm(with_bias):
    x = RNG.standard_normal((2, 6, 7, 7))
    w = RNG.standard_normal((8, 6, 3, 3))
    b = RNG.standard_normal(8) if with_bias else None
    gamma, beta, mean = RNG.standard_normal((3, 8))
    var = RNG.random(8) + 0.1
    args = (w, b, gamma, beta, mean, var)
    copies = [None if a is None else a.copy() for a in args]
    w2, b2 = tilegemm.fold_batchnorm(*args, eps=1e-3)
    for a, c in zip(args, copies):
        if a is not None:
            np.testing.assert_array_equal(a, c)
    y = reference_conv(x, w, b, padding=1)
    bn = (gamma[:, None, None] * (y - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-3)
          + beta[:, None, None])
    np.testing.assert_allclose(tilegemm.conv2d(x, w2, b2, padding=1), bn, rtol=1e-10, atol=1e-10)


def test_fold_batchnorm_errors():
    w = np.ones((4, 2, 3, 3))
    v = np.ones(4)
    with pytest.raises(ValueError, match="gamma"):
        tilegemm.fold_batchnorm(w, None, np.ones(3), v, v, v)
    with pytest.raises(ValueError, match="var"):
        tilegemm.fold_batchnorm(w, None, v, v, v, -v)
    with pytest.raises(ValueError, match="4-D"):
        tilegemm.fold_batchnorm(np.ones((4, 2)), None, v, v, v, v)
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.fold_batchnorm(w.astype(int), None, v, v, v, v)


# --- errors ---------------------------------------------------------------------------

X = np.zeros((1, 4, 8, 8), np.float32)
WT = np.zeros((6, 4, 3, 3), np.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: tilegemm.conv2d(X[0], WT), ValueError, "input must be 4-D"),
    (lambda: tilegemm.conv2d(X, WT[0]), ValueError, "weight must be 4-D"),
    (lambda: tilegemm.conv2d(X, WT[:, :3]), ValueError, "input channels per group"),
    (lambda: tilegemm.conv2d(X, WT, groups=3), ValueError, "does not divide the 4 input"),
    (lambda: tilegemm.conv2d(X, WT[:5, :2], groups=2), ValueError, "does not divide the 5 output"),
    (lambda: tilegemm.conv2d(X, WT, groups=0), ValueError, "groups must be positive"),
    (lambda: tilegemm.conv2d(X, WT, stride=0), ValueError, "stride must be positive"),
    (lambda: tilegemm.conv2d(X, WT, stride=(1, -2)), ValueError, "stride must be positive"),
    (lambda: tilegemm.conv2d(X, WT, dilation=0), ValueError, "dilation must be positive"),
    (lambda: tilegemm.conv2d(X, WT, padding=-1), ValueError, "padding must be non-negative"),
    (lambda: tilegemm.conv2d(X, WT, padding="full"), ValueError, "padding must be"),
    (lambda: tilegemm.conv2d(X, WT, padding="same", stride=2), ValueError, "strided"),
    (lambda: tilegemm.conv2d(X, WT, stride=1.5), TypeError, "stride"),
    (lambda: tilegemm.conv2d(X, WT, stride=(1, 2, 3)), ValueError, "pair"),
    (lambda: tilegemm.conv2d(X[:, :, :2, :2], WT), ValueError, "output would be empty"),
    (lambda: tilegemm.conv2d(X, WT, dilation=5), ValueError, "output would be empty"),
    (lambda: tilegemm.conv2d(X, WT, np.zeros(5, np.float32)), ValueError, "bias must have shape"),
    (lambda: tilegemm.conv2d(X, WT, np.zeros((6, 1), np.float32)), ValueError, "bias"),
    (lambda: tilegemm.conv2d(X, np.zeros((6, 4, 5, 5), np.float32), padding=2,
                             algorithm="winograd"), ValueError, "winograd"),
    (lambda: tilegemm.conv2d(X, WT, stride=2, algorithm="winograd"), ValueError, "stride 1"),
    (lambda: tilegemm.conv2d(X, WT, algorithm="fft"), ValueError, "unknown algorithm"),
    (lambda: tilegemm.conv2d(X, WT, activation="gelu"), ValueError, "unknown activation"),
    (lambda: tilegemm.conv2d(X, WT, layout="CHWN"), ValueError, "layout"),
    (lambda: tilegemm.conv2d(X.astype(np.int32), WT), TypeError, "input has dtype int32"),
    (lambda: tilegemm.conv2d(X, WT.astype(np.float16)), TypeError, "weight has dtype float16"),
    (lambda: tilegemm.conv2d(X, WT, layout="NHWC"), ValueError, "input channels per group"),
    (lambda: tilegemm.conv_plan((1, 4, 8, 8), (6, 4, 3, 3), groups=5), ValueError, "groups"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_validation_cache_still_refuses_what_equals_a_cached_call():
    """A valid call is cached; arguments that compare equal to it but are not plain ints
    (True == 1, a bool inside a pair) must still be refused, and numpy integers accepted."""
    expected = tilegemm.conv2d(X, WT, stride=1, padding=1, dilation=1, groups=1)
    for bad in (dict(stride=True), dict(stride=(1, True)), dict(padding=(True, 1)),
                dict(dilation=np.bool_(True)), dict(groups=True)):
        with pytest.raises(TypeError):
            tilegemm.conv2d(X, WT, **{**dict(stride=1, padding=1), **bad})
    got = tilegemm.conv2d(X, WT, stride=np.int64(1), padding=(np.int32(1), 1), groups=np.int8(1))
    np.testing.assert_array_equal(got, expected)


def test_empty_batch_and_channels():
    assert tilegemm.conv2d(np.zeros((0, 4, 8, 8), np.float32), WT, padding=1).shape == (0, 6, 8, 8)
    b = np.arange(6, dtype=np.float32) - 3
    y = tilegemm.conv2d(np.zeros((1, 0, 4, 4), np.float32), np.zeros((6, 0, 3, 3), np.float32),
                        b, activation="relu")
    np.testing.assert_array_equal(y, np.maximum(b, 0).reshape(1, 6, 1, 1) * np.ones((1, 6, 2, 2)))


# --- plan, caching, threads -----------------------------------------------------------

def test_plan_is_inspectable():
    plan = tilegemm.conv_plan((8, 64, 56, 56), (64, 64, 3, 3), padding=1)
    assert plan.algorithm in plan.estimates
    assert set(plan.estimates) == {"im2col", "winograd", "direct"}
    assert plan.estimates[plan.algorithm] == min(plan.estimates.values())
    assert plan.params.Ho == 56 and plan.reason
    dw = tilegemm.conv_plan((1, 32, 56, 56), (32, 1, 3, 3), padding=1, groups=32)
    assert "winograd" in dw.estimates and dw.algorithm == "direct"
    s2 = tilegemm.conv_plan((1, 64, 56, 56), (64, 64, 3, 3), stride=2, padding=1)
    assert "winograd" not in s2.estimates


def test_plan_nhwc_grouped_and_depthwise():
    """NHWC: a grouped layer of a few output channels a group runs its groups as planes,
    one of many by the rows kernel; a depthwise layer with channels for the vector
    kernel runs direct (the planes path must not take it)."""
    from tilegemm.conv.plan import choose

    def plan(x, w, padding, groups):      # on the machine the thresholds were measured on
        p = conv_params(x, w, 1, padding, 1, groups, "NHWC")
        return choose(p, np.float32, 1, ZEN4_AVX512)

    grouped = plan((8, 28, 28, 256), (256, 8, 3, 3), 1, 32)
    assert grouped.algorithm == "im2col" and grouped.route == "im2col.planes"
    wide = plan((8, 28, 28, 256), (256, 128, 5, 5), 2, 2)
    assert wide.algorithm == "im2col" and wide.route == "im2col.rows"
    dw = plan((8, 28, 28, 256), (256, 1, 3, 3), 1, 256)
    assert dw.algorithm == "direct" and dw.route == "direct.nhwc_vector"


def test_weight_changed_in_place_is_not_served_stale():
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((8, 8, 3, 3)).astype(np.float32)
    for alg in ("winograd", "im2col"):
        first = tilegemm.conv2d(x, w, padding=1, algorithm=alg)
        np.testing.assert_allclose(first, reference_conv(x, w, padding=1), atol=1e-4)
        w2 = w.copy()
        w[0, 0, 1, 1] += 1.0
        second = tilegemm.conv2d(x, w, padding=1, algorithm=alg)
        np.testing.assert_allclose(second, reference_conv(x, w, padding=1), atol=1e-4)
        w[...] = w2


def test_thread_buffers_views_follow_regrown_buffers():
    """Kept views are reused only while the buffers under them stay: after a larger
    request regrows them, a small request views the new buffers, never the old."""
    key = ("test_views",)
    small, = engine.thread_buffers(key, 2, (10,), np.float32)
    assert small.shape == (2, 64) and small.ctypes.data % 64 == 0
    assert engine.thread_buffers(key, 2, (10,), np.float32)[0] is small
    big, = engine.thread_buffers(key, 2, (10000,), np.float32)
    again, = engine.thread_buffers(key, 2, (10,), np.float32)
    assert np.shares_memory(again, big) and not np.shares_memory(again, small)
    assert again.shape == (2, 64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, size", [(np.float32, 1152), (np.float64, 3 * 4096 + 5)])
def test_same_contents_finds_any_changed_bit(threads, dtype, size, monkeypatch):
    """The cache's check that a weight array is unchanged: one flipped bit anywhere (the
    ends of each thread's part and of each block) is found; NaN matches itself."""
    monkeypatch.setattr(engine, "COMPARE_BYTES_PER_THREAD", 1024)   # cut even small arrays
    w = RNG.standard_normal(size).astype(dtype)
    w[7] = np.nan
    copy = w.copy()
    with _threads(threads):
        assert engine.same_contents(copy, w)
        ends = {0, size - 1, 4095, 4096} | {size * t // 2 + d for t in (1,) for d in (-1, 0)}
        for i in sorted(e for e in ends if e < size):
            for bit in (0, 8 * w.itemsize - 1):                  # lowest bit, sign bit
                changed = w.copy()
                changed.view(f"u{w.itemsize}")[i] ^= np.array(1 << bit).astype(f"u{w.itemsize}")
                assert not engine.same_contents(copy, changed), (i, bit)
    assert not engine.same_contents(np.zeros(3, dtype), np.array([0.0, -0.0, 0.0], dtype))


@pytest.mark.parametrize("algorithm", ["im2col", "winograd", "direct"])
def test_thread_counts_agree(algorithm):
    x = RNG.standard_normal((3, 16, 20, 20)).astype(np.float32)
    w = RNG.standard_normal((24, 16, 3, 3)).astype(np.float32)
    saved = numba.get_num_threads()
    try:
        results = []
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            results.append(tilegemm.conv2d(x, w, padding=1, algorithm=algorithm))
    finally:
        numba.set_num_threads(saved)
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-5, atol=1e-5)


def _in_threads(work, n):
    """``work(i)`` on ``n`` Python threads at once; fails with their exceptions."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_concurrent_python_threads():
    x = RNG.standard_normal((4, 16, 20, 20)).astype(np.float32)
    ws = [RNG.standard_normal((32, 16, 3, 3)).astype(np.float32) for _ in range(3)]
    expected = [reference_conv(x, w, padding=1) for w in ws]

    def work(i):
        for rep in range(3):
            alg = ("im2col", "winograd", "direct")[(i + rep) % 3]
            got = tilegemm.conv2d(x, ws[i], padding=1, algorithm=alg)
            np.testing.assert_allclose(got, expected[i], rtol=1e-4, atol=1e-3)

    _in_threads(work, 3)


def test_concurrent_python_threads_on_the_taps_layout():
    """Stride-1 im2col read in place, masked sums and batched tails, from several Python
    threads at once, some sharing one weight array (and its prepared packing)."""
    x = RNG.standard_normal((3, 64, 9, 13)).astype(np.float32)
    ws = [RNG.standard_normal((20, 64, 3, 3)).astype(np.float32) for _ in range(2)]
    b = RNG.standard_normal(20).astype(np.float32)
    expected = [reference_conv(x, w, b, padding=1, activation="relu") for w in ws]

    def work(i):
        for rep in range(4):
            got = tilegemm.conv2d(x, ws[i % 2], b, padding=1, activation="relu",
                                  algorithm="im2col")
            np.testing.assert_allclose(got, expected[i % 2], rtol=1e-4, atol=1e-4)

    _in_threads(work, 4)


# --- torch cross-check ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet18_conv2", "resnet50_1x1", "mobilenet_dw_s2", "same",
                                  "dilation", "groups"])
def test_matches_torch(name):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    shape = CASES[name]
    xs, ws = _shapes(shape)
    x = RNG.standard_normal(xs).astype(np.float32)
    w = RNG.standard_normal(ws).astype(np.float32)
    b = RNG.standard_normal(ws[0]).astype(np.float32)
    kw = shape[2]
    expected = F.relu(F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                               **kw)).numpy()
    got = tilegemm.conv2d(x, w, b, activation="relu", **kw)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


# (input NCHW, (K, kh, kw), keyword arguments) served by the stride-split im2col path:
# output rows written straight (1x1 stride 2, whole panels) with and without a partial
# row panel, channels in two k blocks, dilation with asymmetric padding and strides.
TAPS_CASES = {
    "direct_rows": ((2, 16, 16, 16), (24, 1, 1), dict(stride=2)),
    "direct_partial_rows": ((2, 16, 16, 16), (20, 1, 1), dict(stride=2)),
    "two_k_blocks": ((1, 130, 10, 10), (70, 3, 3), dict(padding=1)),
    "dilated_strided": ((2, 8, 12, 13), (9, 3, 3), dict(dilation=2, padding=(1, 2),
                                                       stride=(2, 1))),
    "column_blocks": ((1, 4, 15, 16), (300, 3, 3), dict(padding=1)),
    "many_channels": ((2, 64, 19, 23), (10, 3, 3), dict(padding=1)),
}

# Grouped layers on the same path: each group's weights packed on their own, tasks over
# (group, image).  4 in / 4 out per group (ResNeXt's shape: the 4-row kernel writes
# straight, tail columns batched over the images), a stride-split copy per group with a
# partial row panel, a zero-padded copy, few pixels with 2 rows a group.
GROUPED_TAPS = {
    "resnext": ((3, 32, 9, 17), (32, 3, 3), dict(padding=1, groups=8)),
    "strided_copy": ((2, 24, 11, 12), (21, 3, 3), dict(stride=2, padding=1, groups=3)),
    "padded_copy": ((2, 12, 12, 12), (20, 3, 3), dict(stride=2, groups=2)),
    "two_rows": ((2, 16, 5, 6), (16, 3, 3), dict(padding=1, groups=8)),
}


@pytest.mark.parametrize("name", list(TAPS_CASES))
def test_taps_path(name, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    shape = TAPS_CASES[name]
    # A small C block forces several column blocks on the last case.
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", 1 << 16)
    p = conv_params(*_shapes(shape), **shape[2])
    assert taps_mod.serves(p)
    run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu",
             path="im2col.taps")


def test_taps_tails_split_only_when_too_few_for_the_threads():
    """The tails GEMM (columns past each image's last whole panel) is cut by rows between
    threads only when there are fewer tails GEMMs than threads: every share packs the
    tails again.  Two 25x25 images of 256 channels (one tails GEMM a group): one group
    split, 32 groups not."""
    from tilegemm.conv import taps as taps_mod
    kernel, blk = engine.gemm_kernel(np.float32)
    for groups, split in ((1, 2), (32, 1)):
        p = conv_params((2, 256, 25, 25), (256, 256 // groups, 3, 3), 1, 1, 1, groups)
        KC = taps_mod.taps_kc(p, kernel.mr, kernel.nr, 4, 32 << 10)
        Mp = round_up(p.Kg, kernel.mr)
        plan = taps_mod.taps_plan(p, "<f4", 2, True, kernel.mr, kernel.nr, KC, Mp, blk.mc,
                                  taps_mod.TAPS_C_BYTES, taps_mod.TAPS_TAIL_COLUMNS,
                                  engine.TASKS_PER_THREAD)
        assert plan.q_end < 25 * 25 and plan.tail_parts == split


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(GROUPED_TAPS))
def test_grouped_im2col_runs_every_group_in_one_task_loop(name, threads, dtype, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    shape = GROUPED_TAPS[name]
    groups = _record_arg(monkeypatch, "taps_tasks", 1, dtype, field="groups")
    assert taps_mod.serves(conv_params(*_shapes(shape), **shape[2]))
    with _threads(threads):
        run_case(shape, "im2col", "NCHW", dtype, bias=True, activation="relu6",
                 path="im2col.taps")
        run_case(shape, "im2col", "NCHW", dtype, bias=False, path="im2col.taps")
    # Every thread's task loop gets all the groups (no launch per group).
    assert groups and set(groups) == {shape[2]["groups"]}


# NHWC grouped layers the planes path serves (stride 1, the output as wide as the image):
# groups copied a cache line of channels at a time, depthwise (one channel a group), a
# dilated 5x5, a last block of fewer groups, several column blocks.
PLANES = {
    "resnext": ((3, 32, 9, 17), (32, 3, 3), dict(padding=1, groups=8)),
    "two_rows": ((2, 16, 5, 6), (16, 3, 3), dict(padding=1, groups=8)),
    "depthwise": ((2, 24, 7, 9), (24, 3, 3), dict(padding=1, groups=24)),
    "dilated_5x5": ((1, 12, 11, 10), (6, 5, 5), dict(padding=4, dilation=2, groups=3)),
    "partial_block": ((2, 72, 6, 7), (36, 3, 3), dict(padding=1, groups=36)),
    "column_blocks": ((1, 8, 30, 31), (6, 3, 3), dict(padding=1, groups=2)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(PLANES))
def test_grouped_nhwc_im2col_copies_groups_as_planes(name, threads, dtype, monkeypatch):
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", 1 << 12)   # several column blocks
    shape = PLANES[name]
    (N, C, H, W), (K, kh, kw), kw_args = shape
    p = conv_params((N, H, W, C), (K, C // kw_args["groups"], kh, kw), layout="NHWC", **kw_args)
    assert paths.serves("im2col.planes", p, dtype)
    blocks = _record_arg(monkeypatch, "planes_tasks", 1, dtype, field="G")  # groups a task
    with _threads(threads):
        run_case(shape, "im2col", "NHWC", dtype, bias=True, activation="relu",
                 path="im2col.planes")
        run_case(shape, "im2col", "NHWC", dtype, bias=False, path="im2col.planes")
    assert blocks and all(1 <= g <= kw_args["groups"] for g in blocks)


# NHWC layers of the rows path (every NHWC layer but 1x1 stride 1 and the planes path's):
# channels in several KC blocks and output channels in several NC blocks (forced by
# small cache shares below), a partial last row panel of pixels and NR panel of
# channels, strides, dilation, rectangular kernels, grouped strided layers, padding
# wider than the kernel reaches.
ROWS = {
    "blocks": ((2, 40, 7, 9), (37, 3, 3), dict(padding=1)),
    "stride2": ((3, 9, 13, 11), (20, 3, 3), dict(stride=2, padding=1)),
    "stem": ((1, 3, 19, 23), (16, 7, 7), dict(stride=2, padding=3)),
    "dilated_rect": ((2, 6, 12, 10), (5, 2, 5), dict(padding=(3, 4), dilation=(3, 2),
                                                     stride=(1, 2))),
    "grouped_s2": ((2, 24, 9, 9), (36, 3, 3), dict(stride=2, padding=1, groups=3)),
    "grouped_wide": ((2, 32, 7, 9), (128, 3, 3), dict(padding=1, groups=2)),
    "wide_padding": ((1, 4, 3, 2), (3, 3, 3), dict(padding=(3, 2))),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(ROWS))
def test_nhwc_im2col_reads_pixels_in_place(name, threads, dtype, monkeypatch):
    _run_rows_path(ROWS[name], "NHWC", threads, dtype, "relu6", monkeypatch)


def _run_rows_path(shape, layout, threads, dtype, activation, monkeypatch):
    """``run_case`` of ``shape`` on the rows path with and without bias and activation,
    with cache shares that force several blocks and tasks, checking the path ran."""
    from tilegemm.conv import rows as rows_mod
    # KC of about 20 channels for 3x3 kernels, NR-column NC blocks, a row panel a task.
    monkeypatch.setattr(rows_mod, "ROWS_A_L1", 1 / 16)
    monkeypatch.setattr(rows_mod, "ROWS_B_L2", 1 / 2048)
    monkeypatch.setattr(rows_mod, "ROWS_A_L2", 1 / 4096)
    tasks = _record_arg(monkeypatch, f"rows_{layout.lower()}_tasks", 1, dtype, field="ntasks")
    with _threads(threads):
        run_case(shape, "im2col", layout, dtype, bias=True, activation=activation,
                 path="im2col.rows")
        run_case(shape, "im2col", layout, dtype, bias=False, path="im2col.rows")
    assert tasks and all(n > 1 for n in tasks)


# NCHW layers of the rows path (one group, enough channels, small output planes):
# channels in several KC blocks, output channels in several NC blocks and a partial
# last NR panel ("edge"), tasks that cross images, strides, dilation, rectangular
# kernels, no padding.
ROWS_NCHW = {
    "edge": ((3, 48, 5, 5), (90, 3, 3), dict(padding=1)),
    "stride2": ((3, 48, 13, 11), (64, 3, 3), dict(stride=2, padding=1)),
    "k5": ((2, 64, 9, 8), (64, 5, 5), dict(padding=2)),
    "dilated_rect": ((2, 48, 12, 10), (64, 2, 5), dict(padding=(3, 4), dilation=(3, 2),
                                                      stride=(1, 2))),
    "valid": ((2, 48, 6, 6), (64, 3, 3), dict(padding=0)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(ROWS_NCHW))
def test_nchw_im2col_on_the_rows_kernel(name, threads, dtype, monkeypatch):
    from tilegemm.conv import rows as rows_mod
    shape = ROWS_NCHW[name]
    (N, C, H, W), (K, kh, kw), kw_args = shape
    p = conv_params((N, C, H, W), (K, C, kh, kw), kw_args.get("stride", 1),
                    kw_args["padding"], kw_args.get("dilation", 1), 1, "NCHW")
    # On a 6x64 tile (AVX-512 float32) auto takes this path; other tiles may not.
    assert rows_mod.nchw_applies(p, dtype, ZEN4_AVX512)
    _run_rows_path(shape, "NCHW", threads, dtype, "relu", monkeypatch)


@pytest.mark.parametrize("layout, tasks", [("NCHW", "rows_nchw_tasks"),
                                            ("NHWC", "rows_nhwc_tasks")])
def test_rows_tasks_split_the_output_channels_for_threads(layout, tasks, monkeypatch):
    """Weights larger than the image, all threads: tasks take parts of the output
    channels too (each pixel block would stream all the weights), and still add up."""
    parts = _record_arg(monkeypatch, tasks, 1, field="parts")
    shape = ((2, 64, 5, 4), (200, 3, 3), dict(padding=1))
    with _threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", layout, np.float32, bias=True, activation="relu")
    assert parts and all(n > 1 for n in parts) == (numba.config.NUMBA_NUM_THREADS > 1)


def test_nchw_rows_kernel_takes_the_layers_it_wins():
    """ResNet-18's 3x3 layers (small planes, 64+ channels) take the rows kernel; few
    channels, output channels that leave its tiles emptier, large planes, groups and
    1x1 layers stay on the taps kernel or GEMM."""
    from tilegemm.conv.rows import nchw_applies

    def ok(x, w, stride=1, padding=1, groups=1):
        return nchw_applies(conv_params(x, w, stride, padding, 1, groups, "NCHW"), np.float32,
                            ZEN4_AVX512)

    for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        assert ok((8, c, hw, hw), (c, c, 3, 3))
    assert ok((8, 128, 28, 28), (256, 128, 3, 3), stride=2)
    assert not ok((2, 64, 224, 224), (64, 64, 3, 3))            # a large plane
    assert not ok((8, 128, 28, 28), (96, 128, 3, 3))            # 96 of 128 lanes
    assert not ok((8, 16, 56, 56), (16, 16, 3, 3))              # few channels
    assert not ok((8, 256, 28, 28), (256, 8, 3, 3), groups=32)
    assert not ok((8, 256, 56, 56), (64, 256, 1, 1), padding=0)


@contextlib.contextmanager
def _threads(n):
    """Numba's thread count set to ``n`` (capped by the machine's) for the block."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(saved)


def _family_of(tasks):
    """The driver family (``conv/_tile_<family>.py``) whose module holds task loop ``tasks``."""
    for prefix, family in (("planes", "planes"), ("taps", "taps"), ("rows", "rows"),
                           ("im2col", "im2col"), ("winograd", "winograd")):
        if tasks.startswith(prefix):
            return family
    return "direct"


def _record_arg(monkeypatch, name, index, dtype=np.float32, field=None):
    """Wrap the ``dtype`` task loop ``name`` (in its family's module): each call records
    its argument ``index`` in the list returned (with ``field``, that field of the
    argument, a plan's record)."""
    mod = engine.family_module(_family_of(name), dtype)
    real, seen = getattr(mod, name), []

    def spy(*args):
        seen.append(args[index] if field is None else int(args[index][0][field]))
        return real(*args)

    monkeypatch.setattr(mod, name, spy)
    return seen


@pytest.mark.parametrize("name", ["many_channels", "direct_rows", "two_k_blocks"])
@pytest.mark.parametrize("c_bytes", [1 << 12, 1 << 19])
def test_taps_path_shares_one_image_between_threads(name, c_bytes, monkeypatch):
    """One image, all threads: each takes a part of the image's column blocks."""
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", c_bytes)
    (_, C, H, W), (K, kh, kw), kw_args = TAPS_CASES[name]
    shape = ((1, C, H, W), (K, kh, kw), kw_args)
    with _threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu6")


@pytest.mark.parametrize("c_bytes", [1 << 12, 1 << 19])
def test_taps_path_cuts_a_batch_into_parts(c_bytes, monkeypatch):
    """Several images read in place, all threads: images are cut into parts for balance."""
    from tilegemm.conv import taps as taps_mod
    monkeypatch.setattr(taps_mod, "TAPS_C_BYTES", c_bytes)
    parts = _record_arg(monkeypatch, "taps_tasks", 1, field="parts")
    _, (K, kh, kw), kw_args = TAPS_CASES["many_channels"]
    with _threads(numba.config.NUMBA_NUM_THREADS):
        run_case(((3, 64, 19, 23), (K, kh, kw), kw_args), "im2col", "NCHW", np.float32,
                 bias=True, activation="relu")
    assert parts and all(n > 1 for n in parts) == (numba.config.NUMBA_NUM_THREADS > 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("W", [1, 2, 5, 7, 8, 9, 14, 16, 17, 23, 31, 33])
@pytest.mark.parametrize("kernel, kw_args", [
    ((3, 3), dict(padding=1)),                      # masks left and right
    ((1, 5), dict(padding=(0, 2))),                 # wider masks, no rows above or below
    ((3, 3), dict(padding=2, dilation=2)),
    ((2, 4), dict(padding="same")),                 # asymmetric: more right than left
    ((3, 1), dict(padding=(1, 0))),                 # no masks at all
])
def test_flat_layout_every_panel_phase(dtype, W, kernel, kw_args):
    """Stride 1 with Wo == W: unpadded copy, masked taps, tiles straight into the output.

    The widths put panels at every phase of an image row, whole and partial last
    panels (one vector or wider), and rows narrower than a panel; 10 output
    channels leave a partial row panel.
    """
    from tilegemm.conv import taps as taps_mod
    shape = ((2, 5, 4, W), (10,) + kernel, kw_args)
    p = conv_params(*_shapes(shape), **kw_args)
    assert p.Wo == W and taps_mod.reads_image(p) and taps_mod.serves(p, dtype)
    run_case(shape, "im2col", "NCHW", dtype, bias=True, activation="relu")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("K", [1, 2, 4, 5, 6, 8, 14, 16, 20])
@pytest.mark.parametrize("W", [9, 16])
def test_flat_layout_last_row_panel(dtype, K, W):
    """Output channels leaving 0-5 rows in the last row panel (2 and 4 run short kernels)."""
    shape = ((2, 7, 5, W), (K, 3, 3), dict(padding=1))
    run_case(shape, "im2col", "NCHW", dtype, bias=True, activation="relu6")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W", [(1, 1), (5, 7), (6, 33), (9, 40), (4, 65)])
@pytest.mark.parametrize("kernel, kw_args", [
    ((3, 3), dict(padding=(1, 0))),                 # output narrower than the image
    ((3, 3), dict(padding=(1, 0), stride=(2, 1))),  # rows 2 apart in the padded copy
    ((5, 5), dict(padding=(4, 3), dilation=2)),
    ((1, 3), dict(padding=(0, 2))),                 # output wider than the image
])
def test_depthwise_direct_rows(dtype, H, W, kernel, kw_args):
    """Depthwise direct where the output is not as wide as the image: padded channel
    copy, two output rows per call, odd last row, whole and partial row vectors.
    The others run the rows end to end (see the next tests)."""
    from tilegemm.conv import direct as direct_mod
    shape = ((2, 3, H, W), (3,) + kernel, dict(kw_args, groups=3))
    try:
        p = conv_params((2, 3, H, W), (3, 1) + kernel, **kw_args, groups=3)
    except ValueError:
        pytest.skip("the image is smaller than the dilated kernel")
    assert not direct_mod.flat_applies(p, 1)
    run_case(shape, "direct", "NCHW", dtype, bias=True, activation="relu6")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W", [(1, 1), (1, 3), (3, 1)])
def test_depthwise_direct_images_smaller_than_a_vector(dtype, H, W):
    """Fewer output pixels than a vector holds: the padded channel copy serves them."""
    from tilegemm.conv import direct as direct_mod
    from tilegemm.tuning.peak import lanes_for
    shape = ((2, 3, H, W), (3, 3, 3), dict(padding=1, groups=3))
    args, kw_args = _flat_shape(shape)
    p = conv_params(*args, **kw_args)
    assert not direct_mod.flat_applies(p, 4)          # below a vector of 4 lanes or more
    # The padded channel copy, on any host; then whatever direct picks on this one
    # (128-bit vectors of float64 hold 2 pixels: rows end to end may serve them).
    run_case(shape, "direct", "NCHW", dtype, bias=True, activation="relu6",
             path="direct.nchw_vector")
    assert direct_mod.flat_applies(p, lanes_for(dtype)) == (H * W >= lanes_for(dtype))
    run_case(shape, "direct", "NCHW", dtype, bias=True, activation="relu6")


def _flat_shape(shape):
    """``conv_params`` arguments of a depthwise test shape."""
    (N, C, H, W), (K, kh, kw), kw_args = shape
    return ((N, C, H, W), (K, 1, kh, kw)), kw_args


def _flat_parts(shape, lanes=8):
    """(params, geometry) of the depthwise rows-end-to-end path for ``shape``."""
    from tilegemm.conv import direct as direct_mod
    mod = engine.family_module("direct", np.float32)
    (N, C, H, W), (K, kh, kw), kw_args = shape
    p = conv_params((N, C, H, W), (K, 1, kh, kw), **kw_args)
    return p, direct_mod.flat_geometry(p, lanes, mod.DW_FLAT_VECTORS, mod.DW_FLAT_SHORT,
                                       np.float32)


FLAT_DEPTHWISE = {
    "7x7": ((2, 16, 7, 7), (16, 3, 3), dict(padding=1)),            # a short run, 3 masked
    "28x28": ((1, 8, 28, 28), (8, 3, 3), dict(padding=1)),          # runs of 8, one overlapping
    "4x4": ((3, 4, 4, 4), (4, 3, 3), dict(padding=1)),              # every vector masked
    "rect": ((2, 6, 14, 9), (6, 3, 3), dict(padding=1)),
    "taller": ((1, 5, 12, 10), (5, 3, 3), dict(padding=(3, 1))),    # Ho = H + 4
    "dilated": ((2, 4, 20, 17), (4, 5, 5), dict(padding=4, dilation=2)),
    "column": ((1, 3, 15, 16), (3, 3, 1), dict(padding=(1, 0))),    # no edge to cross
    "row": ((1, 3, 9, 16), (3, 1, 3), dict(padding=(0, 1))),
    "1x1": ((2, 5, 6, 7), (5, 1, 1), dict()),                       # reaches nowhere
    "stride2": ((2, 8, 28, 28), (8, 3, 3), dict(padding=1, stride=2)),   # 4 phase planes
    "stride2_odd": ((1, 4, 13, 13), (4, 3, 3), dict(padding=1, stride=2)),
    "stride21": ((1, 3, 9, 16), (3, 3, 3), dict(padding=1, stride=(2, 1))),
    "stride3": ((2, 3, 12, 12), (3, 3, 3), dict(padding=1, stride=3)),   # scalar split
}
for _shape in FLAT_DEPTHWISE.values():
    _shape[2]["groups"] = _shape[0][1]


@pytest.mark.parametrize("name", sorted(FLAT_DEPTHWISE))
def test_depthwise_flat_geometry_covers_every_output_reading_inside(name):
    """Every output vector is stored by a run (unmasked reads, all inside the channel)
    or by a masked vector, nothing outside the output plane is written, and kernel
    columns that never cross a row's edge load no mask."""
    p, (applies, (Hq, Wq), taps, masks, starts, rows, inner, colmask, blocks,
        shorts) = _flat_parts(FLAT_DEPTHWISE[name])
    assert applies and (Hq, Wq) == (-(-p.H // p.sy), -(-p.W // p.sx)) and Wq == p.Wo
    mod = engine.family_module("direct", np.float32)
    pixels, T = p.Ho * p.Wo, p.kh * p.kw
    # Tap (i, j) reads stride phase (a, b), r rows and c columns from the grid position.
    i, j = np.divmod(np.arange(T), p.kw)
    a, r = np.divmod(i * p.dy - p.top, p.sy)[::-1]
    b, c = np.divmod(j * p.dx - p.left, p.sx)[::-1]
    near = r * Wq + c
    np.testing.assert_array_equal(taps[:T], (a * p.sx + b) * Hq * Wq + near)
    written = np.zeros(pixels + 64, int)
    for run, size in ((blocks, mod.DW_FLAT_VECTORS), (shorts, mod.DW_FLAT_SHORT)):
        for q0 in run:
            written[q0:q0 + 8 * size] += 1
            assert q0 + near.min() >= 0 and q0 + 8 * size - 1 + near.max() < Hq * Wq
    for q in starts:
        written[q:q + 8] += 1
    assert (written[:pixels] >= 1).all() and not written[pixels:].any()
    assert ((inner[T:] < 0) == (c == 0)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(FLAT_DEPTHWISE))
def test_depthwise_flat_matches_the_reference(name, dtype, monkeypatch):
    """Depthwise rows end to end: runs of 8 and 4 vectors, masked vectors at the top and
    bottom, an overlapping last vector, stride-phase planes; bias and relu6; all
    threads."""
    _run_depthwise_path(FLAT_DEPTHWISE[name], "NCHW", dtype, "depthwise_flat_tasks", monkeypatch)


def _run_depthwise_path(shape, layout, dtype, tasks, monkeypatch):
    """``run_case`` of a depthwise ``shape`` (bias, relu6) on all threads, checking that
    the float32 conv module's task loop ``tasks`` ran it."""
    calls = _record_arg(monkeypatch, tasks, 1) if dtype == np.float32 else None
    with _threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "direct", layout, dtype, bias=True, activation="relu6")
    if calls is not None:
        assert calls                                  # the path was taken


def test_depthwise_flat_from_several_python_threads():
    """Python threads at once, stride 1 (read in place) and stride 2 (each thread's own
    phase copy), on all of Numba's threads."""
    x = RNG.standard_normal((2, 16, 20, 20)).astype(np.float32)
    w = RNG.standard_normal((16, 1, 3, 3)).astype(np.float32)
    expected = {s: reference_conv(x, w, padding=1, stride=s, groups=16) for s in (1, 2)}

    def work(i):
        for rep in range(4):
            s = 1 + (i + rep) % 2
            got = tilegemm.conv2d(x, w, padding=1, stride=s, groups=16, algorithm="direct")
            np.testing.assert_allclose(got, expected[s], rtol=1e-5, atol=1e-5)

    with _threads(numba.config.NUMBA_NUM_THREADS):
        _in_threads(work, 4)


# Channels in vectors of this machine's float32 kernels (8 lanes with AVX2, 16 with AVX-512).
_L = engine.gemm_kernel(np.float32)[0].lanes
NHWC_DEPTHWISE = {
    "narrow": ((2, 2 * _L, 9, 11), (1, 3, 3), dict(padding=1)),       # 2 vectors x 4 pixels
    "narrow_overlap": ((1, 3 * _L, 7, 7), (1, 3, 3), dict(padding=1)),
    "wide": ((2, 8 * _L, 10, 10), (1, 3, 3), dict(padding=1)),        # 8 vectors, one pixel
    "wide_overlap": ((1, 9 * _L, 6, 9), (1, 3, 3), dict(padding=1)),
    "stride2": ((2, 8 * _L, 13, 14), (1, 3, 3), dict(padding=1, stride=2)),
    "dilated": ((1, 2 * _L, 12, 12), (1, 5, 5), dict(padding=4, dilation=2)),
    "no_interior": ((1, 2 * _L, 2, 3), (1, 3, 3), dict(padding=2)),   # every column an edge
    "one_pixel": ((2, 8 * _L, 1, 1), (1, 3, 3), dict(padding=1)),
    "valid": ((1, 4 * _L, 8, 9), (1, 3, 1), dict(padding=0, stride=(1, 2))),
}
for _name, ((_n, _c, _h, _w), (_, _kh, _kw), _args) in NHWC_DEPTHWISE.items():
    NHWC_DEPTHWISE[_name] = ((_n, _c, _h, _w), (_c, _kh, _kw), dict(_args, groups=_c))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(NHWC_DEPTHWISE))
def test_depthwise_nhwc_matches_the_reference(name, dtype, monkeypatch):
    """Depthwise NHWC, lanes over the channels: whole and overlapping channel blocks,
    pixel groups and single edge pixels over their taps inside the image; bias and
    relu6; all threads."""
    _run_depthwise_path(NHWC_DEPTHWISE[name], "NHWC", dtype, "depthwise_nhwc_tasks", monkeypatch)


def test_depthwise_flat_padding_times_an_infinite_weight_is_nan():
    """Zero padding times an infinite weight is NaN, as in a zero-padded convolution:
    only outputs whose window reaches the padding (or a NaN pixel) become NaN."""
    x = RNG.standard_normal((1, 2, 9, 9)).astype(np.float32)
    x[0, 1, 4, 4] = np.nan
    w = RNG.standard_normal((2, 1, 3, 3)).astype(np.float32)
    w[0, 0, 0, 1] = np.inf                        # reads the row above: the top row's padding
    expected = reference_conv(x, w, padding=1, groups=2)
    got = tilegemm.conv2d(x, w, padding=1, groups=2, algorithm="direct")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(got[0, 0, 0]).all() and not np.isnan(got[0, 0, 1:]).any()
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_taps_kc_counts_the_rows_each_channel_reads():
    from tilegemm.conv import taps as taps_mod
    s1 = conv_params((8, 64, 56, 56), (64, 64, 3, 3), padding=1)
    s2 = conv_params((8, 64, 56, 56), (128, 64, 3, 3), stride=2, padding=1)
    # 6x16 float32 tile, 32 KiB L1d, half of it per block.  Stride 1: 3 rows of 18
    # values (+ a line) and 6*9 weights = 624 bytes a channel, 26 -> 3 blocks of 22.
    assert taps_mod.taps_kc(s1, 6, 16, 4, 32768) == 22
    # Stride 2: six rows of 17 values in the phase planes = 1008 bytes, 16 channels.
    assert taps_mod.taps_kc(s2, 6, 16, 4, 32768) == 16
    # Channels a whole number of pages apart fall on the same L1 sets: 8 ways, 8
    # channels (VGG-16 conv1_2); 200x200 channels are 160000 bytes apart, their rows
    # on 16 set positions, so the L1 budget decides.
    vgg = conv_params((1, 64, 224, 224), (64, 64, 3, 3), padding=1)
    assert taps_mod.taps_kc(vgg, 6, 16, 4, 32768) == 8
    assert taps_mod.taps_kc(vgg, 6, 16, 4, 49152) == 11   # 12 ways: 6 blocks of <= 11
    wide = conv_params((1, 64, 200, 200), (64, 64, 3, 3), padding=1)
    assert taps_mod.taps_kc(wide, 6, 16, 4, 32768) == 22
    # 7x7: 2240 bytes a channel would give 7; never below 8.
    big = conv_params((1, 100, 9, 9), (4, 100, 7, 7), padding=3)
    assert taps_mod.taps_kc(big, 6, 16, 4, 32768) == 8


@pytest.mark.parametrize("N, H, W", [(2, 32, 32), (3, 16, 32), (2, 16, 64)])
@pytest.mark.parametrize("K", [13, 64])
def test_im2col_output_channels_a_page_apart(N, H, W, K):
    """Output channels a whole number of 2 or 4 KiB apart: a tile's rows would share L1
    sets, so C goes through a buffer and is copied out (bias, relu6, partial row
    panels)."""
    from tilegemm.conv import taps as taps_mod
    assert taps_mod.aliasing(H * W * 4, 6)
    x = RNG.standard_normal((N, 64, H, W)).astype(np.float32)
    w = RNG.standard_normal((K, 64, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_aliasing_counts_rows_on_the_same_sets():
    from tilegemm.conv import taps as taps_mod
    from tilegemm.tuning.machine import l1_alias_period
    assert l1_alias_period(224 * 224 * 4) == 1                     # 49 pages apart
    assert l1_alias_period(112 * 112 * 4) == 4                     # 12.25 pages
    assert l1_alias_period(56 * 56 * 4) == 16
    assert taps_mod.aliasing(224 * 224 * 4, 6)                  # six rows on one set
    assert not taps_mod.aliasing(112 * 112 * 4, 6)             # two per set
    assert not taps_mod.aliasing(56 * 56 * 4, 6)


def test_panel_masks_mark_what_lies_outside_the_image():
    from tilegemm.conv import taps as taps_mod
    p = conv_params((1, 2, 3, 5), (4, 2, 3, 3), padding=1)      # grid: 3 rows of 5
    masks, sched = taps_mod.panel_masks(p, 8, np.float32, group=False)
    assert masks.dtype == np.int32 and sched.shape == (2, 9 + 2)
    assert (sched[:, 9] == 0).all()                               # no masked sum

    # Taps column by column: tap j*3 + i is kernel row i, column j.
    def lanes(panel, tap):
        at = sched[panel, tap]
        return [1] * 8 if at < 0 else list(masks[at:at + 8] != 0)

    # Panel 0: grid columns 0-7 = row 0 (columns 0-4), row 1 (columns 0-2).
    assert lanes(0, 4) == [1] * 8                                 # centre tap
    assert lanes(0, 1) == [0, 1, 1, 1, 1, 0, 1, 1]               # reads column - 1
    assert lanes(0, 7) == [1, 1, 1, 1, 0, 1, 1, 1]               # reads column + 1
    assert lanes(0, 3) == [0, 0, 0, 0, 0, 1, 1, 1]               # reads the row above
    # Panel 1: grid columns 8-15 = row 1 (3, 4), row 2 (0-4), then past the grid.
    assert lanes(1, 4) == [1, 1, 1, 1, 1, 1, 1, 0]
    assert lanes(1, 5) == [1, 1, 0, 0, 0, 0, 0, 0]               # reads the row below
    # Patterns are stored once each.
    assert len({tuple(masks[i:i + 8]) for i in range(0, masks.size, 8)}) == masks.size // 8


def test_panel_masks_mask_the_sum_of_the_left_column_where_its_reads_stay_inside():
    from tilegemm.conv import taps as taps_mod
    p = conv_params((1, 2, 6, 5), (4, 2, 3, 3), padding=1)      # grid: 6 rows of 5
    masks, sched = taps_mod.panel_masks(p, 8, np.float32)
    _, loads = taps_mod.panel_masks(p, 8, np.float32, group=False)
    # Panel 0 holds row 0, whose row above lies outside the image: no masked sum.
    # Panel 1 (rows 1-3, row starts at grid columns 10 and 15): taps 0-2 (column - 1)
    # wrap only into rows 0-4, share one pattern, and are summed then masked once.
    assert sched[0, 9] == 0 and (sched[0, :9] == loads[0, :9]).all()
    assert sched[1, 9] == 3
    assert (sched[1, :3] == -1).all() and (sched[1, 3:9] == loads[1, 3:9]).all()
    assert list(masks[sched[1, 10]:sched[1, 10] + 8] != 0) == [1, 1, 0, 1, 1, 1, 1, 0]
    assert (sched[1, 10] == loads[1, :3]).all()


@pytest.mark.parametrize("H, W", [(9, 13), (7, 7), (14, 14), (5, 3)])
@pytest.mark.parametrize("column", [0, -1])
def test_wrapped_reads_never_reach_the_output(H, W, column):
    """Inf and NaN in an image's first (last) column: in the stride-1 layout the taps
    left (right) of the other end of the neighbouring rows read them through the row's
    edge, and those outputs must stay finite."""
    x = RNG.standard_normal((2, 64, H, W)).astype(np.float32)
    x[:, ::3, :, column] = np.inf
    x[:, 1::3, 1:, column] = np.nan
    x[:, 2::3, ::2, column] = -np.inf
    w = RNG.standard_normal((8, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, padding=1)
    got = tilegemm.conv2d(x, w, padding=1, algorithm="im2col")
    assert np.isfinite(expected[:, :, :, -1 - column]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("N, H, W", [(2, 7, 7), (3, 9, 13), (5, 14, 14), (2, 3, 5), (4, 1, 17),
                                     (1, 7, 9), (20, 3, 5)])
@pytest.mark.parametrize("C, K", [(64, 13), (80, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_im2col_batched_tails(N, H, W, C, K, threads):
    """The grid columns after each image's last whole panel, run as GEMMs over the
    batch: partial row panels, several channel blocks, bias and activation fused on
    the last, grids shorter than a panel, several GEMMs (20 images of 15 columns),
    one thread or two."""
    import numba
    x = RNG.standard_normal((N, C, H, W)).astype(np.float32)
    w = RNG.standard_normal((K, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, kw_args", [
    ((2, 64, 56, 56), dict(stride=2, padding=1)),
    ((3, 64, 23, 19), dict(stride=2, padding=1)),
    ((2, 64, 24, 20), dict(stride=2, padding=2, dilation=2)),
    ((2, 64, 21, 21), dict(stride=3, padding=1)),
    ((2, 64, 16, 16), dict(stride=(2, 1), padding=1)),
    ((2, 64, 16, 17), dict(stride=(1, 2), padding=1)),
    ((1, 64, 2, 2), dict(stride=2, padding=1)),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_im2col_unpadded_phase_copy(shape, kw_args, threads, monkeypatch):
    """Strided layers whose phase planes are as wide as the output: an unpadded copy read
    through load masks and masked sums, tiles stored straight into the output."""
    import numba
    from tilegemm.conv import taps as taps_mod
    K = 13
    p = conv_params(shape, (K, shape[1], 3, 3), **kw_args)
    assert taps_mod.layout_of(p) == taps_mod.PHASED and taps_mod.serves(p)
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal((K, shape[1], 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, activation="relu6", **kw_args)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = tilegemm.conv2d(x, w, b, activation="relu6", _path="im2col.taps", **kw_args)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("column", [0, 1, -1, -2])
def test_wrapped_reads_never_reach_the_output_of_a_strided_layer(column):
    """Inf and NaN in one image column of a stride-2 layer: the unpadded phase planes'
    masked sums read neighbouring rows' values, which must not reach the output."""
    x = RNG.standard_normal((2, 64, 14, 18)).astype(np.float32)
    x[:, ::2, :, column] = np.inf
    x[:, 1::2, 1:, column] = np.nan
    w = RNG.standard_normal((8, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, stride=2, padding=1)
    got = tilegemm.conv2d(x, w, stride=2, padding=1, algorithm="im2col")
    assert np.isfinite(expected).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", [np.inf, np.nan])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_non_finite_weight_meets_the_padding_as_zero_padding_does(value, layout):
    """Inf or NaN times zero padding is NaN, as with an explicitly padded input."""
    x = RNG.standard_normal((1, 64, 9, 11)).astype(np.float32)
    w = RNG.standard_normal((6, 64, 3, 3)).astype(np.float32)
    w[2, 5, 1, 0] = value                      # column - 1: reads the padding at column 0
    expected = reference_conv(x, w, padding=1)
    if layout == "NCHW":
        got = tilegemm.conv2d(x, w, padding=1, algorithm="im2col")
    else:
        got = tilegemm.conv2d(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), w, padding=1,
                              algorithm="im2col", layout="NHWC").transpose(0, 3, 1, 2)
    assert np.isnan(expected[0, 2, :, 0]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


def test_conv_plan_rejects_malformed_shapes_and_threads():
    """Shapes must be tuples of non-negative ints and threads a positive int."""
    good_w = (4, 4, 3, 3)
    for shape, error in [((1, 4, 9.5, 9), TypeError), ((-1, 4, 9, 9), ValueError),
                         ("abcd", TypeError), (5, TypeError)]:
        with pytest.raises(error, match="input shape"):
            tilegemm.conv_plan(shape, good_w)
    for threads, error in [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="threads"):
            tilegemm.conv_plan((1, 4, 9, 9), good_w, threads=threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, W, sy, sx, py, px", [
    (5, 7, 1, 1, 1, 1), (6, 37, 1, 2, 1, 1), (9, 40, 2, 2, 1, 0), (4, 3, 2, 2, 2, 3),
    (7, 19, 3, 3, 1, 1), (3, 70, 1, 2, 0, 5), (6, 56, 2, 2, 0, 0), (5, 33, 2, 2, 0, 0),
    (4, 18, 2, 2, 1, 1), (3, 10, 2, 2, 0, 0)])
@pytest.mark.parametrize("spill", [False, True])
def test_phase_split_matches_numpy(dtype, H, W, sy, sx, py, px, spill):
    """The stride-split padded copy, vector rows (stride 1 and 2, whole vectors, the
    last one overlapped or masked) and scalar (3) alike; with ``spill`` nothing is
    written past a vector after the last channel."""
    mod = engine.family_module("shared", dtype)
    C = 3
    x = np.random.default_rng(H * W).standard_normal((C, H, W)).astype(dtype)
    Hq, Wq = -(-(H + 2 * py) // sy), -(-(W + 2 * px) // sx)
    chan = sy * sx * Hq * Wq
    slack = mod.LANES if spill else 0
    xq = np.full(C * chan + slack + 5, 9.0, dtype)
    mod.phase_split(x.reshape(-1), 0, H * W, W, C, H, W, sy, sx, py, px, Hq, Wq, chan, xq,
                    spill)
    padded = np.zeros((C, Hq * sy, Wq * sx), dtype)
    padded[:, py:py + H, px:px + W] = x
    for a in range(sy):
        for b in range(sx):
            got = xq[:C * chan].reshape(C, sy * sx, Hq, Wq)[:, a * sx + b]
            np.testing.assert_array_equal(got, padded[:, a::sy, b::sx], err_msg=f"phase ({a}, {b})")
    assert np.all(xq[C * chan + slack:] == 9.0), "phase_split wrote past its channels"


def _guarded(shape, dtype):
    """An array filling whole pages, between two pages that fault on any access."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert nbytes % page == 0
    buf = mmap.mmap(-1, nbytes + 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    arr = np.frombuffer(buf, dtype, count=int(np.prod(shape)), offset=page).reshape(shape)
    for at in (addr, addr + page + nbytes):
        if libc.mprotect(at, page, 0) != 0:
            pytest.skip("mprotect is not available")
    return arr, buf


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages via mprotect")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_im2col_batch_reads_stay_inside_the_input(dtype):
    """im2col over a batch with a partial last panel per image: the left column's
    unmasked loads (masked sum), the batched tails' packing, the masked loads and the
    stride-split copies all stay inside the images (a fault would crash)."""
    C = 2048 // np.dtype(dtype).itemsize                    # 2*C*9*13 values fill pages
    shape = (2, C, 9, 13)
    x, buf = _guarded(shape, dtype)
    x[...] = np.random.default_rng(0).standard_normal(shape)
    w = np.random.default_rng(1).standard_normal((7, C, 3, 3)).astype(dtype)
    for stride, padding in ((1, 1), (1, (2, 1)), (1, "same"), (2, 1), ((1, 2), 1)):
        got = tilegemm.conv2d(x, w, stride=stride, padding=padding, algorithm="im2col")
        pad = 1 if padding == "same" else padding
        want = reference_conv(x.astype(np.float64), w.astype(np.float64), stride=stride,
                              padding=pad)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages via mprotect")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("algorithm", ["im2col", "winograd", "direct"])
def test_reads_stay_inside_the_input(dtype, layout, algorithm):
    """Masked and edge loads never touch memory outside the image (a fault would crash).

    The image fills whole pages with unreadable pages on both sides; padding 1
    makes the stride-1 im2col read rows above and below and columns to the side
    through load masks.
    """
    C = 4096 // (16 * 16 * np.dtype(dtype).itemsize)
    shape = (1, C, 16, 16) if layout == "NCHW" else (1, 16, 16, C)
    x, buf = _guarded(shape, dtype)
    x[...] = np.random.default_rng(0).standard_normal(shape)
    w = np.random.default_rng(1).standard_normal((5, C, 3, 3)).astype(dtype)
    xr = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)
    for padding in (0, 1, 2):
        got = tilegemm.conv2d(x, w, padding=padding, algorithm=algorithm, layout=layout)
        if layout == "NHWC":
            got = got.transpose(0, 3, 1, 2)
        want = reference_conv(xr.astype(np.float64), w.astype(np.float64), padding=padding)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("K", [8, 10, 14, 16, 9, 11])
@pytest.mark.parametrize("N", [1, 2])
def test_taps_path_last_row_panel(K, N):
    """Output channels leaving 2 or 4 rows of a 6-row tile (8, 10, 14, 16) take the short
    kernels straight into the output, others (9, 11) the C buffer; with a partial last
    column panel (13x13 grid: 169 columns) for one image, batched tails for two."""
    C, H = 64, 13
    x = RNG.standard_normal((N, C, H, H)).astype(np.float32)
    w = RNG.standard_normal((K, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(K).astype(np.float32)
    expected = reference_conv(x, w, b, padding=1, activation="relu6")
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu6", algorithm="im2col")
    assert np.abs(got - expected).max() <= _tolerance(x, w, np.float32)


@pytest.mark.parametrize("shape", [((3, 32, 24, 24), (20, 1, 1), {}),
                                   ((2, 16, 23, 23), (10, 3, 3), dict(padding=1))])
def test_im2col_packing_path_cuts_pixel_blocks_for_threads(shape, monkeypatch):
    """All threads: the packing path's images are cut into several pixel blocks."""
    blocks = _record_arg(monkeypatch, "im2col_nchw_tasks", 1, field="n_jc")
    with _threads(numba.config.NUMBA_NUM_THREADS):
        run_case(shape, "im2col", "NCHW", np.float32, bias=True, activation="relu",
                 path="im2col.packed")
    assert blocks and all(n > 1 for n in blocks) == (numba.config.NUMBA_NUM_THREADS > 1)


# NCHW layers the taps path serves, through the packing path instead (the one for
# stride-split copies over SHIFTED_MAX_BYTES).
PACKED = [name for name, (_, (_, kh, kw), kw_args) in CASES.items()
          if (kh, kw, kw_args.get("stride", 1)) != (1, 1, 1)]


@pytest.mark.parametrize("name", PACKED)
def test_im2col_packing_path(name, monkeypatch):
    calls = _record_arg(monkeypatch, "im2col_nchw_tasks", 1)
    run_case(CASES[name], "im2col", "NCHW", np.float32, bias=True, activation="relu",
             path="im2col.packed")
    assert calls


@pytest.mark.parametrize("algorithm", ["im2col", "winograd", "direct", "auto"])
@pytest.mark.parametrize("C", [8, 64])
def test_conv_weights_match_plain_weights(algorithm, C):
    """ConvWeights gives exactly what the plain array gives, call after call."""
    x = RNG.standard_normal((2, C, 9, 11)).astype(np.float32)
    w = RNG.standard_normal((10, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(10).astype(np.float32)
    cw = tilegemm.ConvWeights(w)
    assert cw.shape == w.shape and cw.dtype == w.dtype
    expected = tilegemm.conv2d(x, w, b, padding=1, activation="relu", algorithm=algorithm)
    for _ in range(2):
        got = tilegemm.conv2d(x, cw, b, padding=1, activation="relu", algorithm=algorithm)
        np.testing.assert_array_equal(got, expected)


def test_conv_weights_hold_their_own_copy():
    x = RNG.standard_normal((1, 64, 8, 8)).astype(np.float32)
    w = RNG.standard_normal((6, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, padding=1)
    cw = tilegemm.ConvWeights(w)
    w += 1.0                                                  # after preparing: no effect
    for algorithm in ("im2col", "winograd", "direct"):
        got = tilegemm.conv2d(x, cw, padding=1, algorithm=algorithm)
        assert np.abs(got - expected).max() <= _tolerance(x, w, np.float32)


def test_conv_weights_are_never_compared_nor_evicted(monkeypatch):
    """Built once per object and algorithm, kept however many objects there are, and
    never compared with anything (a plain array is, on every call)."""
    builds, compares = [], []
    real_prepared, real_same = engine.prepared, engine.same_contents

    def counted_prepared(kind, weight, params, build):
        return real_prepared(kind, weight, params, lambda w: (builds.append(kind), build(w))[1])

    monkeypatch.setattr(engine, "prepared", counted_prepared)
    monkeypatch.setattr(engine, "same_contents",
                        lambda *a: (compares.append(1), real_same(*a))[1])
    x = RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)
    layers = [tilegemm.ConvWeights(RNG.standard_normal((4, 4, 3, 3)).astype(np.float32))
              for _ in range(engine.PREPARED_MAX + 8)]
    for _ in range(2):
        for cw in layers:
            tilegemm.conv2d(x, cw, padding=1, algorithm="winograd")
    assert len(builds) == len(layers)
    assert not compares
    plain = RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)
    for _ in range(2):
        tilegemm.conv2d(x, plain, padding=1, algorithm="winograd")
    assert len(builds) == len(layers) + 1 and len(compares) == 1


def test_conv_weights_bad_input():
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.ConvWeights(np.ones((2, 2, 3, 3), np.int32))
    with pytest.raises(ValueError, match="4-D"):
        tilegemm.ConvWeights(np.ones((3, 3), np.float32))
    cw = tilegemm.ConvWeights(np.ones((2, 3, 3, 3), np.float32))
    with pytest.raises(ValueError, match="channel"):
        tilegemm.conv2d(np.ones((1, 4, 5, 5), np.float32), cw)


def test_conv_weights_shared_by_python_threads():
    x = RNG.standard_normal((2, 64, 10, 10)).astype(np.float32)
    w = RNG.standard_normal((12, 64, 3, 3)).astype(np.float32)
    cw = tilegemm.ConvWeights(w)
    expected = reference_conv(x, w, padding=1)

    def work(i):
        algorithm = ("im2col", "winograd", "direct")[i % 3]
        for _ in range(3):
            got = tilegemm.conv2d(x, cw, padding=1, algorithm=algorithm)
            assert np.abs(got - expected).max() <= _tolerance(x, w, np.float32)

    _in_threads(work, 6)


def _winograd(x, w, b, layout, activation, blocking):
    """``winograd.run`` with a given blocking (``conv2d`` runs the planned one)."""
    from tilegemm.conv import winograd
    from tilegemm.ground.contracts import EPI_RELU6
    p = conv_params(x.shape, w.shape, padding=1, layout=layout)
    out = np.empty(p.output_shape(), x.dtype)
    act = EPI_RELU6 if activation == "relu6" else 0
    return winograd.run(x, w, b, out, p, act, blocking)


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
    with _threads(threads):
        got = _winograd(x, w, b, "NHWC", None, block)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_winograd_nhwc_tiles_floor():
    """NHWC blocks: a few per thread, never below one row panel, nor below
    ``NHWC_STREAM_TILES`` once the transformed weights take over a quarter of L3."""
    from tilegemm.conv import winograd
    MR, l2 = 6, 2 << 20
    assert winograd.nhwc_tiles(24, 24, 24, MR, 90, 2, 4, l2) == 12
    assert winograd.nhwc_tiles(24, 24, 24, MR, 6, 2, 4, l2) == MR
    big = 16 * 512 * 512 * 4           # bytes of the transformed weights, 512 x 512
    stream = -(-winograd.NHWC_STREAM_TILES // MR) * MR
    assert winograd.stream_floor(512, 512, MR, 4, 4 * big - 1) == stream
    assert winograd.stream_floor(512, 512, MR, 4, 4 * big) == MR
    assert winograd.nhwc_tiles(512, 512, 256, MR, 90, 2, 4, 1 << 30, 4 * big - 1) == stream


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("plan", [(3, 1), (0, 2), (2, 2), (1, 3), (0, 8)])
def test_winograd_nchw_blocks_split_by_output_channels(dtype, threads, plan):
    """NCHW Winograd with any blocks split into parts of the output channels (whole
    blocks first, then parts; 8 parts of 4 row panels leave some empty): 189 tiles in
    3 blocks, 20 channels (a partial row panel), bias and relu6, give the reference."""
    nr = engine.gemm_kernel(dtype)[0].nr
    tiles = 3 * nr - 3                                  # the last block is partial
    x = RNG.standard_normal((1, 16, 2 * 3, 2 * tiles // 3)).astype(dtype)
    w = RNG.standard_normal((20, 16, 3, 3)).astype(dtype)
    b = RNG.standard_normal(20).astype(dtype)
    want = reference_conv(x, w, b, padding=1, activation="relu6")
    with _threads(threads):
        got = _winograd(x, w, b, "NCHW", "relu6", (nr,) + plan)   # NR tiles a block
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


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
    groups = _record_arg(monkeypatch, "winograd_nchw_tasks", 1, dtype, field="groups")
    with _threads(threads):
        run_case(shape, "winograd", "NCHW", dtype, bias=True, activation="relu6")
        run_case(shape, "winograd", "NCHW", dtype, bias=False)
    assert groups and set(groups) == {shape[2]["groups"]}


# --- reproducers of reported defects ---------------------------------------------------

@pytest.mark.parametrize("path", [None, "im2col.planes", "direct.nhwc"])
@pytest.mark.parametrize("kernel, padding", [((3, 1), 0),        # Ho = 6 < H = 8
                                             ((3, 3), (2, 1)),   # Ho = 10 > H = 8
                                             ((5, 3), (1, 1))])  # Ho = 6, padded
def test_nhwc_grouped_output_taller_or_shorter_than_the_input(kernel, padding, path):
    """Stride 1, an output as wide as the input but of another height: the planes path
    once iterated over the input's pixels, writing past the output (Ho < H) or leaving
    rows unwritten (Ho > H).  The output sits between canaries."""
    x = RNG.standard_normal((2, 8, 8, 4)).astype(np.float32)
    w = RNG.standard_normal((4, 2) + kernel).astype(np.float32)
    expected = reference_conv(x.transpose(0, 3, 1, 2), w, padding=padding, groups=2)
    shape = (2,) + expected.shape[2:] + (4,)
    out, check = _canaried(shape)
    got = tilegemm.conv2d(x, w, padding=padding, groups=2, layout="NHWC", _path=path,
                          _out=out)
    check()
    assert got is out
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2), expected, rtol=1e-5, atol=1e-5)
    if path is None:                   # and auto / im2col route there by themselves
        got = tilegemm.conv2d(x, w, padding=padding, groups=2, layout="NHWC", algorithm="im2col")
        np.testing.assert_allclose(got.transpose(0, 3, 1, 2), expected, rtol=1e-5, atol=1e-5)


def _canaried(shape, dtype=np.float32, pad=64):
    """(array, check): a C-contiguous array between ``pad`` NaN-payload canaries on each
    side; ``check()`` fails if a canary changed (an out-of-bounds write)."""
    size = int(np.prod(shape))
    buf = np.full(size + 2 * pad, 0x7FC0DEAD if dtype == np.float32 else 0x7FF8DEADBEEF,
                  np.uint32 if dtype == np.float32 else np.uint64)
    before = buf.copy()
    arr = buf[pad:pad + size].view(dtype).reshape(shape)

    def check():
        assert np.array_equal(buf[:pad], before[:pad]), "write before the array"
        assert np.array_equal(buf[pad + size:], before[pad + size:]), "write past the array"

    return arr, check


@pytest.mark.parametrize("algorithm", ["direct", "auto"])
@pytest.mark.parametrize("kernel, stride", [((1, 1), 1), ((2, 2), 2), ((3, 3), 1)])
def test_depthwise_nchw_with_every_vector_interior(kernel, stride, algorithm):
    """Depthwise NCHW rows end to end, where no output vector needs a load mask (every
    read inside the plane, Ho*Wo a multiple of the lanes): it raised ValueError."""
    x = RNG.standard_normal((1, 8, 16, 16)).astype(np.float32)
    w = RNG.standard_normal((8, 1) + kernel).astype(np.float32)
    pad = (kernel[0] - 1) // 2 if stride == 1 else 0
    got = tilegemm.conv2d(x, w, stride=stride, padding=pad, groups=8, algorithm=algorithm)
    expected = reference_conv(x, w, stride=stride, padding=pad, groups=8)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_prepared_weights_describe_what_was_built():
    """A weight written while its prepared form is built (by another thread) must not
    poison the cache: the copy kept for comparison is the one built from, so the next
    call sees the change and rebuilds."""
    w = np.ones((4, 4, 3, 3), np.float32)

    def build(snapshot):
        w[...] = 2.0                   # the racing write, in the middle of the build
        return float(snapshot.sum())

    assert engine.prepared("test_race", w, (), build) == 4 * 4 * 9
    assert engine.prepared("test_race", w, (), lambda s: float(s.sum())) == 2 * 4 * 4 * 9


@pytest.mark.parametrize("algorithm", ["winograd", "im2col"])
def test_weights_raced_in_place_leave_later_calls_right(algorithm):
    """One thread flips a plain weight array between two values in place while another
    convolves with it; once the writes stop, every later call gives the reference of
    the weights the array then holds."""
    x = RNG.standard_normal((1, 16, 10, 10)).astype(np.float32)
    w0 = RNG.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w1 = RNG.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w = w0.copy()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            w[...] = (w0, w1)[i % 2]
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            tilegemm.conv2d(x, w, padding=1, algorithm=algorithm)   # result undefined
    finally:
        stop.set()
        t.join()
    for final in (w0, w1, w0):
        w[...] = final
        expected = reference_conv(x, final, padding=1)
        for _ in range(3):
            got = tilegemm.conv2d(x, w, padding=1, algorithm=algorithm)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _pack_taps_by_loops(w, groups, KC, MR):
    """The taps kernel's packed weights written out loop by loop (the layout of
    ``taps.pack_weights``' docstring): the reference for its array copies."""
    K, Cg, kh, kw = w.shape
    T, Kg = kh * kw, K // groups
    Mp = round_up(Kg, MR)
    a_group = T * Cg * Mp + 1
    buf = np.zeros(groups * a_group, w.dtype)
    for g in range(groups):
        for pc in range(0, Cg, KC):
            kc = min(KC, Cg - pc)
            for ir in range(0, Mp, MR):
                for t in range(T):
                    i, j = t % kh, t // kh             # column by column
                    for k in range(kc):
                        for r in range(MR):
                            if ir + r < Kg:
                                at = (g * a_group + pc * Mp * T + ir * kc * T + t * MR * kc
                                      + k * MR + r)
                                buf[at] = w[g * Kg + ir + r, pc + k, i, j]
    return buf, Mp


def _pack_rows_by_loops(w, groups, KC, NR):
    """``rows.pack_weights``' layout written out loop by loop."""
    K, Cg, kh, kw = w.shape
    T, Kg = kh * kw, K // groups
    Np = round_up(Kg, NR)
    buf = np.zeros(groups * Cg * T * Np + 1, w.dtype)
    for g in range(groups):
        for pc in range(0, Cg, KC):
            kc = min(KC, Cg - pc)
            for jr in range(0, Np, NR):
                for t in range(T):
                    for k in range(kc):
                        for c in range(NR):
                            if jr + c < Kg:
                                at = ((g * Cg + pc) * T * Np + jr * T * kc + t * kc * NR
                                      + k * NR + c)
                                buf[at] = w[g * Kg + jr + c, pc + k, t // kw, t % kw]
    return buf, Np


@pytest.mark.parametrize("K, Cg, kh, kw, groups, KC, tile", [
    (8, 1, 3, 3, 8, 4, 6), (12, 5, 2, 3, 3, 2, 4), (64, 1, 7, 7, 64, 8, 16),
    (6, 7, 1, 4, 2, 3, 8), (32, 16, 3, 3, 2, 5, 6)])
def test_weight_packers_match_their_layouts(K, Cg, kh, kw, groups, KC, tile):
    """The taps and rows weight packers (array copies over all groups at once, where a
    Python loop per group and tap made depthwise layers 50x slower) against their
    layouts written out element by element."""
    from tilegemm.conv import rows as rows_mod
    from tilegemm.conv import taps as taps_mod
    w = RNG.standard_normal((K, Cg, kh, kw)).astype(np.float32)
    buf, Mp = taps_mod.pack_weights(w, groups, KC, tile)
    ref, Mp_ref = _pack_taps_by_loops(w, groups, KC, tile)
    assert Mp == Mp_ref and np.array_equal(buf, ref)
    p = conv_params((1, Cg * groups, kh + 2, kw + 2), w.shape, groups=groups)
    buf, Np = rows_mod.pack_weights(w, p, KC, tile)
    ref, Np_ref = _pack_rows_by_loops(w, groups, KC, tile)
    assert Np == Np_ref and np.array_equal(buf, ref)
