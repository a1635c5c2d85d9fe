"""qconv2d's contracts: errors, prepared weights, memory, threads, NaN.

Its results over generated layers are checked in ``test_fuzz_int8.py``.
"""

import numpy as np
import pytest
from guard import GUARD_PAGES, guarded_empty
from thread_runs import in_threads

import tilegemm
from tilegemm.conv.qconv import PreparedQConv
from tilegemm.kernels.requant import fold


def _layer(seed=0, layout="NCHW", dtype=np.uint8):
    rng = np.random.default_rng(seed)
    shape = (2, 8, 9, 10) if layout == "NCHW" else (2, 9, 10, 8)
    x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, shape).astype(dtype)
    w = rng.integers(-127, 128, (6, 8, 3, 3)).astype(np.int8)
    return x, w, rng.uniform(1e-3, 1e-2, 6)


def test_qconv2d_rejects_bad_input():
    x, w, ws = _layer()
    cases = [
        (TypeError, "dtype float32", dict(x=x.astype(np.float32))),
        (TypeError, "dtype int16", dict(w=w.astype(np.int16))),
        (TypeError, "4-D int8 array", dict(w=w.astype(np.uint8))),
        (TypeError, "w_scale is required", dict(w_scale=None)),
        (TypeError, "their own scales", dict(w=tilegemm.QConvWeights(w, ws))),
        (ValueError, r"shape \(6,\)", dict(w_scale=np.ones(5))),
        (ValueError, "positive and finite", dict(w_scale=np.zeros(6))),
        (ValueError, "positive and finite", dict(x_scale=-1.0)),
        (ValueError, "positive and finite", dict(out_scale=np.inf)),
        (ValueError, "range", dict(x_zero_point=256)),
        (ValueError, "range", dict(out_scale=0.1, out_zero_point=-1)),
        (ValueError, r"bias must have shape \(6,\)", dict(bias=np.zeros(5))),
        (ValueError, "no quantized code", dict(bias=np.full(6, np.nan), out_scale=0.1)),
        (ValueError, "activation", dict(activation="gelu")),
        (ValueError, "layout", dict(layout="NWHC")),
        (ValueError, "groups", dict(groups=3)),
        (ValueError, "negative", dict(padding=-1)),
    ]
    for error, words, change in cases:
        kw = dict(x=x, x_scale=0.02, w=w, w_scale=ws)
        kw.update(change)
        args = [kw.pop(n) for n in ("x", "x_scale", "w", "w_scale")]
        with pytest.raises(error, match=words):
            tilegemm.qconv2d(*args, **kw)


def test_qconv2d_refuses_a_kernel_whose_sums_could_overflow():
    """uint8 input with zero point 0 by int8 weights: at most 65793 products a sum."""
    x = np.zeros((1, 7311, 3, 3), np.uint8)          # 7311 x 9 = 65799 products
    w = np.zeros((1, 7311, 3, 3), np.int8)
    with pytest.raises(ValueError, match="at most 65793"):
        tilegemm.qconv2d(x, 1.0, w, 1.0)
    assert tilegemm.qconv2d(x[:, :7310], 1.0, w[:, :7310], 1.0).shape == (1, 1, 1, 1)


def test_prepared_weights_give_the_same_result_and_are_read_only():
    x, w, ws = _layer(1)
    cw = tilegemm.QConvWeights(w, ws)
    assert cw.shape == w.shape and not cw.weight.flags.writeable
    for layout in ("NCHW", "NHWC"):
        xl = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        a = tilegemm.qconv2d(xl, 0.02, w, ws, padding=1, layout=layout, x_zero_point=5)
        b = tilegemm.qconv2d(xl, 0.02, cw, padding=1, layout=layout, x_zero_point=5)
        assert np.array_equal(a, b)
    w[0, 0, 0, 0] ^= 1                                # the prepared copy does not follow
    assert np.array_equal(tilegemm.qconv2d(x, 0.02, cw, padding=1, x_zero_point=5),
                          tilegemm.qconv2d(x, 0.02, cw, padding=1, x_zero_point=5))
    with pytest.raises(TypeError, match="4-D int8"):
        tilegemm.QConvWeights(w[0], 1.0)


def test_a_prepared_layer_runs_into_its_output_and_checks_its_input():
    """PreparedQConv (what networks keep per layer): the same codes as qconv2d, into a
    given output when it fits, a new one when not, and a clear error for an input of
    another shape or dtype than it was prepared for."""
    x, w, ws = _layer(2)
    cw = tilegemm.QConvWeights(w, ws)
    options = dict(padding=1, x_zero_point=5, out_scale=0.3, out_zero_point=np.uint8(7))
    want = tilegemm.qconv2d(x, 0.02, cw, **options)
    conv = PreparedQConv(x.shape, x.dtype, 0.02, cw, **options)
    out = np.empty(conv.output_shape, conv.out_dtype)
    assert conv(x, out) is out and np.array_equal(out, want)
    assert np.array_equal(conv(x, np.empty(conv.output_shape, np.int8)), want)
    with pytest.raises(ValueError, match="prepared for uint8 inputs"):
        conv(x[:1])
    with pytest.raises(TypeError, match="unexpected options"):
        PreparedQConv(x.shape, x.dtype, 0.02, cw, strides=2)


@pytest.mark.parametrize("out_scale", [None, 0.05])
def test_a_prepared_layer_takes_inputs_and_outputs_of_any_flags(out_scale):
    """The taps kernel is called through its compiled entry point, one per kind of
    arguments (``ground/entries.py``): after writeable, aligned arrays, a read-only
    input (read in place: a 1x1 NHWC layer) and an output at an odd address give the
    same result."""
    rng = np.random.default_rng(8)
    x = rng.integers(0, 256, (1, 9, 10, 64)).astype(np.uint8)
    w = rng.integers(-127, 128, (32, 64, 1, 1)).astype(np.int8)
    layer = PreparedQConv(x.shape, x.dtype, 0.02, tilegemm.QConvWeights(w, 0.004),
                          np.linspace(-1, 1, 32), x_zero_point=7, layout="NHWC",
                          out_scale=out_scale)
    want = layer(x)
    frozen = x.copy()
    frozen.setflags(write=False)
    odd = np.zeros(want.nbytes + 1, np.uint8)[1:].view(want.dtype).reshape(want.shape)
    assert odd.flags.aligned == (want.itemsize == 1)
    for inp, out in ((frozen, None), (x, odd), (frozen, odd), (x, None)):
        got = layer(inp, out)
        assert np.array_equal(got, want) and (out is None or got is out)


def test_prepared_weights_keep_calls_only_for_equal_arguments():
    """QConvWeights keeps each qconv2d call's checks and plan: a call whose arguments
    differ in any value or type (a bias changed in place, an int8 zero point against
    an int one, another input shape) must not reuse another's."""
    x, w, ws = _layer(6)
    cw = tilegemm.QConvWeights(w, ws)
    bias = np.linspace(-1, 1, 6)
    base = dict(padding=1, x_zero_point=5, out_scale=0.05, out_zero_point=3)

    def both(xx, b, **options):
        kw = dict(base, **options)
        fresh = tilegemm.qconv2d(xx, 0.02, w, ws, bias=b, **kw)
        kept = tilegemm.qconv2d(xx, 0.02, cw, bias=b, **kw)
        assert kept.dtype == fresh.dtype and np.array_equal(kept, fresh)
        return kept

    first = both(x, bias)
    assert np.array_equal(both(x, bias), first)
    bias[1] += 0.5                                   # the same array, other values
    assert not np.array_equal(both(x, bias), first)
    assert both(x, bias, out_zero_point=np.int8(3)).dtype == np.int8
    assert both(x, bias, out_zero_point=3).dtype == np.uint8
    assert both(x[:1], bias).shape[0] == 1
    both(x, bias, stride=[2, 1], activation="relu")  # a list: kept by its values
    both(x, bias.tolist())                           # a list of floats, as the array's values

    class Bias:                                      # an array-like: never kept
        def __init__(self):
            self.values = bias.copy()

        def __array__(self, dtype=None, copy=None):
            return self.values

    odd = Bias()
    before = both(x, odd)
    odd.values[0] += 3.0                             # the same object, other values
    assert not np.array_equal(both(x, odd), before)
    kept = len(cw._calls)
    tilegemm.qconv2d(x, 0.02, cw, bias=bias, **base)
    assert len(cw._calls) == kept                    # a repeated call: no new entry
    for extra in range(20):                          # more calls than are kept
        both(x, bias, x_zero_point=extra)
    assert len(cw._calls) == 16


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_requantization_in_float64_where_float32_cannot_hold_it(layout):
    """Codes are computed in float32 with the scale folded in only where float32 holds
    every term; scales whose folded multipliers overflow it (or terms past 2**22) take
    float64, so the codes stay within one step of the exact value's."""
    x, w, ws = _layer(7)
    x = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w = w // 2                                       # 7-bit: maddubs (its codes tile) on AVX2
    sums = tilegemm.qconv2d(x, 1.0, w, 1.0, padding=1, x_zero_point=5, layout=layout)
    for x_scale, w_scale, out_scale in ((1e20, 1e20, 1.0), (0.02, 0.01, 1e-39),
                                        (0.02, 1.0, 1e-3), (0.02, 0.01, 0.05)):
        got = tilegemm.qconv2d(x, x_scale, w, w_scale, padding=1, x_zero_point=5,
                               layout=layout, out_scale=out_scale, out_zero_point=np.uint8(100))
        want = np.clip(np.rint(sums.astype(np.float64) * (x_scale * w_scale) / out_scale) + 100,
                       0, 255)
        assert np.abs(got.astype(np.int64) - want).max() <= 1, (x_scale, w_scale, out_scale)
    sums_bound = 8 * 9 * 255 * 128
    requant = (1.0, 100.0, 0.0, 255.0)
    assert fold(np.full(6, 1e40), np.zeros(6), 0, requant, sums_bound) is None
    assert fold(np.full(6, 1e-4), np.full(6, 3e6), 0, (0.5,) + requant[1:], sums_bound) is None
    m, b, lim = fold(np.full(6, 1e-4), np.zeros(6), 2, (0.05,) + requant[1:], sums_bound)
    assert m.dtype == np.float32 and lim[3] == np.float32(6.0 / 0.05) and lim[4] == 0
    # the clips narrowed to the codes' range less the zero point (no clip after rint)
    m, b, lim = fold(np.full(6, 1e-4), np.zeros(6), 2, (0.01,) + requant[1:], sums_bound)
    assert lim[3] == 255 - 100 and lim[4] == 0
    m, b, lim = fold(np.full(6, 1e-4), np.zeros(6), 0, (0.01, -3.0, -128.0, 127.0), sums_bound)
    assert lim[3] == 130 and lim[4] == -125


def test_the_output_zero_point_s_type_gives_the_output_dtype():
    x, w, ws = _layer(5)
    assert tilegemm.qconv2d(x, 0.02, w, ws, out_scale=0.1, out_zero_point=3).dtype == np.uint8
    y = tilegemm.qconv2d(x, 0.02, w, ws, out_scale=0.1, out_zero_point=np.int8(-3))
    assert y.dtype == np.int8 and y.min() >= -128
    assert tilegemm.qconv2d(x, 0.02, w, ws).dtype == np.float32


def test_qconv2d_float_output_propagates_nan_bias():
    x, w, ws = _layer(2)
    bias = np.zeros(6)
    bias[2] = np.nan
    y = tilegemm.qconv2d(x, 0.02, w, ws, bias)
    assert np.isnan(y[:, 2]).all() and not np.isnan(np.delete(y, 2, axis=1)).any()


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_qconv2d_against_guard_pages(layout):
    """No read past the input or the weights when each ends (or starts) at a guard page;
    3x3 with padding and 1x1 (the input widened for the taps kernel, or patches and
    the input read in place, by the host's int8 kernel: a uint8 NHWC input with no
    padding is read where it lies by the byte kinds; the taps kernel's own reads are
    guarded in ``test_fuzz_int8.py``)."""
    for dtype, zero in ((np.int8, -3), (np.uint8, 3)):
        x_vals, w_vals, ws = _layer(3, layout, dtype)
        if dtype == np.uint8:    # 7-bit: maddubs on AVX2, the byte kind read in place
            w_vals = w_vals // 2
        for kernel, padding in ((3, 1), (1, 0), (3, 0)):
            wk = np.ascontiguousarray(w_vals[:, :, :kernel, :kernel])
            # expected codes from NCHW (widened, never read in place), as the layout
            x_nchw = x_vals if layout == "NCHW" else np.ascontiguousarray(
                x_vals.transpose(0, 3, 1, 2))
            want = tilegemm.qconv2d(x_nchw, 0.02, wk, ws, padding=padding, x_zero_point=zero,
                                    out_scale=0.05)
            want = want if layout == "NCHW" else want.transpose(0, 2, 3, 1)
            for where in ("after", "before"):
                x = guarded_empty(x_vals.shape, dtype, where=where)
                w = guarded_empty(wk.shape, np.int8, where=where)
                x[...], w[...] = x_vals, wk
                got = tilegemm.qconv2d(x, 0.02, w, ws, padding=padding, layout=layout,
                                       x_zero_point=zero, out_scale=0.05)
                assert np.array_equal(got, want), (dtype, kernel, where)


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride, dilation, padding, dtype, zero",
                         [(1, 1, 1, np.uint8, 7), (2, 1, 1, np.int8, -5), (1, 2, 1, np.uint8, 7),
                          (2, 2, 3, np.int8, -128), (1, 1, 4, np.uint8, 255)])
def test_depthwise_qconv2d_against_guard_pages(layout, stride, dilation, padding, dtype, zero,
                                               monkeypatch):
    """A depthwise layer (lanes over channels, ``kernels/qdepthwise.py``), its input
    ending or starting at a guard page: codes within one step of the float64
    reference, padded (also wider than the kernel reaches), strided, dilated, int8
    inputs with negative zero points; on one thread, two threads taking an image
    each, and two taking rows of one image; and a one-channel conv of one group."""
    from reference import reference_conv
    from tilegemm.conv import quantized
    monkeypatch.setattr(quantized, "SHARE_OPS", 0)     # two threads share even this layer
    rng = np.random.default_rng(5)
    info = np.iinfo(dtype)
    for C, N in ((24, 2), (24, 1), (1, 1)):
        x_vals = rng.integers(info.min, info.max + 1, (N, C, 9, 11)).astype(dtype)
        w = rng.integers(-127, 128, (C, 1, 3, 3)).astype(np.int8)
        ws = rng.uniform(1e-3, 1e-2, C)
        y = reference_conv(x_vals.astype(np.float64) - zero, w, None, stride, padding, dilation, C)
        want = np.clip(np.rint(y * 0.02 * ws[None, :, None, None] / 0.05) + 9, 0, 255)
        if layout == "NHWC":
            x_vals, want = x_vals.transpose(0, 2, 3, 1), want.transpose(0, 2, 3, 1)
        for where, threads in (("after", 1), ("before", 2)):
            x = guarded_empty(x_vals.shape, dtype, where=where)
            x[...] = x_vals
            with tilegemm.thread_limit(threads):
                got = tilegemm.qconv2d(x, 0.02, w, ws, stride=stride, padding=padding,
                                       dilation=dilation, groups=C, x_zero_point=zero,
                                       out_scale=0.05, out_zero_point=np.uint8(9), layout=layout)
            assert got.dtype == np.uint8 and np.abs(got.astype(np.int64) - want).max() <= 1, \
                (C, N, where)


@pytest.mark.parametrize("channels", [8, 24])
def test_qconv2d_from_several_python_threads(channels):
    """One set of weights, and one prepared layer (its plan and scratch per Python
    thread), called from four threads at once; with 24 channels an NCHW layer of
    codes runs as its NHWC twin (its transposes' buffers per thread)."""
    x, w, ws = _layer(4)
    if channels != 8:
        rng = np.random.default_rng(channels)
        x = rng.integers(0, 256, (2, channels, 9, 10)).astype(np.uint8)
        w = rng.integers(-127, 128, (channels, channels, 3, 3)).astype(np.int8)
        ws = rng.uniform(1e-3, 1e-2, channels)
    cw = tilegemm.QConvWeights(w, ws)
    want = tilegemm.qconv2d(x, 0.02, cw, padding=1, out_scale=0.05, out_zero_point=100)
    layer = PreparedQConv(x.shape, x.dtype, 0.02, cw, padding=1, out_scale=0.05,
                          out_zero_point=100)

    def work(i):
        for _ in range(20):
            got = tilegemm.qconv2d(x, 0.02, cw, padding=1, out_scale=0.05, out_zero_point=100)
            assert np.array_equal(got, want)
            assert np.array_equal(layer(x), want)

    in_threads(work, 4)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("batch", [1, 3])
def test_threads_share_pixel_blocks_or_images_alike(layout, batch, monkeypatch):
    """With every layer shared (the threshold lowered), two threads take runs of one
    image's pixels (batch 1) or whole images (batch 3) and give the one-thread codes;
    grouped and 1x1 (read in place) layers too."""
    from tilegemm.conv import quantized
    assert quantized.pixel_shares(1, 10, 2) == [[(0, 0, 5)], [(0, 5, 10)]]
    assert quantized.pixel_shares(3, 10, 2) == [[(0, 0, 10), (2, 0, 10)], [(1, 0, 10)]]
    x, w, ws = _layer(4, layout)
    x = np.concatenate([x] * 2)[:batch]
    for weights, kwargs in ((w, dict(padding=1)), (w[:, :4], dict(groups=2, padding=1)),
                            (w[:, :, :1, :1], dict(stride=2)), (w[:, :, :1, :1], {})):
        qw = tilegemm.QConvWeights(np.ascontiguousarray(weights), ws)
        options = dict(x_zero_point=5, out_scale=0.2, layout=layout, **kwargs)
        with tilegemm.thread_limit(1):
            want = tilegemm.qconv2d(x, 0.02, qw, **options)
        monkeypatch.setattr(quantized, "SHARE_OPS", 0)
        with tilegemm.thread_limit(2):
            if tilegemm.get_num_threads() < 2:
                pytest.skip("one thread here: nothing is shared")
            got = tilegemm.qconv2d(x, 0.02, qw, **options)
        monkeypatch.undo()
        assert np.array_equal(got, want), kwargs


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_threads_share_output_channels_where_the_weights_outweigh_the_input(layout, monkeypatch):
    """A small image under many weights (as ResNet's last stages at batch 1): with the
    taps kernel two threads take runs of each group's output channels, the last run
    short of a whole tile, and give the one-thread codes; grouped too."""
    from tilegemm.conv import quantized
    from tilegemm.kernels.int8 import TILES
    from tilegemm.kernels.qgemm import int8_kind, taps_kind_for, taps_serve
    if not taps_serve(int8_kind(), 8, 2):
        pytest.skip("this host's int8 kernel has no taps kernel")
    nr = TILES[int8_kind()][1]
    K = 5 * nr // 2            # two and a half tiles of output channels
    rng = np.random.default_rng(9)
    shape = (1, 16, 5, 6) if layout == "NCHW" else (1, 5, 6, 16)
    x = rng.integers(0, 256, shape).astype(np.uint8)
    for groups in (1, 2):
        w = rng.integers(-127, 128, (K, 16 // groups, 3, 3)).astype(np.int8)
        qw = tilegemm.QConvWeights(w, rng.uniform(1e-3, 1e-2, K))
        options = dict(x_zero_point=7, padding=1, groups=groups, out_scale=0.3, layout=layout)
        with tilegemm.thread_limit(1):
            want = tilegemm.qconv2d(x, 0.02, qw, **options)
        monkeypatch.setattr(quantized, "SHARE_OPS", 0)
        shares = []
        monkeypatch.setattr(quantized, "run_shares",
                            lambda fn, parts, gate=None: (shares.append(parts),
                                                          [fn(*a) for a in parts]))
        with tilegemm.thread_limit(2):
            got = tilegemm.qconv2d(x, 0.02, qw, **options)
        monkeypatch.undo()
        if tilegemm.get_num_threads() >= 2:
            # each share's blocks (image, p0, p1, j0, j1): its output channels j0:j1
            runs = [[tuple(block[3:]) for block in np.asarray(share[0]).tolist()]
                    for share in shares[0]]
            cut = runs[0][0][1]
            # cut at a multiple of the tile's NR: the host's, or amx's where it runs the layer
            kind = taps_kind_for(int8_kind(), 16 // groups, groups, K // groups, (3, 1, 8, 6, 1, 1))
            assert cut % TILES[kind[0]][1] == 0 and runs == [[(0, cut)], [(cut, K // groups)]], runs
        assert np.array_equal(got, want), groups


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("shape", [(1, 16, 16), (2, 17, 35), (3, 5, 7), (1, 48, 49)])
def test_transpose_bytes_against_guard_pages(shape):
    """Byte matrices transposed in 16 x 16 blocks and the edges byte by byte: equal to
    numpy, every read inside the source (a guard page after it, then before it) and
    every write inside the destination (a guard page on one side, canaries on both)."""
    from guard import canaried
    from tilegemm.kernels.transpose import transpose_bytes
    N, R, C = shape
    vals = np.random.default_rng(R * C).integers(-128, 128, shape).astype(np.int8)
    for where in ("after", "before"):
        src = guarded_empty(shape, np.int8, where=where)
        src[...] = vals
        dst = guarded_empty((N, C, R), np.int8, where=where)
        transpose_bytes(src.reshape(-1), dst.reshape(-1), (R, C), 0, N)
        assert np.array_equal(dst, vals.transpose(0, 2, 1))
        out, check = canaried((N, C, R), np.int8, fill=0)
        transpose_bytes(src.reshape(-1), out.reshape(-1), (R, C), 1, N)   # images 1: only
        assert np.array_equal(out[1:], vals.transpose(0, 2, 1)[1:]) and not out[:1].any()
        check()


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("kernel, stride, padding, width", [(3, 1, 1, 13), (1, 2, 0, 13),
                                                            (1, 2, 0, 20), (3, 2, 1, 13)])
def test_nchw_twin_against_guard_pages(kernel, stride, padding, width, monkeypatch):
    """An NCHW layer of 24 -> 40 channels with byte codes out runs as its NHWC twin
    between two byte transposes (counted: two per image run; a strided 1x1 layer at
    least 16 wide transposes only the rows it reads), its input at a guard page and
    its output inside canaries: the NHWC layer's codes on the transposed input, on
    one thread and on two taking an image each; the input unchanged."""
    from guard import canaried
    from tilegemm.conv import qconv
    assert qconv.TWIN_MIN_CHANNELS <= 24
    transposes = []

    def counted(name, transpose):
        def run(*args):
            transposes.append((name,) + args[-2:])
            return transpose(*args)
        return run
    monkeypatch.setattr(qconv, "transpose_bytes", counted("all", qconv.transpose_bytes))
    monkeypatch.setattr(qconv, "transpose_rows", counted("rows", qconv.transpose_rows))
    rng = np.random.default_rng(kernel * 10 + stride)
    x_vals = rng.integers(0, 256, (2, 24, 9, width)).astype(np.uint8)
    w = tilegemm.QConvWeights(rng.integers(-127, 128, (40, 24, kernel, kernel)).astype(np.int8),
                              rng.uniform(1e-3, 1e-2, 40))
    geometry = dict(stride=stride, padding=padding, x_zero_point=7, out_scale=0.3,
                    out_zero_point=np.uint8(20))
    layer = PreparedQConv(x_vals.shape, np.uint8, 0.02, w, **geometry)
    want = tilegemm.qconv2d(np.ascontiguousarray(x_vals.transpose(0, 2, 3, 1)), 0.02, w,
                            layout="NHWC", **geometry).transpose(0, 3, 1, 2)
    assert not transposes
    into = "rows" if kernel == 1 and width >= 16 else "all"
    for where, threads in (("after", 1), ("before", 2)):
        x = guarded_empty(x_vals.shape, np.uint8, where=where)
        x[...] = x_vals
        out, check = canaried(want.shape, np.uint8, fill=0)
        with tilegemm.thread_limit(threads):
            got = layer(x, out)
        check()
        assert got is out and np.array_equal(out, want), (where, threads)
        assert np.array_equal(x, x_vals)
        # in and out, each over both images: at once, or an image per thread
        runs = [(0, 2)] if threads == 1 else [(0, 1), (1, 2)]
        assert sorted(transposes) == sorted([(into,) + r for r in runs]
                                            + [("all",) + r for r in runs]), transposes
        transposes.clear()
