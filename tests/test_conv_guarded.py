"""Every convolution path once with its input, weights and output against guard pages
and its output inside canaries: an out-of-bounds read or write faults or fails here
instead of corrupting memory by luck (see ``guard.py``)."""
import numba
import numpy as np
import pytest

import tilegemm
from guard import GUARD_PAGES, canaried, guarded_empty
from reference import reference_conv
from tilegemm.conv import paths
from tilegemm.conv.params import conv_params

pytestmark = pytest.mark.skipif(not GUARD_PAGES, reason="no mmap/mprotect guard pages here")

#: One layer per path (input NCHW shape, weight shape, keyword arguments, layout), served
#: by that path on every ISA: edges that are not multiples of any tile, odd sizes.
LAYERS = {
    "im2col.pointwise": [((2, 8, 5, 7), (6, 8, 1, 1), {}, "NCHW"),
                         ((1, 9, 11, 13), (7, 9, 1, 1), {}, "NCHW"),   # full tiles too
                         ((2, 8, 5, 7), (6, 4, 1, 1), dict(groups=2), "NHWC")],
    "im2col.rows": [((2, 5, 7, 9), (7, 5, 3, 3), dict(padding=1), "NHWC"),
                    ((2, 9, 5, 7), (70, 9, 1, 1), {}, "NHWC"),          # 1x1, accumulating
                    ((1, 9, 5, 7), (24, 9, 1, 1), {}, "NHWC"),   # a tile of its own (24 wide)
                    # kernel rows read as runs, several NR panels (the last narrower)
                    ((1, 3, 15, 17), (40, 3, 3, 3), dict(padding=1, stride=2), "NHWC"),
                    # channels past one KC block on 32 KiB L1d: taps read one by one
                    ((1, 200, 5, 6), (20, 200, 3, 3), dict(padding=1), "NHWC"),
                    ((2, 6, 7, 5), (9, 6, 2, 3), dict(padding=(1, 2), stride=2), "NCHW")],
    "im2col.taps": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1), "NCHW"),
                       ((2, 4, 9, 10), (6, 2, 3, 3), dict(stride=2, groups=2), "NCHW")],
    "im2col.planes": [((2, 4, 8, 8), (4, 2, 3, 1), dict(groups=2), "NHWC"),
                      ((2, 6, 7, 9), (6, 1, 3, 3), dict(padding=1, groups=6), "NHWC")],
    "im2col.packed": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1, stride=2), "NCHW")],
    "winograd.nchw": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1, winograd_tile=m), "NCHW")
                      for m in (2, 4, 6)],
    "winograd.nhwc": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=(0, 2), winograd_tile=m), "NHWC")
                      for m in (2, 4, 6)],
    "direct.flat": [((2, 8, 16, 16), (8, 1, 3, 3), dict(padding=1, groups=8), "NCHW"),
                    ((1, 8, 15, 17), (8, 1, 3, 3), dict(padding=1, stride=2, groups=8), "NCHW")],
    "direct.nchw_vector": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1), "NCHW")],
    "direct.nchw": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1, stride=(1, 2)), "NCHW")],
    "direct.nhwc_vector": [((1, 72, 6, 7), (72, 1, 3, 3), dict(padding=1, groups=72), "NHWC")],
    "direct.nhwc": [((2, 5, 9, 11), (6, 5, 3, 3), dict(padding=1, stride=2), "NHWC")],
}


def test_every_path_has_a_layer():
    assert set(LAYERS) == set(paths.PATHS)


def _guarded_copy(values, where):
    out = guarded_empty(values.shape, values.dtype, where=where)
    out[...] = values
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", paths.PATHS)
def test_path_stays_inside_its_arrays(path, dtype, threads):
    rng = np.random.default_rng(7)
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for x_shape, w_shape, kwargs, layout in LAYERS[path]:
            x = rng.standard_normal(x_shape).astype(dtype)
            w = rng.standard_normal(w_shape).astype(dtype)
            b = rng.standard_normal(w_shape[0]).astype(dtype)
            call_kwargs, kwargs = kwargs, {k: v for k, v in kwargs.items() if k != "winograd_tile"}
            expected = reference_conv(x, w, b, activation="relu", **kwargs)
            if layout == "NHWC":
                x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
                expected = expected.transpose(0, 2, 3, 1)
            p = conv_params(x.shape, w.shape, layout=layout, **kwargs)
            assert paths.serves(path, p, dtype), (path, x_shape, w_shape, kwargs)
            for where in ("after", "before"):
                xg, wg, bg = (_guarded_copy(a, where) for a in (x, w, b))
                outputs = [guarded_empty(expected.shape, dtype, where=where)]
                canary_out, check = canaried(expected.shape, dtype)
                outputs.append(canary_out)
                for out in outputs:
                    got = tilegemm.conv2d(xg, wg, bg, activation="relu", layout=layout,
                                          _path=path, out=out, **call_kwargs)
                    assert got is out
                    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
                check()
                np.testing.assert_array_equal(xg, x)       # inputs never modified
                np.testing.assert_array_equal(wg, w)
                if paths.accumulates(path, p):             # the residual summed in place
                    skip = rng.standard_normal(expected.shape).astype(dtype)
                    summed = np.maximum(reference_conv_layout(x, w, b, layout, kwargs) + skip, 0)
                    rg = _guarded_copy(skip, where)
                    got = tilegemm.conv2d(xg, wg, bg, activation="relu", layout=layout,
                                          _path=path, residual=rg, out=rg, **call_kwargs)
                    assert got is rg
                    np.testing.assert_allclose(got, summed, rtol=1e-4, atol=1e-4)
    finally:
        numba.set_num_threads(saved)


def reference_conv_layout(x, w, b, layout, kwargs):
    """The float64 reference without activation, for ``x`` in ``layout``."""
    if layout == "NHWC":
        return reference_conv(x.transpose(0, 3, 1, 2), w, b, **kwargs).transpose(0, 2, 3, 1)
    return reference_conv(x, w, b, **kwargs)
