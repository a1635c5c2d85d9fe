"""Differential fuzzing of conv2d against a float64 reference written in numpy.

Each generated layer (batch, channels, groups incl. depthwise and channel
multipliers, rectangular kernels 1-7, strides and dilations 1-3, every padding
form, bias, activations, a residual summed before the activation (separate or in
place as ``out``), both layouts, conv2d and :class:`tilegemm.conv.PreparedConv`, float32 and float64, 1 or 2 threads, inputs and
weights in random memory layouts) runs through ``algorithm="auto"`` and through
every path of :data:`tilegemm.conv.paths.PATHS` that serves it, forced with
``conv2d``'s internal ``_path``.  Every result must be within an error bound
scaled by ``sqrt(reduction length) * eps`` and the magnitudes summed; the inputs
must come back unchanged.

Each example aims at a family of layers (depthwise, grouped with the output as
wide as the input, Winograd's 3x3, 1x1, any) so that every path is reached in a
short run: :func:`test_every_path_is_reached` asserts it.  ``TILEGEMM_FUZZ=long``
selects the long profile (see ``fuzz_settings.py``).
"""
import threading

import numba
import numpy as np
import pytest
from hypothesis import assume, given, note, strategies as st

import tilegemm
from fuzz_settings import fuzz_settings
from reference import reference_activation, reference_conv
from tilegemm.conv import paths
from tilegemm.conv.params import conv_params

#: Families of layers an example aims at; each reaches paths the others rarely do.
AIMS = ("any", "depthwise", "grouped_same", "winograd", "pointwise", "wide_depthwise")
#: Memory layouts the input and the weights may come in (see :func:`_arrange`).
LAYOUTS = ("C", "F", "negative", "transposed", "offset", "misaligned", "broadcast")

#: Paths run so far and the largest error/bound ratio per algorithm (the long
#: profile prints them; see test_every_path_is_reached).
REACHED = set()
WORST = {}
#: (layout, Winograd tile size) run so far (test_every_path_is_reached wants all of them).
WINOGRAD_TILES = (2, 4, 6)
TILES_REACHED = set()
_record_lock = threading.Lock()


@st.composite
def layers(draw):
    """(input shape NCHW, weight shape, conv2d keyword arguments, dtype, threads)."""
    aim = draw(st.sampled_from(AIMS))
    small = st.integers(1, 3)
    N = draw(st.integers(1, 3))
    if aim in ("depthwise", "wide_depthwise"):
        # Wide: channels for two vectors of every ISA's lanes (direct.nhwc_vector).
        groups = draw(st.integers(1, 12) if aim == "depthwise"
                      else st.sampled_from((17, 32, 40, 64, 72)))
        Cg, Kg = 1, (draw(st.sampled_from((1, 1, 2, 3))) if aim == "depthwise" else 1)
    elif aim == "grouped_same":
        groups, Cg, Kg = draw(st.integers(2, 8)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    else:
        groups = draw(st.sampled_from((1, 1, 1, 2, 3)))
        Cg, Kg = draw(st.integers(1, 24)), draw(st.integers(1, 40))
    if aim == "winograd":
        kh = kw = 3
    elif aim == "pointwise":
        kh = kw = 1
    else:
        kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    ones = aim in ("winograd", "pointwise", "grouped_same")
    stride = (1, 1) if ones else (draw(small), draw(small))
    dilation = (1, 1) if ones else (draw(small), draw(small))
    if aim in ("depthwise", "wide_depthwise") and draw(st.booleans(), label="fit rows"):
        # Rows as wide as the stride-phase planes (direct.flat): an odd kernel width
        # padded by its reach on each side.
        kw = draw(st.sampled_from((1, 3, 5, 7)))
        padding = (draw(st.integers(0, 3)), dilation[1] * (kw - 1) // 2)
    elif aim == "grouped_same":
        padding = "same"
    elif aim == "pointwise":
        padding = 0
    else:
        padding = draw(st.one_of(
            st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)),
            st.sampled_from(("valid", "same") if stride == (1, 1) else ("valid",))))
    H, W = draw(st.integers(1, 14)), draw(st.integers(1, 14))
    kwargs = dict(stride=stride if stride[0] != stride[1] else stride[0],
                  dilation=dilation if dilation[0] != dilation[1] else dilation[0],
                  padding=padding, groups=groups)
    try:
        p = conv_params((N, groups * Cg, H, W), (groups * Kg, Cg, kh, kw), **kwargs)
    except ValueError:
        assume(False)                  # an empty output: conv2d rejects it (tested elsewhere)
    assume(p.Ho >= 1 and p.Wo >= 1)
    dtype = draw(st.sampled_from((np.float32, np.float64)))
    threads = draw(st.sampled_from((1, 2)))
    return (N, groups * Cg, H, W), (groups * Kg, Cg, kh, kw), kwargs, dtype, threads


def _arrange(draw, values, what):
    """``values`` in a memory layout drawn from :data:`LAYOUTS`, the same numbers.

    "broadcast" gives zero strides: ``values`` is first made constant along an
    axis, so the caller must use the returned array's values for its reference.
    """
    kind = draw(st.sampled_from(LAYOUTS), label=f"{what} layout")
    if kind == "F":
        return np.asfortranarray(values)
    if kind == "negative":
        return np.flip(np.flip(values, -1).copy(), -1)
    if kind == "transposed":
        perm = draw(st.permutations(range(values.ndim)))
        return np.ascontiguousarray(values.transpose(perm)).transpose(np.argsort(perm))
    if kind == "offset":                # one element in: not 64-byte aligned
        buf = np.empty(values.size + 1, values.dtype)
        out = buf[1:].reshape(values.shape)
        out[...] = values
        return out
    if kind == "misaligned":            # not even aligned to the element size
        raw = np.empty(values.nbytes + 1, np.uint8)
        out = raw[1:].view(values.dtype).reshape(values.shape)
        out[...] = values
        return out
    if kind == "broadcast":
        axis = draw(st.integers(0, values.ndim - 1))
        return np.broadcast_to(values.take([0], axis=axis), values.shape)
    return values


#: Winograd F(m x m, 3x3): how much more its transforms round than F(2x2)'s, with a
#: margin (the ratios of the bounds tests/test_winograd_points.py states, 12.5 and 20).
WINOGRAD_GROWTH = {2: 1, 4: 16, 6: 32}


def _bound(x, w, b, p, winograd):
    """Elementwise error bound for the float64 reference of ``x`` (NCHW), ``w``, ``b``.

    ``sqrt(R)`` ulps of the magnitudes summed (``R`` = the reduction length):
    rounding errors of random signs grow like a random walk.  Winograd F(m x m, 3x3)
    (``winograd`` = m, 0 for the other algorithms) mixes a whole (m+2)x(m+2) input
    tile (including pixels that only the tile's outputs past the image read) with
    all of a filter's taps before multiplying, so its bound is absolute per m x m
    output tile: the largest input of the tile times the sum of the filter's
    magnitudes, times ``WINOGRAD_GROWTH[m]``.
    """
    eps = np.finfo(np.float32 if x.dtype == np.float32 and w.dtype == np.float32
                   else np.float64).eps
    reduction = p.Cg * p.kh * p.kw
    if winograd:
        m = winograd
        TH, TW = -(-p.Ho // m), -(-p.Wo // m)
        xp = np.zeros((p.N, p.C, m * TH + 2, m * TW + 2))
        rows, cols = min(p.H, m * TH + 2 - p.top), min(p.W, m * TW + 2 - p.left)
        xp[:, :, p.top:p.top + rows, p.left:p.left + cols] = np.abs(x[:, :, :rows, :cols])
        # The largest input of each tile's (m+2)x(m+2) window, over each group's channels.
        windows = np.lib.stride_tricks.sliding_window_view(xp, (m + 2, m + 2), axis=(2, 3))
        tile_max = windows[:, :, ::m, ::m].max(axis=(4, 5))[:, :, :TH, :TW]
        group_max = tile_max.reshape(p.N, p.groups, p.Cg, TH, TW).max(axis=2)
        wsum = np.abs(w.astype(np.float64)).reshape(p.K, -1).sum(axis=1)
        mag = np.repeat(group_max, p.Kg, axis=1) * wsum[None, :, None, None]
        mag = np.repeat(np.repeat(mag, m, axis=2), m, axis=3)[:, :, :p.Ho, :p.Wo]
        if b is not None:
            mag = mag + np.abs(b.astype(np.float64)).reshape(1, -1, 1, 1)
        return 2 * WINOGRAD_GROWTH[m] * np.sqrt(reduction) * eps * mag + 1e-30
    pads = (p.top, p.bottom, p.left, p.right)
    kw = dict(stride=(p.sy, p.sx), dilation=(p.dy, p.dx), padding=pads, groups=p.groups)
    mag = reference_conv(np.abs(x), np.abs(w), None if b is None else np.abs(b), **kw)
    # 4 ulps per sqrt(R): 7,500-layer runs saw at most 1.4 (the closing print of
    # test_every_path_is_reached gives the largest ratio of a run).
    return 4 * np.sqrt(reduction) * eps * mag + 4 * eps * mag + 1e-30


def _check(path, got, expected, bound, context):
    got = np.asarray(got, np.float64)
    err = np.abs(got - expected)
    ratio = float(np.max(err / bound)) if got.size else 0.0
    algorithm = path.partition(".")[0]
    with _record_lock:
        REACHED.add(path)
        WORST[algorithm] = max(WORST.get(algorithm, 0.0), ratio)
    bad = ~(err <= bound)               # NaN counts as bad
    if bad.any():
        at = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1)),
                              err.shape)
        pytest.fail(f"{context} via {path}: {int(bad.sum())} outputs off, worst at {at}: "
                    f"expected {expected[at]!r}, got {got[at]!r}, bound {bound[at]!r}")


def _run(x, w, b, kwargs, layout, activation, path, threads, tile=None, residual=None):
    """conv2d on ``threads`` threads; ``residual``: None, or (array, in place) where in
    place passes a copy of the array as both ``residual`` and ``out``."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    extra = {}
    if residual is not None:
        r, in_place = residual
        r = r.copy() if in_place else r
        extra = dict(residual=r, out=r if in_place else None)
    try:
        got = tilegemm.conv2d(x, w, b, activation=activation, layout=layout, _path=path,
                              winograd_tile=tile, **extra, **kwargs)
        assert residual is None or not residual[1] or got is extra["out"]
        return got
    finally:
        numba.set_num_threads(saved)


def _check_prepared(got, x, w, b, kwargs, layout, activation, threads, residual):
    """PreparedConv runs the plan conv2d ran: the same values, bit for bit."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        conv = tilegemm.conv.PreparedConv(x.shape, w, b, activation=activation, layout=layout,
                                          dtype=x.dtype, **kwargs)
        if residual is None:
            again = conv(np.ascontiguousarray(x))
        else:
            r = residual[0].copy()
            again = conv(x.copy(), r, out=r if residual[1] else None)
    finally:
        numba.set_num_threads(saved)
    np.testing.assert_array_equal(again, got)


@fuzz_settings(scale=1.5)      # 300 layers in CI: enough to reach every path
@given(layer=layers(), data=st.data())
def test_conv2d_matches_the_reference_on_every_path(layer, data):
    x_shape, w_shape, kwargs, dtype, threads = layer
    layout = data.draw(st.sampled_from(("NCHW", "NHWC")), label="layout")
    activation = data.draw(st.sampled_from((None, "relu", "relu6")), label="activation")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    scale = data.draw(st.sampled_from((1.0, 1e-3, 1e3)), label="scale")
    x_nchw = (rng.standard_normal(x_shape) * scale).astype(dtype)
    w = _arrange(data.draw, rng.standard_normal(w_shape).astype(dtype), "weight")
    b = (rng.standard_normal(w_shape[0]).astype(dtype)
         if data.draw(st.booleans(), label="bias") else None)
    x = x_nchw if layout == "NCHW" else x_nchw.transpose(0, 2, 3, 1)
    x = _arrange(data.draw, np.ascontiguousarray(x), "input")
    x_nchw = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)    # the values as arranged
    x_before, w_before = x.copy(), w.copy()

    p = conv_params(x.shape, w.shape, layout=layout, **kwargs)
    # From the example's seed, not a draw of its own: the examples (and so the paths
    # they reach) stay the ones drawn without it.
    residual = (None, None, "separate", "in place")[rng.integers(4)]
    note(f"residual: {residual}")
    expected = reference_conv(x_nchw, w, b, stride=(p.sy, p.sx), dilation=(p.dy, p.dx),
                              padding=(p.top, p.bottom, p.left, p.right), groups=p.groups,
                              activation=None if residual else activation)
    if residual:                 # a skip connection of the result's magnitude
        r_nchw = (rng.standard_normal(expected.shape) * scale).astype(dtype)
        expected = reference_activation(expected + r_nchw, activation)
        r = r_nchw if layout == "NCHW" else np.ascontiguousarray(r_nchw.transpose(0, 2, 3, 1))
        r_before, residual = r.copy(), (r, residual == "in place")
    bounds = {}
    plan = tilegemm.conv_plan(x.shape, w.shape, layout=layout, dtype=dtype,
                              threads=min(threads, numba.config.NUMBA_NUM_THREADS), **kwargs)
    runs = [(None, None)]
    for path in paths.PATHS:
        if paths.serves(path, p, np.dtype(dtype)):
            # A Winograd path runs every tile size; auto runs the planned one.
            runs += [(path, tile) for tile in
                     (WINOGRAD_TILES if path.startswith("winograd") else (None,))]
    for path, tile in runs:
        note(f"path {path}, tile {tile}")
        got = _run(x, w, b, kwargs, layout, activation, path, threads, tile, residual)
        if path is None:               # the same plan, bound to the shape once
            _check_prepared(got, x, w, b, kwargs, layout, activation, threads, residual)
        if layout == "NHWC":
            got = got.transpose(0, 3, 1, 2)
        assert got.shape == expected.shape and got.dtype == np.dtype(dtype)
        name = plan.route if path is None else path
        m = (tile or plan.winograd_tile) if name.startswith("winograd") else 0
        if m not in bounds:
            bounds[m] = _bound(x_nchw, w, b, p, m)
            if residual:
                bounds[m] = bounds[m] + 4 * np.finfo(dtype).eps * np.abs(r_nchw)
        if m:
            with _record_lock:
                TILES_REACHED.add((layout, m))
        _check(name, got, expected, bounds[m],
               f"{x.shape} * {w.shape} {kwargs} {layout} {np.dtype(dtype)} {activation} "
               f"{threads} thread(s)")
    np.testing.assert_array_equal(x, x_before)       # inputs never modified
    np.testing.assert_array_equal(w, w_before)
    if residual:
        np.testing.assert_array_equal(residual[0], r_before)


def test_every_path_is_reached():
    """Every path conv_plan can name ran on at least one generated layer."""
    if not REACHED >= set(paths.PATHS):
        test_conv2d_matches_the_reference_on_every_path()     # run alone (-k): fuzz first
    missing = set(paths.PATHS) - REACHED
    missing |= {f"winograd.{layout.lower()} F({m}x{m})" for layout in ("NCHW", "NHWC")
                for m in WINOGRAD_TILES if (layout, m) not in TILES_REACHED}
    print("\nlargest error / bound per algorithm:",
          {k: round(v, 4) for k, v in sorted(WORST.items())})
    assert not missing, f"paths no generated layer reached: {sorted(missing)}"
