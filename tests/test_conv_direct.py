"""Direct convolution (conv/direct.py): the flat layout, depthwise rows, NCHW and NHWC."""
import numba
import numpy as np
import pytest

import tilegemm
from conv_cases import RNG, numba_threads, record_arg, run_case, shapes_of
from reference import reference_conv
from thread_runs import in_threads
from tilegemm.conv import engine
from tilegemm.conv.params import conv_params


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
    p = conv_params(*shapes_of(shape), **kw_args)
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
    calls = record_arg(monkeypatch, tasks, 1) if dtype == np.float32 else None
    with numba_threads(numba.config.NUMBA_NUM_THREADS):
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

    with numba_threads(numba.config.NUMBA_NUM_THREADS):
        in_threads(work, 4)


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
    # Three kernel columns with 8 or more inside: groups of pixels sharing input columns
    # (depthwise_nhwc3), the last group and channel block overlapping.
    "three_columns": ((2, 2 * _L + 3, 6, 21), (1, 3, 3), dict(padding=1)),
    "three_columns_stride2": ((1, 3 * _L, 9, 23), (1, 3, 3), dict(padding=1, stride=2)),
    "three_columns_tall": ((1, 5 * _L, 11, 12), (1, 5, 3), dict(padding=(2, 1), dilation=(2, 1))),
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
