"""The network's pooling kernels against a loop over every window, in both layouts, on
one and several images (the threads split images, or one image's channels), with
NaN and windows that see only padding."""
import numpy as np
import pytest

import tilegemm
from guard import GUARD_PAGES, canaried, guarded_empty
from tilegemm.net.layers import pool2d


def reference_pool(x, kernel, strides, dilations, pads, ceil_mode, kind, count_pads):
    """NCHW pooling by its definition, one window at a time, in float64."""
    top, left, bottom, right = pads
    N, C, H, W = x.shape
    sizes = []
    for size, k, s, d, b, e in ((H, kernel[0], strides[0], dilations[0], top, bottom),
                                (W, kernel[1], strides[1], dilations[1], left, right)):
        span, total = (k - 1) * d + 1, size + b + e
        out = (-(-(total - span) // s) if ceil_mode else (total - span) // s) + 1
        if ceil_mode and (out - 1) * s >= size + b:
            out -= 1
        sizes.append(out)
    y = np.empty((N, C) + tuple(sizes))
    for oh in range(sizes[0]):
        for ow in range(sizes[1]):
            rows = [oh * strides[0] + i * dilations[0] - top for i in range(kernel[0])]
            cols = [ow * strides[1] + j * dilations[1] - left for j in range(kernel[1])]
            inside = [(r, c) for r in rows for c in cols if 0 <= r < H and 0 <= c < W]
            if kind == "max":
                vals = [x[:, :, r, c] for r, c in inside]
                y[:, :, oh, ow] = (np.maximum.reduce(vals) if vals else -np.inf)
                continue
            total = sum((x[:, :, r, c].astype(np.float64) for r, c in inside),
                        np.zeros((N, C)))
            if count_pads:
                n = (sum(r < H + bottom for r in rows) * sum(c < W + right for c in cols))
            else:
                n = len(inside)
            with np.errstate(invalid="ignore"):
                y[:, :, oh, ow] = total / n if n else np.nan
    return y


CASES = [  # kernel, strides, dilations, pads, ceil_mode
    ((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), False),        # ResNet's max pool
    ((2, 3), (1, 2), (2, 1), (0, 1, 1, 0), True),
    ((3, 3), (3, 3), (1, 1), (2, 2, 2, 2), True),          # windows of padding only
    ((1, 1), (2, 2), (1, 1), (0, 0, 0, 0), False),
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooling_matches_every_window(layout, batch, threads, dtype):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 40, 29, 31)).astype(dtype)   # enough to split
    x[0, 1, 4, 5] = np.nan                                  # propagates through max and avg
    for kernel, strides, dilations, pads, ceil_mode in CASES:
        for kind, count_pads in (("max", False), ("avg", False), ("avg", True)):
            want = reference_pool(x, kernel, strides, dilations, pads, ceil_mode, kind,
                                  count_pads)
            xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
            before = xin.copy()
            with tilegemm.thread_limit(threads):
                got = pool2d(xin, kernel, strides, dilations, pads, ceil_mode, kind,
                             count_pads, layout)
            if layout == "NHWC":
                got = got.transpose(0, 3, 1, 2)
            np.testing.assert_array_equal(xin, before)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not GUARD_PAGES, reason="no mmap/mprotect guard pages here")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_pooling_stays_inside_its_arrays(layout):
    """Input against a guard page on either side, output too and inside canaries."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 7, 9)).astype(np.float32)
    for kernel, strides, dilations, pads, ceil_mode in CASES:
        for kind in ("max", "avg"):
            want = reference_pool(x, kernel, strides, dilations, pads, ceil_mode, kind, True)
            xin = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
            shape = want.shape if layout == "NCHW" else want.transpose(0, 2, 3, 1).shape
            for where in ("after", "before"):
                xg = guarded_empty(xin.shape, xin.dtype, where=where)
                xg[...] = xin
                boxed, check = canaried(shape, np.float32)
                for out in (guarded_empty(shape, np.float32, where=where), boxed):
                    got = pool2d(xg, kernel, strides, dilations, pads, ceil_mode, kind, True,
                                 layout, out=out)
                    assert got is out
                    if layout == "NHWC":
                        got = got.transpose(0, 3, 1, 2)
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
                check()
