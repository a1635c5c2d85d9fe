"""Layout conversions of tensors with few channels (the jitted planes-at-a-time copies
of ``net/reorder.py``): every channel count they serve, both directions, one and two
threads, batches, and guard pages around input and output; and those whose moving
axes all have length 1 (one copy)."""
import numba
import numpy as np
import pytest

from guard import GUARD_PAGES, guarded_empty
from tilegemm.net.layers import convert
from tilegemm.net.reorder import MAX_CHANNELS


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_few_channels_convert_both_ways(dtype, threads):
    rng = np.random.default_rng(3)
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        # (3, 1, 4, 9), (4, 2, 1, 1) and (2, 600, 1, 1): only axes of length 1 move,
        # the values keep their order (one copy)
        for shape in [(1, 3, 7, 5), (3, 1, 4, 9), (2, MAX_CHANNELS, 6, 6),
                      (2, MAX_CHANNELS + 1, 5, 3), (4, 2, 1, 1), (0, 3, 2, 2), (2, 600, 1, 1)]:
            x = (rng.standard_normal(shape) * 100).astype(dtype)
            nhwc = convert(x, "NCHW", "NHWC")
            np.testing.assert_array_equal(nhwc, x.transpose(0, 2, 3, 1))
            assert nhwc.flags.c_contiguous and not np.shares_memory(nhwc, x)
            np.testing.assert_array_equal(convert(nhwc, "NHWC", "NCHW"), x)
    finally:
        numba.set_num_threads(saved)


@pytest.mark.skipif(not GUARD_PAGES, reason="no mmap/mprotect guard pages here")
@pytest.mark.parametrize("where", ["before", "after"])
def test_few_channels_stay_inside_their_arrays(where):
    x = guarded_empty((2, 3, 5, 7), np.float32, where=where)
    x[...] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    out = guarded_empty((2, 5, 7, 3), np.float32, where=where)
    assert convert(x, "NCHW", "NHWC", out) is out
    np.testing.assert_array_equal(out, x.transpose(0, 2, 3, 1))
    back = guarded_empty((2, 3, 5, 7), np.float32, where=where)
    assert convert(out, "NHWC", "NCHW", back) is back
    np.testing.assert_array_equal(back, x)
