"""matmul's shortest path: a tiny product's compiled entry point, called directly for
operands of its recorded shapes, dtypes and form (``kernels/tiny.py``).  Its results
against guard pages are checked in ``test_gemm.py``."""
import numpy as np
import pytest

import tilegemm
from tilegemm.kernels import driver, tiles


def test_the_tiny_call_path_takes_only_its_own_operands():
    """A recorded tiny product's entry point takes C-contiguous aligned 2-D operands of
    its dtypes only: a 3-D @ 1-D pair of the same four lengths, other
    dtypes (byte-swapped too), read-only, unaligned and strided operands all give
    numpy's product."""
    driver.reset_plans()
    rng = np.random.default_rng(12)
    a, b = rng.random((1, 4), np.float32), rng.random((4, 4), np.float32)
    tilegemm.matmul(rng.random((2, 4), np.float32), b)
    assert ((2, 4), (4, 4), 4) in driver.TINY_CALLS
    raw = np.zeros(2 * 4 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(2, 4)
    raw[...] = rng.random((2, 4))
    frozen = rng.random((2, 4), np.float32)
    frozen.setflags(write=False)
    cases = [(rng.random((2, 4, 4), np.float32), rng.random(4, np.float32)),
             (a, b), (rng.random((2, 4)), b), (rng.random((2, 4), np.float32).astype(">f4"), b),
             (frozen, b), (raw, b), (np.asfortranarray(rng.random((2, 4), np.float32)), b),
             (rng.random((2, 8), np.float32)[:, ::2], b)]
    # out= the recorded entry turns down: read-only, F-order, unaligned, another dtype,
    # a subclass; each still gets the product (or numpy's error for read-only).
    frozen_out = np.empty((2, 4), np.float32)
    frozen_out.setflags(write=False)
    with pytest.raises(ValueError):
        tilegemm.matmul(a[:1].repeat(2, 0), b, out=frozen_out)
    x = rng.random((2, 4), np.float32)
    raw_out = np.zeros(2 * 4 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(2, 4)
    for out in (np.empty((2, 4), np.float32, order="F"), raw_out, np.empty((2, 4)),
                np.empty((2, 4), np.float32).view(np.matrix)):
        if out.dtype == np.float64:
            with pytest.raises(TypeError):
                tilegemm.matmul(x, b, out=out)
            continue
        got = tilegemm.matmul(x, b, out=out)
        assert got is out
        np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ b, rtol=1e-5)
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
            assert ((6, k), (k, 7), np.dtype(dtype).itemsize) in driver.TINY_CALLS


def test_the_tiny_call_path_from_several_python_threads():
    driver.reset_plans()
    rng = np.random.default_rng(13)
    a, b = rng.random((8, 8), np.float32), rng.random((8, 8), np.float32)
    want = tilegemm.matmul(a, b)
    assert ((8, 8), (8, 8), 4) in driver.TINY_CALLS

    def work(i):
        for _ in range(2000):
            np.testing.assert_array_equal(tilegemm.matmul(a, b), want)

    from thread_runs import in_threads
    in_threads(work, 4)


def test_products_below_the_sharing_size_get_their_entry_and_lose_it_with_the_rule(monkeypatch):
    """A product above the never-shared size but below the sharing size is recorded
    too (it runs on one thread whatever the thread count); after the sharing size is
    lowered and the plans reset, the same product is shared again, not called at the
    recorded entry."""
    from tilegemm.ground.threads import max_threads
    from tilegemm.kernels import small
    if max_threads() < 2:
        pytest.skip("needs two threads")
    driver.reset_plans()
    rng = np.random.default_rng(15)
    a, b = rng.random((48, 48), np.float32), rng.random((48, 48), np.float32)
    assert small.NEVER_SHARED_FLOPS < 2 * 48 ** 3 <= small.one_thread_flops(a.dtype)
    want = a.astype(np.float64) @ b
    for _ in range(2):
        np.testing.assert_allclose(tilegemm.matmul(a, b), want, rtol=1e-5)
    assert ((48, 48), (48, 48), 4) in driver.TINY_CALLS
    monkeypatch.setattr(driver, "SERIAL_FLOPS", 1)
    driver.reset_plans()
    shared = []
    real_run = driver.run_native_shares
    monkeypatch.setattr(driver, "run_native_shares",
                        lambda address, blocks: (shared.append(len(blocks)), real_run(address, blocks)))
    saved = tilegemm.get_num_threads()
    tilegemm.set_num_threads(2)
    try:
        for _ in range(2):
            np.testing.assert_allclose(tilegemm.matmul(a, b), want, rtol=1e-5)
    finally:
        tilegemm.set_num_threads(saved)
    assert ((48, 48), (48, 48), 4) not in driver.TINY_CALLS
    assert shared and max(shared) == 2
    monkeypatch.undo()
    driver.reset_plans()


def test_one_call_products_past_32_take_the_gemm_tile_where_it_fits_snugly():
    """One-call products with more than ``ONE_CALL_ITEM`` rows and columns run on the
    GEMM's own (derived) tile when it pads at most a sixth of them; others keep the
    tile chosen for their shape."""
    from tilegemm.kernels import small
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        blk = driver.kernel_for(dtype)[1]
        for m, n in ((64, 64), (48, 64), (33, 40), (16, 64), (64, 8), (40, 40)):
            kern = small.small_kernel(dtype, m, n)[0]
            narrow_kern = driver.kernel_for(dtype, n)[0]
            snug = all(6 * -(-size // tile) * tile <= 7 * size
                       for size, tile in ((m, narrow_kern.mr), (n, narrow_kern.nr)))
            if min(m, n) > small.ONE_CALL_ITEM and snug and tiles.derived_tile(blk):
                assert kern is narrow_kern, (dtype, m, n)
            else:
                assert kern is tiles.item_kernel(dtype, m, n)[0], (dtype, m, n)


def test_one_call_plans_pack_large_enough_products():
    """The one-call path reads A and B in place up to ``ONE_CALL_PACKED_PANELS`` times
    NR rows or columns (or few rows) and packs them past that; both give the
    product."""
    from tilegemm.kernels import small
    rng = np.random.default_rng(16)
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        for m, k, n in ((16, 16, 16), (40, 200, 120), (150, 60, 130), (200, 30, 200),
                        (120, 130, 8), (250, 170, 200)):
            if 2 * m * n * k <= small.OWN_TILE_FLOPS:
                kern, blk = small.small_kernel(dtype, m, n)
                plan = small.one_call_plan(kern, blk, m, n, k)
                packed = min(m, n) >= small.ONE_CALL_PACKED_PANELS * kern.nr and m > 48
                assert (plan[1] > 0) == packed, (dtype, m, k, n, plan)
            else:       # past it, gemm_into's tile and plan on one thread
                kern, blk = driver.kernel_for(dtype, n)
                plan = driver.serial_plan(kern, blk, m, n, k, (n, 1))[1]
            a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
            driver.reset_plans()
            with tilegemm.thread_limit(1):
                for _ in range(2):           # the one-call path, then the recorded entry
                    np.testing.assert_allclose(tilegemm.matmul(a, b), a.astype(np.float64) @ b,
                                               rtol=1e-4, atol=1e-4 * k)
            assert driver.SMALL_CALLS[(dtype, dtype, m, n, k)][1] == plan
            if 2 * m * n * k <= small.one_thread_flops(dtype):
                assert driver.TINY_CALLS[((m, k), (k, n), dtype.itemsize)][3] == plan


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_batch_in_one_call_into_one_of_its_operands(dtype):
    """``matmul(a, b, out=a)`` and ``out=b`` on the one-call batch path (C-contiguous
    3-D and 4-D operands): the products go through a temporary, the inputs' values
    are read before ``out`` is written."""
    from tilegemm.kernels.tiny import BATCH_CALLS
    rng = np.random.default_rng(3)
    for shape in ((6, 9, 9), (2, 3, 8, 8)):
        a = rng.standard_normal(shape).astype(dtype)
        b = rng.standard_normal(shape).astype(dtype)
        want = np.matmul(a.astype(np.float64), b)
        with tilegemm.thread_limit(1):
            got = tilegemm.matmul(a, b, out=a)
            assert got is a
            np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-4)
            a2 = rng.standard_normal(shape).astype(dtype)
            want = np.matmul(a2.astype(np.float64), b)
            assert tilegemm.matmul(a2, b, out=b) is b
            np.testing.assert_allclose(b, want, rtol=1e-4, atol=1e-4)
        assert BATCH_CALLS[a.shape + b.shape + (a.itemsize,)]    # the one-call path ran


def test_wide_products_keep_the_one_call_tile_where_the_snug_tile_still_pads():
    """small_kernel's own two-vector tile for one-call products past SMALL_ITEM
    columns that are no multiple of the default NR, unless kernel_for's tile (the
    default or a snug one) covers them exactly."""
    from tilegemm.kernels import small
    from tilegemm.tuning.blocking import blocking
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        default = blocking(dtype)
        for n in range(65, 400, 7):
            kern, _ = small.small_kernel(dtype, 100, n)
            if n % kern.nr:
                assert kern.nr == 2 * default.lanes, (dtype, n, kern.name)


@pytest.mark.parametrize("n", [8, 170])
def test_a_one_call_product_into_its_own_operand(n):
    """``matmul(a, b, out=a)`` and ``out=b`` on the one-call path (from the second call
    at its recorded entry): the product goes through a temporary, copied back into
    the operand.  170x170 float64 stays below the sharing size, and its temporary
    (231 KB) is memory the allocator may hand back to the system once freed: a
    temporary freed before its copy could fault there, or read another's values."""
    rng = np.random.default_rng(16)
    b = rng.random((n, n))
    for _ in range(3):
        a = rng.random((n, n))
        want = a @ b
        assert tilegemm.matmul(a, b, out=a) is a
        np.testing.assert_allclose(a, want, rtol=1e-12)
        b2 = rng.random((n, n))
        want = b @ b2
        assert tilegemm.matmul(b, b2, out=b2) is b2
        np.testing.assert_allclose(b2, want, rtol=1e-12)
