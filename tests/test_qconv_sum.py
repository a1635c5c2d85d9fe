"""A QDQ residual sum fused after a quantized conv (:class:`PreparedQConv`'s
``residual``): bit for bit the three float32 steps ONNX writes, in every layout,
path, thread split and chunking, against guard pages, from several Python threads."""
import dataclasses

import numpy as np
import pytest
from guard import GUARD_PAGES, guarded_empty
from reference import qdq_sum
from thread_runs import in_threads

import tilegemm
from tilegemm.conv import quantized
from tilegemm.conv.qconv import PreparedQConv, QuantizedSum
from tilegemm.kernels.qgemm import int8_kind, taps_serve

RNG_SEED = 5


def _codes(rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _check(x, qw, options, s, residual=None, threads=1):
    """The fused layer's output against the plain layer's codes summed by
    :func:`reference.qdq_sum`; ``residual`` (default random codes) left unchanged."""
    plain = PreparedQConv(x.shape, x.dtype, 0.02, qw, **options)
    fused = PreparedQConv(x.shape, x.dtype, 0.02, qw, residual=s, **options)
    assert fused.output_shape == plain.output_shape
    rng = np.random.default_rng(RNG_SEED)
    r_dtype = np.asarray(s.zero_point).dtype
    if residual is None:
        residual = _codes(rng, plain.output_shape, r_dtype)
    before = residual.copy()
    with tilegemm.thread_limit(threads):
        codes = plain(x)
        got = fused(x, residual=residual)
    want = qdq_sum(codes, residual, (options["out_scale"], options["out_zero_point"]), s)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(residual, before)
    return got


LAYERS = [  # (C, K, kernel, options, 7-bit weights)
    (16, 24, 3, dict(padding=1), True),
    (16, 24, 3, dict(padding=1), False),
    (16, 32, 1, dict(), True),                     # uint8 NHWC read in place
    (16, 32, 1, dict(stride=2), True),
    (3, 16, 7, dict(stride=2, padding=3), True),   # a stem
    (16, 8, 3, dict(padding=1, groups=2), True),
    (8, 8, 3, dict(padding=1, groups=8), True),    # depthwise: the patch path
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("layer", LAYERS, ids=lambda ly: f"{ly[0]}x{ly[1]}k{ly[2]}{ly[3]}{ly[4]}")
def test_the_fused_sum_is_the_three_steps(layout, layer):
    C, K, k, geometry, seven = layer
    rng = np.random.default_rng(1)
    x = _codes(rng, (2, C, 11, 12) if layout == "NCHW" else (2, 11, 12, C), np.uint8)
    w = _codes(rng, (K, C // geometry.get("groups", 1), k, k), np.int8)
    qw = tilegemm.QConvWeights(w // 2 if seven else w, rng.uniform(1e-3, 4e-3, K))
    options = dict(x_zero_point=3, out_scale=0.05, out_zero_point=np.uint8(120), layout=layout,
                   **geometry)
    for s in (QuantizedSum(0.04, np.uint8(10), 0.07, np.uint8(100), None, True),
              QuantizedSum(0.03, np.int8(-4), 0.06, np.int8(3), "relu", False),
              QuantizedSum(0.05, np.uint8(128), 0.02, np.uint8(0), "relu", True)):
        _check(x, qw, options, s)


def test_an_int8_conv_output_and_its_sum():
    """Codes of the conv int8 and the sum uint8 (and the other way round)."""
    rng = np.random.default_rng(2)
    x = _codes(rng, (1, 9, 10, 16), np.int8)
    qw = tilegemm.QConvWeights(_codes(rng, (24, 16, 3, 3), np.int8) // 2, 0.003)
    for conv_zero, sum_zero in ((np.int8(-3), np.uint8(7)), (np.uint8(200), np.int8(0))):
        options = dict(x_zero_point=-2, padding=1, layout="NHWC", out_scale=0.1,
                       out_zero_point=conv_zero)
        _check(x, qw, options, QuantizedSum(0.05, np.uint8(9), 0.08, sum_zero, "relu"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, K, geometry", [((1, 40, 41, 16), 64, dict(padding=1)),
                                                ((2, 40, 41, 16), 64, dict(stride=2)),
                                                ((1, 5, 6, 32), 80, dict(padding=1))])
def test_the_sum_in_chunks_and_shares(threads, shape, K, geometry, monkeypatch):
    """Blocks of pixels longer than the taps driver's chunk (a 64 KiB L2), two threads
    on runs of pixels, whole images, or runs of output channels (a small image under
    many weights): every chunk's sum lands at its pixels."""
    small_l2 = dataclasses.replace(quantized.detect(), l2_bytes=64 << 10)
    monkeypatch.setattr(quantized, "detect", lambda: small_l2)
    monkeypatch.setattr(quantized, "SHARE_OPS", 0)
    rng = np.random.default_rng(3)
    x = _codes(rng, shape, np.uint8)
    qw = tilegemm.QConvWeights(_codes(rng, (K, shape[3], 3, 3), np.int8) // 2,
                               rng.uniform(1e-3, 4e-3, K))
    if not taps_serve(int8_kind(), shape[3], 1):
        pytest.skip("this host's int8 kernel has no taps kernel")
    options = dict(x_zero_point=9, layout="NHWC", out_scale=0.2, out_zero_point=np.uint8(50),
                   **geometry)
    _check(x, qw, options, QuantizedSum(0.04, np.uint8(10), 0.07, np.uint8(100), "relu"),
           threads=threads)


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_sum_against_guard_pages(layout):
    """No read past the input or the residual when each ends (or starts) at a guard page."""
    rng = np.random.default_rng(4)
    x_vals = _codes(rng, (1, 16, 9, 10) if layout == "NCHW" else (1, 9, 10, 16), np.uint8)
    qw = tilegemm.QConvWeights(_codes(rng, (24, 16, 3, 3), np.int8) // 2, 0.003)
    s = QuantizedSum(0.04, np.uint8(10), 0.07, np.uint8(100), "relu")
    for padding in (1, 0):
        options = dict(x_zero_point=3, padding=padding, layout=layout, out_scale=0.05,
                       out_zero_point=np.uint8(120))
        shape = PreparedQConv(x_vals.shape, np.uint8, 0.02, qw, **options).output_shape
        r_vals = _codes(rng, shape, np.uint8)
        for where in ("after", "before"):
            x = guarded_empty(x_vals.shape, np.uint8, where=where)
            r = guarded_empty(shape, np.uint8, where=where)
            x[...], r[...] = x_vals, r_vals
            _check(x, qw, options, s, residual=r)


def test_the_sum_from_several_python_threads():
    rng = np.random.default_rng(6)
    x = _codes(rng, (1, 12, 12, 16), np.uint8)
    qw = tilegemm.QConvWeights(_codes(rng, (32, 16, 3, 3), np.int8) // 2, 0.003)
    options = dict(x_zero_point=3, padding=1, layout="NHWC", out_scale=0.05)
    s = QuantizedSum(0.04, np.uint8(10), 0.07, np.uint8(100), "relu")
    fused = PreparedQConv(x.shape, x.dtype, 0.02, qw, residual=s, **options)
    r = _codes(rng, fused.output_shape, np.uint8)
    want = fused(x, residual=r)

    def work(i):
        for _ in range(20):
            assert np.array_equal(fused(x, residual=r), want)

    in_threads(work, 4)


def test_sum_errors():
    rng = np.random.default_rng(7)
    x = _codes(rng, (1, 6, 6, 8), np.uint8)
    qw = tilegemm.QConvWeights(_codes(rng, (8, 8, 3, 3), np.int8), 0.003)
    options = dict(padding=1, layout="NHWC", out_scale=0.05)
    s = QuantizedSum(0.04, np.uint8(10), 0.07, np.uint8(100))
    with pytest.raises(ValueError, match="give out_scale"):
        PreparedQConv(x.shape, x.dtype, 0.02, qw, residual=s, padding=1, layout="NHWC")
    for bad, match in ((s._replace(scale=0.0), "residual's scale"),
                       (s._replace(out_scale=np.nan), "sum's scale"),
                       (s._replace(activation="relu6"), "residual activation"),
                       (s._replace(zero_point=300), "residual's zero point")):
        with pytest.raises(ValueError, match=match):
            PreparedQConv(x.shape, x.dtype, 0.02, qw, residual=bad, **options)
    fused = PreparedQConv(x.shape, x.dtype, 0.02, qw, residual=s, **options)
    plain = PreparedQConv(x.shape, x.dtype, 0.02, qw, **options)
    r = np.zeros(fused.output_shape, np.uint8)
    with pytest.raises(TypeError, match="missing"):
        fused(x)
    with pytest.raises(TypeError, match="without one"):
        plain(x, residual=r)
    for bad in (r[:, :5], r.astype(np.int8), r.tolist()):
        with pytest.raises(ValueError, match="the residual must be uint8 codes"):
            fused(x, residual=bad)
