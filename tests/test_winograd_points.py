"""Winograd F(m x m, 3 x 3) matrices from their interpolation points, and their float32 error.

The matrices are checked exactly (rational arithmetic); the error bounds are the
ones docs/conv-paths.md states for each tile size, measured against a float64
direct convolution on inputs of realistic scale (post-ReLU activations in [0, 1),
He-initialised weights).
"""
from fractions import Fraction

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import tilegemm
from tilegemm.packing import cook_toom
from tilegemm.packing.winograd import AT, BT, G

#: Largest float32 error of each tile size, as a fraction of ``sum |x| |w|`` over the
#: output's receptive field (the scale of the rounding errors a sum of products can
#: make), on the layers below.  Measured: 6.6-6.7e-8, 5.2-7.8e-7 and 1.2-1.4e-6.
ERROR_BOUND = {2: 2e-7, 4: 2.5e-6, 6: 4e-6}


def _fractions(a):
    return np.array([[Fraction(int(v)) for v in row] for row in a], dtype=object)


def _direct(x, w):
    """Valid 3x3 correlation of (C, H, W) with (K, C, 3, 3), in x's dtype."""
    return np.einsum("cyxij,kcij->kyx", sliding_window_view(x, (3, 3), axis=(1, 2)), w)


def winograd_layer(x, w, m, dtype=np.float32):
    """A valid 3x3 convolution by F(m x m, 3 x 3), every step rounded to ``dtype``:
    transform the tiles and the filters, sum the element-wise products over the
    channels, transform back."""
    at, g, bt = (a.astype(dtype) for a in cook_toom.matrices(m))
    C, H, W = x.shape
    alpha = m + 2
    TH, TW = -(-(H - 2) // m), -(-(W - 2) // m)
    xp = np.zeros((C, TH * m + 2, TW * m + 2), dtype)
    xp[:, :H, :W] = x
    d = sliding_window_view(xp, (alpha, alpha), axis=(1, 2))[:, ::m, ::m]
    v = np.einsum("ij,cyxjk,lk->cyxil", bt, d, bt).astype(dtype)
    u = np.einsum("ij,kcjl,ml->kcim", g, w.astype(dtype), g).astype(dtype)
    prod = np.einsum("kcij,cyxij->kyxij", u, v).astype(dtype)
    y = np.einsum("ij,kyxjl,ml->kyxim", at, prod, at).astype(dtype)
    return y.transpose(0, 1, 3, 2, 4).reshape(w.shape[0], TH * m, TW * m)[:, :H - 2, :W - 2]


@pytest.mark.parametrize("m", sorted(cook_toom.POINTS))
def test_matrices_compute_the_correlation_exactly(m):
    alpha = m + 2
    mats = [np.array(x, dtype=object) for x in cook_toom.exact_matrices(m)]
    assert [np.shape(x) for x in mats] == [(m, alpha), (alpha, 3), (alpha, alpha)]
    rng = np.random.default_rng(m)
    for _ in range(3):
        d = _fractions(rng.integers(-9, 10, (alpha, alpha)))
        g = _fractions(rng.integers(-9, 10, (3, 3)))
        assert (cook_toom.correlate_tile(mats, d, g) == _direct(d[None], g[None, None])[0]).all()


def test_f4_is_the_published_matrix_set():
    """Lavin and Gray's F(4x4, 3x3): points 0, +-1, +-2."""
    at, g, bt = cook_toom.matrices(4)
    assert np.array_equal(bt[0], [4, 0, -5, 0, 1, 0])
    assert np.array_equal(at[3], [0, 1, -1, 8, -8, 1])
    assert np.allclose(g[1], [-1 / 6] * 3) and np.array_equal(g[0], [0.25, 0, 0])


def test_f2_matches_the_hand_written_transforms():
    """The generated F(2x2, 3x3) gives the library's hand-written one, tile for tile."""
    rng = np.random.default_rng(2)
    d, g = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
    assert np.array_equal(cook_toom.matrices(2)[1], G)
    assert np.allclose(cook_toom.correlate_tile(cook_toom.matrices(2), d, g),
                       cook_toom.correlate_tile((AT, G, BT), d, g), rtol=0, atol=1e-14)


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        cook_toom.exact_matrices(2, points=(0, 1, 1))
    with pytest.raises(ValueError, match="distinct"):
        cook_toom.exact_matrices(4, points=(0, 1, -1))
    with pytest.raises(ValueError, match="no default points"):
        cook_toom.exact_matrices(3)


def _layer(C, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (C, 26, 26)).astype(np.float32)
    w = (rng.standard_normal((32, C, 3, 3)) * np.sqrt(2 / (9 * C))).astype(np.float32)
    ref = _direct(x.astype(np.float64), w.astype(np.float64))
    scale = _direct(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64))
    return x, w, ref, scale


@pytest.mark.parametrize("C", [64, 256])
@pytest.mark.parametrize("m", sorted(cook_toom.POINTS))
def test_float32_error_within_the_stated_bound(m, C):
    x, w, ref, scale = _layer(C, seed=C + m)
    err = np.abs(winograd_layer(x, w, m) - ref) / scale
    assert err.max() <= ERROR_BOUND[m], f"F({m},3), C={C}: {err.max():.2e}"
    # The bounds are not loose for the larger tiles: each one is above the smaller's.
    if m > 2:
        assert err.max() > ERROR_BOUND[2]


@pytest.mark.parametrize("C", [64, 256])
@pytest.mark.parametrize("m", sorted(cook_toom.POINTS))
def test_library_within_the_stated_bound(m, C):
    """The compiled F(m x m, 3x3) NCHW path keeps the bound stated for its tile size."""
    x, w, ref, scale = _layer(C, seed=C)
    y = tilegemm.conv2d(x[None], w, algorithm="winograd", winograd_tile=m)[0]
    assert (np.abs(y - ref) / scale).max() <= ERROR_BOUND[m]
