"""The GEMM drivers and the public matmul/gemm against float64 numpy references."""
import threading

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tilegemm
from tilegemm.kernels import driver, small
from tilegemm.kernels.driver import gemm_into
from tilegemm.tuning.blocking import blocking

from conftest import assert_close, error_bound
from guard import GUARD_PAGES, guarded_empty
from thread_runs import in_threads

DTYPES = [np.float32, np.float64]
PRIMES = [1, 2, 3, 5, 7, 13, 31, 61, 67, 97, 131, 173, 257, 331]


def layout(x, kind):
    """The same values as ``x`` in another memory layout (a view where possible)."""
    if kind == "C":
        return np.ascontiguousarray(x)
    if kind == "F":
        return np.asfortranarray(x)
    if kind == "T":          # a transposed view of a C array
        return np.ascontiguousarray(x.T).T
    if kind == "neg":        # negative strides on both axes
        return np.ascontiguousarray(x[::-1, ::-1])[::-1, ::-1]
    if kind == "gap":        # every other column of a wider array
        wide = np.zeros((x.shape[0], 2 * x.shape[1] + 1), x.dtype)
        wide[:, 1::2] = x
        return wide[:, 1::2]
    raise ValueError(kind)


def ref_gemm(a, b, c0=None, alpha=1.0, beta=0.0):
    out = alpha * (a.astype(np.float64) @ b.astype(np.float64))
    if c0 is not None and beta != 0:
        out += beta * c0.astype(np.float64)
    return out


@pytest.fixture(params=[(1, "small"), (1, "packed"), (2, "small"), (2, "packed")],
                ids=["1thread-unpacked", "1thread-packed", "2threads-unpacked", "2threads-packed"])
def threads(request, monkeypatch):
    """Run with 1 or 2 Numba threads, with the unpacked path allowed or forced off."""
    count, path = request.param
    if path == "packed":
        monkeypatch.setattr(driver, "SMALL_BYTES", 0)
        driver.reset_plans()         # plans made with the unpacked path allowed
    saved = numba.get_num_threads()
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    yield count
    numba.set_num_threads(saved)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.sampled_from(PRIMES), n=st.sampled_from(PRIMES), k=st.sampled_from(PRIMES + [0, 400, 600]),
       dtype=st.sampled_from(DTYPES),
       la=st.sampled_from(["C", "F", "T", "neg", "gap"]), lb=st.sampled_from(["C", "F", "T", "neg", "gap"]),
       lc=st.sampled_from(["C", "F", "gap"]),
       alpha=st.sampled_from([1.0, -0.5, 2.0]), beta=st.sampled_from([0.0, 1.0, 0.5]))
def test_gemm_into_matches_numpy(threads, m, n, k, dtype, la, lb, lc, alpha, beta):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = layout(rng.standard_normal((m, k)).astype(dtype), la)
    b = layout(rng.standard_normal((k, n)).astype(dtype), lb)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c = layout(c0.copy(), lc)
    if beta == 0:
        c[...] = np.nan  # beta == 0 must not read C
    a_before, b_before = a.copy(), b.copy()
    gemm_into(a, b, c, alpha, beta)
    assert_close(c, ref_gemm(a, b, c0, alpha, beta),
                 2 * abs(alpha) * error_bound(a, b, k, dtype, extra=c0 if beta else None),
                 f"m={m} n={n} k={k} {np.dtype(dtype).name} layouts a={la} b={lb} c={lc} "
                 f"alpha={alpha} beta={beta} threads={threads}")
    assert np.array_equal(a, a_before) and np.array_equal(b, b_before), "inputs were modified"


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_spanning_several_kc_blocks(threads, dtype, rng):
    KC = blocking(dtype).kc
    for k in (KC - 1, KC, KC + 1, 3 * KC + 7):
        a = rng.standard_normal((37, k)).astype(dtype)
        b = rng.standard_normal((k, 131)).astype(dtype)
        c0 = rng.standard_normal((37, 131)).astype(dtype)
        c = c0.copy()
        gemm_into(a, b, c, 1.0, 0.5)
        assert_close(c, ref_gemm(a, b, c0, 1.0, 0.5), 2 * error_bound(a, b, k, dtype, extra=c0),
                     f"k={k} KC={KC}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_strides(dtype, rng):
    row = rng.standard_normal(50).astype(dtype)
    a = np.broadcast_to(row, (40, 50))              # every row the same, row stride 0
    b = np.broadcast_to(rng.standard_normal((50, 1)).astype(dtype), (50, 70))  # column stride 0
    got = tilegemm.matmul(a, b)
    assert_close(got, ref_gemm(a, b), 2 * error_bound(a, b, 50, dtype), "zero strides")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 300, 500), (300, 1, 500), (1, 1, 777), (1, 2048, 64),
                                   (2048, 1, 64), (1, 5, 0)])
def test_vector_shapes(dtype, shape, rng):
    m, n, k = shape
    for la, lb in (("C", "C"), ("F", "T")):
        a = layout(rng.standard_normal((m, k)).astype(dtype), la)
        b = layout(rng.standard_normal((k, n)).astype(dtype), lb)
        c0 = rng.standard_normal((m, n)).astype(dtype)
        c = c0.copy()
        gemm_into(a, b, c, 2.0, 0.5)
        assert_close(c, ref_gemm(a, b, c0, 2.0, 0.5), 4 * error_bound(a, b, k, dtype, extra=c0),
                     f"shape={shape} layouts={la},{lb}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_projection(dtype):
    """A large product checked in O(n^2): C t against alpha A (B t) + beta C0 t."""
    rng = np.random.default_rng(7)
    m, n, k = 1537, 1283, 1031
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c = c0.copy()
    tilegemm.gemm(a, b, c, alpha=0.75, beta=-1.25)
    t = rng.standard_normal((n, 3))
    lhs = c.astype(np.float64) @ t
    rhs = 0.75 * (a.astype(np.float64) @ (b.astype(np.float64) @ t)) - 1.25 * (c0.astype(np.float64) @ t)
    scale = (np.abs(a).astype(np.float64) @ (np.abs(b).astype(np.float64) @ np.abs(t))
             + np.abs(c0).astype(np.float64) @ np.abs(t))
    assert_close(lhs, rhs, 8 * k * np.finfo(dtype).eps * scale, f"projection {m}x{n}x{k}")


# ---------------------------------------------------------------- matmul semantics

@pytest.mark.parametrize("sa,sb", [
    ((5,), (5,)), ((5,), (5, 3)), ((4, 5), (5,)), ((2, 4, 5), (5, 3)), ((4, 5), (3, 5, 2)),
    ((2, 1, 4, 5), (3, 5, 6)), ((0, 4, 5), (5, 3)), ((4, 0), (0, 3)), ((3, 4, 5), (3, 5, 2)),
])
@pytest.mark.parametrize("da,db", [(np.float32, np.float32), (np.float64, np.float64),
                                   (np.float32, np.float64)])
def test_matmul_numpy_semantics(sa, sb, da, db, rng):
    a = rng.standard_normal(sa).astype(da)
    b = rng.standard_normal(sb).astype(db)
    expected = np.matmul(a, b)
    got = tilegemm.matmul(a, b)
    assert type(got) is type(expected)
    assert np.shape(got) == np.shape(expected) and np.result_type(got) == np.result_type(expected)
    eps = np.finfo(np.result_type(da, db)).eps
    k = sa[-1]
    scale = np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64))
    assert np.all(np.abs(np.asarray(got, np.float64) - expected) <= 4 * max(k, 1) * eps * scale + 1e-30)


def test_matmul_out_and_overlap(rng):
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    expected = a.astype(np.float64) @ b
    out = np.empty((64, 64), np.float32)
    assert tilegemm.matmul(a, b, out=out) is out
    assert_close(out, expected, error_bound(a, b, 64, np.float32) * 2, "out=")
    a2 = a.copy()
    res = tilegemm.matmul(a2, b, out=a2)       # out is the left operand itself
    assert res is a2
    assert_close(a2, expected, error_bound(a, b, 64, np.float32) * 2, "out aliases a")
    b2 = b.copy()
    tilegemm.matmul(a, b2, out=b2[:, :])       # a view of the right operand
    assert_close(b2, expected, error_bound(a, b, 64, np.float32) * 2, "out aliases b")


def test_gemm_blas_semantics(rng):
    a = rng.standard_normal((30, 20))
    b = rng.standard_normal((40, 30))
    c0 = rng.standard_normal((20, 40))
    c = c0.copy()
    res = tilegemm.gemm(a, b, c, alpha=-2.0, beta=0.25, trans_a=True, trans_b=True)
    assert res is c
    assert_close(c, -2.0 * (a.T @ b.T) + 0.25 * c0, 1e-12 * 30 * 4 + 1e-12, "gemm trans")
    new = tilegemm.gemm(a.T, b.T)
    assert_close(new, a.T @ b.T, 1e-12 * 30 * 4, "gemm new c")
    c[...] = np.nan
    tilegemm.gemm(a, b, c, beta=0.0, trans_a=True, trans_b=True)
    assert not np.isnan(c).any(), "beta=0 let NaN from C through"
    # C overlapping an input
    sq = rng.standard_normal((16, 16))
    expected = sq @ sq + sq
    tilegemm.gemm(sq, sq, sq, beta=1.0)
    assert_close(sq, expected, 1e-12 * 16 * 8, "gemm with c aliasing a and b")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_propagate_like_numpy(dtype, rng):
    for m, n, k in ((7, 5, 3), (70, 130, 200), (1, 40, 9), (40, 1, 9)):
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        a[0, 0] = np.nan
        a[-1, -1] = np.inf
        b[0, -1] = -np.inf
        b[k // 2, 0] = 0.0
        expected = np.matmul(a, b)
        got = tilegemm.matmul(a, b)
        assert np.array_equal(np.isnan(got), np.isnan(expected)), (m, n, k)
        assert np.array_equal(np.isposinf(got), np.isposinf(expected)), (m, n, k)
        assert np.array_equal(np.isneginf(got), np.isneginf(expected)), (m, n, k)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad", [np.arange(6).reshape(2, 3), np.ones((2, 3), np.complex128),
                                 np.ones((2, 3), np.float16), np.ones((2, 3), bool)])
def test_unsupported_dtypes_raise_type_error(bad):
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.matmul(bad, np.ones((3, 2)))
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.gemm(np.ones((2, 3)), bad.T)


def test_shape_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        tilegemm.matmul(np.ones((2, 3)), np.ones((4, 5)))
    with pytest.raises(ValueError, match="broadcast"):
        tilegemm.matmul(np.ones((2, 2, 3)), np.ones((3, 3, 4)))
    with pytest.raises(ValueError, match="1-D"):
        tilegemm.matmul(np.float64(3.0), np.ones(3))
    with pytest.raises(ValueError, match="2-D"):
        tilegemm.gemm(np.ones(3), np.ones((3, 2)))
    with pytest.raises(ValueError, match="inner"):
        tilegemm.gemm(np.ones((2, 3)), np.ones((2, 3)))


def test_bad_out_and_scalars():
    a, b = np.ones((4, 5)), np.ones((5, 6))
    with pytest.raises(ValueError, match="shape"):
        tilegemm.matmul(a, b, out=np.empty((6, 4)))
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.matmul(a, b, out=np.empty((4, 6), np.float32))
    ro = np.empty((4, 6))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tilegemm.matmul(a, b, out=ro)
    with pytest.raises(TypeError, match="ndarray"):
        tilegemm.matmul(a, b, out=[[0.0] * 6] * 4)
    with pytest.raises(TypeError, match="alpha"):
        tilegemm.gemm(a, b, alpha="2")
    with pytest.raises(TypeError, match="beta"):
        tilegemm.gemm(a, b, np.zeros((4, 6)), beta=1j)
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.gemm(a, b, np.zeros((4, 6), np.float32))


def test_read_only_inputs_are_fine(rng):
    a = rng.standard_normal((50, 60))
    b = rng.standard_normal((60, 70))
    a.flags.writeable = False
    b.flags.writeable = False
    assert_close(tilegemm.matmul(a, b), a @ b, 1e-12 * 60 * 4, "read-only inputs")


# ---------------------------------------------------------------- concurrency

def test_concurrent_calls_from_python_threads():
    """Several Python threads calling at once: parallel and serial paths, all correct, no abort."""
    rng = np.random.default_rng(3)
    problems = []
    for i in range(8):
        n = (300, 33, 1, 257)[i % 4]
        dtype = DTYPES[i % 2]
        a = rng.standard_normal((n, 211)).astype(dtype)
        b = rng.standard_normal((211, 190)).astype(dtype)
        problems.append((a, b, a.astype(np.float64) @ b))
    errors = []

    def worker(a, b, expected):
        try:
            for _ in range(5):
                got = tilegemm.matmul(a, b)
                bound = 4 * 211 * np.finfo(a.dtype).eps * (np.abs(a) @ np.abs(b)).astype(np.float64)
                if not np.all(np.abs(got - expected) <= bound):
                    errors.append(f"wrong result for {a.shape} {a.dtype}")
        except Exception as exc:  # reported below: a thread's exception would otherwise vanish
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=p) for p in problems]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 32, 20000), (7, 40, 9000), (1, 3000, 3000), (3000, 1, 3000),
                                   (300, 700, 200), (700, 300, 200), (60, 2000, 100),
                                   (400, 1000, 1100), (3000, 40, 300)])
@pytest.mark.parametrize("epi_name", ["none", "bias_row_relu", "bias_col_relu6"])
def test_threaded_splits_with_epilogue(dtype, shape, epi_name, rng, monkeypatch):
    """Two threads: B packed once and shared, split over rows, columns or k (small C,
    long k), GEMV split, fused epilogue."""
    from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6
    monkeypatch.setattr(driver, "SERIAL_FLOPS", 1)  # share even these small products
    splits = []
    real_route, real_run = driver.route, driver.run_native_shares

    def recorded_route(*args):
        path = real_route(*args)
        splits.append(path)
        return path

    monkeypatch.setattr(driver, "route", recorded_route)
    monkeypatch.setattr(driver, "run_native_shares",
                        lambda address, blocks: (splits.append(len(blocks)),
                                                 real_run(address, blocks)))
    m, n, k = shape
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    epi, bias = 0, None
    ref = ref_gemm(a, b, c0, 1.5, 0.5)
    if epi_name == "bias_row_relu":
        epi, bias = EPI_BIAS_ROW | EPI_RELU, rng.standard_normal(m).astype(dtype)
        ref = np.maximum(ref + bias[:, None], 0)
    elif epi_name == "bias_col_relu6":
        epi, bias = EPI_BIAS_COL | EPI_RELU6, rng.standard_normal(n).astype(dtype)
        ref = np.clip(ref + bias[None, :], 0, 6)
    c = c0.copy()
    gemm_into(a, b, c, 1.5, 0.5, bias, epi, threads=2)
    assert 2 in splits, "the product was not shared between two threads"
    kern, _ = driver.kernel_for(np.dtype(dtype), n)
    few_tiles = k >= 2 * driver.SPLIT_K_MIN and (-(-m // kern.mr) * -(-n // kern.nr) < 4
                                                 or k >= driver.SPLIT_K_DEPTH * max(m, n))
    assert ("split_k" in splits) == few_tiles, \
        "k is split exactly when it is long and C has too few tiles or is far shorter than k"
    kern, blk = driver.kernel_for(np.dtype(dtype), n)
    shared = (not few_tiles and min(m, n) > 1 and m / kern.mr >= n / kern.nr and n > kern.nr
              and k * -(-n // kern.nr) * kern.nr <= blk.kc * blk.nc and not driver.own_b_panels())
    assert ("shared_b" in splits) == shared, \
        "B is shared exactly when it is the larger side, fits, C has several columns of tiles" \
        " and the L2 is small"
    extra = np.abs(c0) + (0 if bias is None else np.abs(bias).max())
    assert_close(c, ref, 4 * error_bound(a, b, k, dtype, extra=extra), f"{shape} {epi_name} threads=2")


def test_destination_with_strides_between_elements(rng):
    """A C whose row stride is not a whole number of elements still receives the result."""
    a = rng.standard_normal((7, 5)).astype(np.float32)
    b = rng.standard_normal((5, 9)).astype(np.float32)
    buf = np.zeros(7 * 40 + 8, np.uint8)
    c = np.ndarray((7, 9), np.float32, buffer=buf, strides=(38, 4))
    c[...] = 1
    tilegemm.gemm(a, b, c, beta=1.0)
    assert_close(c, a.astype(np.float64) @ b + 1, 2 * error_bound(a, b, 5, np.float32, extra=1.0),
                 "gemm into odd strides")
    out = np.ndarray((7, 9), np.float32, buffer=buf, strides=(38, 4))
    tilegemm.matmul(a, b, out=out)
    assert_close(out, a.astype(np.float64) @ b, 2 * error_bound(a, b, 5, np.float32), "matmul out")


def test_subclasses_and_flags(rng):
    a = rng.standard_normal((4, 4))
    m = np.matrix(a)
    assert_close(tilegemm.matmul(m, m), a @ a, 1e-12 * 16, "np.matrix operands")
    c = np.matrix(np.zeros((4, 4)))
    tilegemm.gemm(a, a, c)
    assert_close(np.asarray(c), a @ a, 1e-12 * 16, "np.matrix destination")
    with pytest.raises(TypeError, match="masked"):
        tilegemm.matmul(np.ma.masked_array(a, mask=a > 0), a)
    with pytest.raises(TypeError, match="trans_a"):
        tilegemm.gemm(a, a, trans_a="N")
    with pytest.raises(ValueError, match="too large"):
        tilegemm.gemm(a, a, alpha=10 ** 400)
    with pytest.raises(ValueError, match="too large"):
        tilegemm.gemm(a.astype(np.float32), a.astype(np.float32), alpha=1e300)
    with pytest.raises(TypeError, match="gemm: c has dtype"):
        tilegemm.gemm(a, a, np.zeros((4, 4), np.float32))


def test_unpacked_path_needs_b_rows_spread_over_l1_sets():
    """B read in place down a column of tiles must stay in L1: rows 1 KiB apart share
    L1's sets every 4 rows, so only (L1 / 4 KiB ways) x 4 of them fit."""
    from tilegemm.tuning.machine import detect
    kern, _ = driver.kernel_for(np.dtype(np.float32), 256)
    rows = detect().l1d_bytes // 4096 * 4
    assert driver.fits_unpacked(kern, 64, 256, rows, 256)
    assert not driver.fits_unpacked(kern, 64, 256, rows + 8, 256)
    # 300 floats (1200 bytes) apart: the same sets only every 256 rows.
    assert driver.fits_unpacked(kern, 64, 300, rows + 8, 300)
    # A few rows of C re-read the panel a few times only.
    assert driver.fits_unpacked(kern, driver.UNPACKED_FEW_ROWS, 256, rows + 8, 256)


def test_unpacked_path_counts_b_per_k_block():
    """A long k does not keep the unpacked path away: only a KC block of B must fit,
    and with few rows of C not even that (B is read once either way)."""
    from tilegemm.tuning.machine import detect
    kern, _ = driver.kernel_for(np.dtype(np.float32), 32)
    assert driver.fits_unpacked(kern, 32, 32, 32768, 32)
    rows = driver.STREAM_ROWS + kern.mr
    assert not driver.fits_unpacked(kern, rows, 4096, 32768, 4096)   # its KC block does not fit
    assert driver.fits_unpacked(kern, driver.UNPACKED_FEW_ROWS, 4096, 32768, 4096)
    # Streaming B, the k block is cut so that a B panel keeps to a third of L1.
    kc = driver.unpacked_kc(kern, driver.STREAM_ROWS, 4096, 32768)
    assert kc * kern.nr * kern.dtype.itemsize <= max(detect().l1d_bytes // 3, 16 * kern.nr * 4)
    assert driver.unpacked_kc(kern, rows, 64, 32768) == driver.UNPACKED_KC
    assert driver.unpacked_kc(kern, driver.STREAM_ROWS, 4096, 10) == 10


@pytest.mark.parametrize("a_shape, b_shape", [
    ((2, 3, 0), (0, 4)), ((2, 3, 5), (5, 0)), ((0, 3, 5), (5, 4)), ((2, 0, 5), (5, 4)),
    ((2, 3, 0), (2, 0, 4)), ((3, 0), (2, 0, 4)), ((0,), (0,)), ((0,), (2, 0, 3)),
    ((2, 1, 3, 0), (4, 0, 2))])
def test_batched_matmul_with_an_empty_dimension(a_shape, b_shape):
    """Empty m, n, k or batch dimensions give numpy's result (zeros or an empty
    array); ``(2,3,0) @ (0,4)`` once raised from a reshape."""
    a = np.ones(a_shape, np.float32)
    b = np.ones(b_shape, np.float32)
    got = tilegemm.matmul(a, b)
    expected = np.matmul(a, b)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 1, 2), (5, 7, 3), (16, 16, 16), (37, 29, 41), (70, 30, 90),
                                   (24, 24, 40), (150, 60, 130), (200, 30, 200), (250, 170, 200)])
def test_small_call_fast_path_against_guard_pages(dtype, shape):
    """matmul's shortest path (small C-contiguous products, the jitted call looked up
    by shape): taken from the second product of a shape on, right, inputs untouched,
    no read past operands that end or start at a guard page, nor a write past an
    ``out=`` placed the same way; an ``out=`` overlapping an operand gets the product
    too.  On one thread, so that every shape here takes the one-call path."""
    m, k, n = shape
    rng = np.random.default_rng(11)
    a_vals, b_vals = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    expected = a_vals.astype(np.float64) @ b_vals
    driver.reset_plans()
    with tilegemm.thread_limit(1):
        _small_calls_against_guard_pages(dtype, (m, k, n), a_vals, b_vals, expected)


def _small_calls_against_guard_pages(dtype, shape, a_vals, b_vals, expected):
    m, k, n = shape
    for where in ("after", "before"):
        a = guarded_empty((m, k), dtype, where=where)
        b = guarded_empty((k, n), dtype, where=where)
        a[...], b[...] = a_vals, b_vals
        out = guarded_empty((m, n), dtype, where=where)
        for call in range(2):
            got = tilegemm.matmul(a, b)
            assert got.dtype == dtype and got.shape == (m, n)
            assert_close(got, expected, error_bound(a_vals, b_vals, k, dtype),
                         f"{shape} {where} call {call}")
            assert (np.dtype(dtype), np.dtype(dtype), m, n, k) in driver.SMALL_CALLS
            # those on one thread whatever the thread count, from the second call on:
            # the compiled entry point itself
            assert (((m, k), (k, n), np.dtype(dtype).itemsize) in driver.TINY_CALLS) == (
                2 * m * n * k <= small.one_thread_flops(np.dtype(dtype)))
            out[...] = np.nan
            assert tilegemm.matmul(a, b, out=out) is out
            assert_close(out, expected, error_bound(a_vals, b_vals, k, dtype),
                         f"{shape} {where} out= call {call}")
        assert np.array_equal(a, a_vals) and np.array_equal(b, b_vals)
    if k == n:
        # out= is the operand itself: the product goes through a temporary first.
        a = a_vals.copy()
        assert tilegemm.matmul(a, b, out=a) is a
        assert_close(a, expected, error_bound(a_vals, b_vals, k, dtype), f"{shape} out=a")
    if m == k:
        b = b_vals.copy()
        assert tilegemm.matmul(a_vals, b, out=b) is b
        assert_close(b, expected, error_bound(a_vals, b_vals, k, dtype), f"{shape} out=b")


# --------------------------------------------------------------------------- matrix-vector

# (1030, 520), (3, 180000): big enough to be shared among threads (GEMV_SERIAL_ELEMENTS).
MATVEC_SHAPES = [(1, 1), (3, 5), (4, 16), (7, 33), (37, 129), (130, 67), (600, 1), (1030, 520),
                 (3, 180000)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", MATVEC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matvec_and_vecmat_take_the_short_path(monkeypatch, dtype, shape):
    """``A @ x`` and ``x @ A`` with a C-contiguous matrix and contiguous vectors go
    straight to ``matvec_into`` (no batch broadcasting), right, inputs untouched."""
    import tilegemm.api as api
    calls = []
    real = api.matvec_into
    monkeypatch.setattr(api, "matvec_into", lambda *args: calls.append(args[3]) or real(*args))
    rng = np.random.default_rng(5)
    m, k = shape
    A = rng.standard_normal((m, k)).astype(dtype)
    x, z = rng.standard_normal(k).astype(dtype), rng.standard_normal(m).astype(dtype)
    A0, x0, z0 = A.copy(), x.copy(), z.copy()
    got = tilegemm.matmul(A, x)
    assert got.shape == (m,) and got.dtype == dtype
    assert_close(got, A.astype(np.float64) @ x, error_bound(A, x[:, None], k, dtype)[:, 0], "A @ x")
    got = tilegemm.matmul(z, A)
    assert got.shape == (k,) and got.dtype == dtype
    assert_close(got, z.astype(np.float64) @ A, error_bound(z[None], A, m, dtype)[0], "x @ A")
    # 2-D: one column of B, one row of A (the same products, 2-D results).
    got = tilegemm.matmul(A, x[:, None])
    assert got.shape == (m, 1)
    assert_close(got[:, 0], A.astype(np.float64) @ x, error_bound(A, x[:, None], k, dtype)[:, 0],
                 "A @ x[:, None]")
    got = tilegemm.matmul(z[None], A)
    assert got.shape == (1, k)
    assert_close(got[0], z.astype(np.float64) @ A, error_bound(z[None], A, m, dtype)[0], "x[None] @ A")
    assert len(calls) == 4 and calls[:2] == [False, True]   # (1 x k) @ (k x 1) may take either
    out = np.full(m, np.nan, dtype)
    assert tilegemm.matmul(A, x, out=out) is out
    assert_close(out, A.astype(np.float64) @ x, error_bound(A, x[:, None], k, dtype)[:, 0], "out=")
    out = np.full((1, k), np.nan, dtype)
    assert tilegemm.matmul(z[None], A, out=out) is out
    assert_close(out[0], z.astype(np.float64) @ A, error_bound(z[None], A, m, dtype)[0], "2-D out=")
    if k > 1:
        with pytest.raises(ValueError, match="shape"):
            tilegemm.matmul(z[None], A, out=np.empty((k, 1), dtype))   # same size, wrong shape
    assert np.array_equal(A, A0) and np.array_equal(x, x0) and np.array_equal(z, z0)


def test_matvec_other_layouts_and_overlap_take_the_general_path(monkeypatch):
    import tilegemm.api as api
    monkeypatch.setattr(api, "matvec_into", lambda *args: pytest.fail("short path taken"))
    rng = np.random.default_rng(6)
    A = rng.standard_normal((40, 40)).astype(np.float32)
    x = rng.standard_normal(80).astype(np.float32)
    bound = error_bound(A, x[:40, None], 40, np.float32)[:, 0]
    assert_close(tilegemm.matmul(A, x[::2]), A.astype(np.float64) @ x[::2],
                 error_bound(A, x[::2, None], 40, np.float32)[:, 0], "strided x")
    assert_close(tilegemm.matmul(A.T, x[:40]), A.T.astype(np.float64) @ x[:40],
                 error_bound(A.T, x[:40, None], 40, np.float32)[:, 0], "transposed A")
    y = x[:40].copy()
    expected = A.astype(np.float64) @ y
    assert tilegemm.matmul(A, y, out=y) is y          # out= is the vector itself
    assert_close(y, expected, bound, "out=x")
    with pytest.raises(ValueError, match="not aligned"):
        tilegemm.matmul(A, x)
    with pytest.raises(TypeError):
        tilegemm.matmul(A, x[:40].astype(np.float16))


def test_matvec_propagates_nan_and_inf():
    A = np.ones((5, 20), np.float32)
    x = np.ones(20, np.float32)
    A[1, 3], A[2, 19], x[7] = np.nan, np.inf, 1.0
    got, expected = tilegemm.matmul(A, x), A @ x
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert np.array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (37, 129), (130, 67), (1030, 520)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matvec_against_guard_pages(dtype, shape):
    """No read past the matrix or the vector, no write past ``out``, when each ends
    (or starts) at a guard page (1030 x 520: shared among threads, each part of
    ``out`` its share's scratch)."""
    m, k = shape
    rng = np.random.default_rng(7)
    a_vals, x_vals = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal(k).astype(dtype)
    z_vals = rng.standard_normal(m).astype(dtype)
    for where in ("after", "before"):
        A = guarded_empty((m, k), dtype, where=where)
        x, z = guarded_empty((k,), dtype, where=where), guarded_empty((m,), dtype, where=where)
        A[...], x[...], z[...] = a_vals, x_vals, z_vals
        out_m, out_k = guarded_empty((m,), dtype, where=where), guarded_empty((k,), dtype, where=where)
        assert tilegemm.matmul(A, x, out=out_m) is out_m
        assert_close(out_m, a_vals.astype(np.float64) @ x_vals,
                     error_bound(a_vals, x_vals[:, None], k, dtype)[:, 0], f"A @ x {where}")
        assert tilegemm.matmul(z, A, out=out_k) is out_k
        assert_close(out_k, z_vals.astype(np.float64) @ a_vals,
                     error_bound(z_vals[None], a_vals, m, dtype)[0], f"x @ A {where}")
        row = guarded_empty((1, k), dtype, where=where)     # 2-D: one row of A
        assert tilegemm.matmul(z.reshape(1, m), A, out=row) is row
        assert_close(row[0], z_vals.astype(np.float64) @ a_vals,
                     error_bound(z_vals[None], a_vals, m, dtype)[0], f"x[None] @ A {where}")


@pytest.mark.parametrize("shape", [(300, 200), (1030, 520)], ids=lambda s: "x".join(map(str, s)))
def test_matvec_from_several_python_threads(shape):
    rng = np.random.default_rng(8)
    A = rng.standard_normal(shape).astype(np.float32)
    xs = [rng.standard_normal(shape[1]).astype(np.float32) for _ in range(8)]
    expected = [A.astype(np.float64) @ x for x in xs]

    def work(i):
        for _ in range(50):
            assert np.allclose(tilegemm.matmul(A, xs[i]), expected[i], rtol=1e-4, atol=1e-2)

    in_threads(work, 8)
