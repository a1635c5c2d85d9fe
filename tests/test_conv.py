"""conv2d as a caller sees it: every algorithm against a float64 reference on real and
odd layers, dtypes, NaN/Inf, errors, plans, threads, torch, reads and writes in bounds."""
import sys

import numba
import numpy as np
import pytest

import tilegemm
from conv_cases import (CASES, RNG, ZEN4_AVX512, algorithms_for, guarded_pages,
                        run_case, shapes_of)
from reference import reference_conv
from thread_runs import in_threads
from tilegemm.conv import engine
from tilegemm.conv.params import conv_params


PARAMS = []


for _i, (_name, _shape) in enumerate(CASES.items()):
    for _alg in algorithms_for(_shape):
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
    for alg in algorithms_for(CASES[name]):
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
        # The transforms mix an (m+2)x(m+2) input tile, so a NaN or Inf poisons (with NaN
        # or Inf) every output of the m x m tiles whose windows hold it (up to 4 tiles
        # per pixel, all 5 channels): non-finite where the reference is, never finite
        # and wrong elsewhere.
        m = tilegemm.conv_plan(xin.shape, w.shape, padding=1, layout=layout).winograd_tile
        assert not np.isfinite(got[~np.isfinite(expected)]).any()
        finite = np.isfinite(got)
        assert finite.sum() >= np.isfinite(expected).sum() - 2 * 4 * m * m * 5
    else:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
        finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


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


def test_concurrent_python_threads():
    x = RNG.standard_normal((4, 16, 20, 20)).astype(np.float32)
    ws = [RNG.standard_normal((32, 16, 3, 3)).astype(np.float32) for _ in range(3)]
    expected = [reference_conv(x, w, padding=1) for w in ws]

    def work(i):
        for rep in range(3):
            alg = ("im2col", "winograd", "direct")[(i + rep) % 3]
            got = tilegemm.conv2d(x, ws[i], padding=1, algorithm=alg)
            np.testing.assert_allclose(got, expected[i], rtol=1e-4, atol=1e-3)

    in_threads(work, 3)


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

    in_threads(work, 4)


# --- torch cross-check ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet18_conv2", "resnet50_1x1", "mobilenet_dw_s2", "same",
                                  "dilation", "groups"])
def test_matches_torch(name):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    shape = CASES[name]
    xs, ws = shapes_of(shape)
    x = RNG.standard_normal(xs).astype(np.float32)
    w = RNG.standard_normal(ws).astype(np.float32)
    b = RNG.standard_normal(ws[0]).astype(np.float32)
    kw = shape[2]
    expected = F.relu(F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                               **kw)).numpy()
    got = tilegemm.conv2d(x, w, b, activation="relu", **kw)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


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
    x, buf = guarded_pages(shape, dtype)
    x[...] = np.random.default_rng(0).standard_normal(shape)
    w = np.random.default_rng(1).standard_normal((5, C, 3, 3)).astype(dtype)
    xr = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)
    for padding in (0, 1, 2):
        got = tilegemm.conv2d(x, w, padding=padding, algorithm=algorithm, layout=layout)
        if layout == "NHWC":
            got = got.transpose(0, 3, 1, 2)
        want = reference_conv(xr.astype(np.float64), w.astype(np.float64), padding=padding)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


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
                          out=out)
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


def test_residual_and_out_write_the_skip_sum_where_asked():
    """``activation(conv + bias + residual)``; ``out`` may be the residual itself."""
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    r = RNG.standard_normal((2, 4, 6, 6)).astype(np.float32)
    expected = np.maximum(reference_conv(x, w, b, padding=1) + r, 0)
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu", residual=r)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    in_place = r.copy()
    got = tilegemm.conv2d(x, w, b, padding=1, activation="relu", residual=in_place, out=in_place)
    assert got is in_place
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    out = np.full((2, 4, 6, 6), np.nan, np.float32)
    assert tilegemm.conv2d(x, w, b, padding=1, out=out) is out
    np.testing.assert_allclose(out, reference_conv(x, w, b, padding=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(residual=np.zeros((2, 4, 5, 6), np.float32)), ValueError, "residual must have"),
    (dict(residual=np.zeros((2, 4, 6, 6), np.int32)), TypeError, "residual"),
    (dict(out=np.zeros((2, 4, 6, 6), np.float64)), ValueError, "out must be"),
    (dict(out=np.zeros((2, 4, 6, 6), np.float32).T), ValueError, "out must be"),
    (dict(out=[0.0]), TypeError, "out must be a numpy array"),
])
def test_residual_and_out_errors(kwargs, error, match):
    x = np.zeros((2, 3, 6, 6), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(error, match=match):
        tilegemm.conv2d(x, w, padding=1, **kwargs)


def test_out_overlapping_the_input_is_refused():
    x = np.zeros((1, 4, 6, 6), np.float32)
    w = np.zeros((4, 4, 1, 1), np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        tilegemm.conv2d(x, w, out=x)


def test_prepared_conv_checks_only_what_it_is_given():
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    w = RNG.standard_normal((5, 3, 3, 3)).astype(np.float32)
    conv = tilegemm.conv.PreparedConv(x.shape, w, None, 2, 1, activation="relu6")
    assert conv.output_shape == (1, 5, 4, 4)
    np.testing.assert_allclose(conv(x), np.clip(reference_conv(x, w, None, 2, 1), 0, 6),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"input must have shape \(1, 3, 8, 8\)"):
        conv(x[:, :, :7])
    with pytest.raises(TypeError, match="float32 ndarray"):
        conv(x.astype(np.float64))
    with pytest.raises(ValueError, match="PreparedConv"):
        tilegemm.conv.PreparedConv((1, 4, 8, 8), w)
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.conv.PreparedConv(x.shape, w, dtype=np.int32)
