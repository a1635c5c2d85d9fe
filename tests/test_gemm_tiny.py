"""matmul's shortest path: a tiny product's compiled entry point, called directly for
operands of its recorded shapes, dtypes and form (``kernels/tiny.py``).  Its results
against guard pages are checked in ``test_gemm.py``."""
import numpy as np

import tilegemm
from tilegemm.kernels import driver


def test_the_tiny_call_path_takes_only_its_own_operands():
    """A recorded tiny product's entry point takes C-contiguous aligned 2-D operands of
    its dtypes only: a 3-D @ 1-D pair whose shapes concatenate to the same key, other
    dtypes (byte-swapped too), read-only, unaligned and strided operands all give
    numpy's product."""
    driver.reset_plans()
    rng = np.random.default_rng(12)
    a, b = rng.random((1, 4), np.float32), rng.random((4, 4), np.float32)
    tilegemm.matmul(rng.random((2, 4), np.float32), b)
    assert (2, 4, 4, 4, 4) in driver.TINY_CALLS
    raw = np.zeros(2 * 4 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(2, 4)
    raw[...] = rng.random((2, 4))
    frozen = rng.random((2, 4), np.float32)
    frozen.setflags(write=False)
    cases = [(rng.random((2, 4, 4), np.float32), rng.random(4, np.float32)),
             (a, b), (rng.random((2, 4)), b), (rng.random((2, 4), np.float32).astype(">f4"), b),
             (frozen, b), (raw, b), (np.asfortranarray(rng.random((2, 4), np.float32)), b),
             (rng.random((2, 8), np.float32)[:, ::2], b)]
    for x, y in cases:
        want = np.matmul(x.astype(np.float64), y.astype(np.float64))
        got = tilegemm.matmul(x, y)
        assert got.shape == want.shape
        assert got.dtype == np.result_type(x.dtype, y.dtype).newbyteorder("=")
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_every_tiny_product_gets_its_entry():
    """Products of one m x n and another k, or another dtype, are recorded too (the
    one-call path found by shape records them), each dtype its own entry."""
    driver.reset_plans()
    rng = np.random.default_rng(14)
    for dtype in (np.float32, np.float64, np.float32):
        for k in (3, 5):
            a, b = rng.random((6, k)).astype(dtype), rng.random((k, 7)).astype(dtype)
            for _ in range(2):
                np.testing.assert_allclose(tilegemm.matmul(a, b), a @ b, rtol=1e-5)
            assert (6, k, k, 7, np.dtype(dtype).itemsize) in driver.TINY_CALLS


def test_the_tiny_call_path_from_several_python_threads():
    driver.reset_plans()
    rng = np.random.default_rng(13)
    a, b = rng.random((8, 8), np.float32), rng.random((8, 8), np.float32)
    want = tilegemm.matmul(a, b)
    assert (8, 8, 8, 8, 4) in driver.TINY_CALLS

    def work(i):
        for _ in range(2000):
            np.testing.assert_array_equal(tilegemm.matmul(a, b), want)

    from thread_runs import in_threads
    in_threads(work, 4)
