"""quantize / dequantize, and qmatmul's contracts: the overflow bound, errors, memory, threads.

Exactness over generated shapes and layouts is in ``test_fuzz_int8.py``.
"""

import numpy as np
import pytest
from guard import GUARD_PAGES, guarded_empty
from thread_runs import in_threads

import tilegemm
from tilegemm.conv.quant import overflow_bound


def _int64_product(a, b, za=0, zb=0):
    return (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)


# --------------------------------------------------------------------------- quantize

def test_quantize_int8_is_symmetric_rounds_half_to_even_and_saturates():
    x = np.array([-254.0, -1.0, 0.0, 1.0, 3.0, 5.0, 254.0], np.float32)
    q, scale = tilegemm.quantize(x)
    assert q.dtype == np.int8 and scale.shape == () and scale == np.float32(2.0)
    # 1/2 and 5/2 round to the even 0 and 2; 3/2 to 2; +-127 at the ends.
    assert q.tolist() == [-127, 0, 0, 0, 2, 2, 127]


def test_quantize_per_channel_and_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5)) * np.array([1, 10, 100])[None, :, None]
    for axis in (1, -2):
        q, scale = tilegemm.quantize(x, axis=axis)
        assert scale.shape == (3,) and scale.dtype == np.float64
        np.testing.assert_allclose(scale, np.abs(x).max(axis=(0, 2)) / 127)
        back = tilegemm.dequantize(q, scale, axis=axis)
        assert back.dtype == np.float64
        assert (np.abs(back - x) <= scale[None, :, None] / 2 * (1 + 1e-12)).all()


def test_quantize_uint8_is_affine_with_a_zero_point():
    x = np.array([-1.0, 0.0, 0.5, 3.0], np.float32)
    q, scale, zp = tilegemm.quantize(x, dtype=np.uint8)
    assert q.dtype == np.uint8 and zp.dtype == np.int32
    assert scale == np.float32(4.0 / 255) and int(zp) == 64       # round(255 / 4)
    assert q[1] == zp and q[0] == 0 and q[3] == 255
    assert np.abs(tilegemm.dequantize(q, scale, zp) - x).max() <= scale / 2 * 1.0001
    q, scale, zp = tilegemm.quantize(np.array([2.0, 3.0]), dtype=np.uint8)   # all positive
    assert int(zp) == 0 and q[1] == 255


def test_quantize_zeros_and_empty_tensors():
    q, scale = tilegemm.quantize(np.zeros((2, 3), np.float32), axis=0)
    assert (q == 0).all() and (scale == 1).all()
    q, scale = tilegemm.quantize(np.zeros((0, 3), np.float32), axis=1)
    assert q.shape == (0, 3) and scale.shape == (3,)


def test_quantize_and_dequantize_reject_bad_input():
    with pytest.raises(ValueError, match="NaN or infinite"):
        tilegemm.quantize(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        tilegemm.quantize(np.array([1.0, np.inf]))
    with pytest.raises(TypeError, match="float32"):
        tilegemm.quantize(np.array([1, 2]))
    with pytest.raises(TypeError, match="int8 or uint8"):
        tilegemm.quantize(np.ones(3), dtype=np.int16)
    with pytest.raises(ValueError, match="axis 2"):
        tilegemm.quantize(np.ones((2, 2)), axis=2)
    q = np.ones((2, 3), np.int8)
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="positive and finite"):
            tilegemm.dequantize(q, bad)
    with pytest.raises(ValueError, match="shape"):
        tilegemm.dequantize(q, np.ones(2), axis=1)
    with pytest.raises(ValueError, match="shape"):
        tilegemm.dequantize(q, np.ones(3))                 # per channel needs an axis
    with pytest.raises(TypeError, match="int8, uint8 or int32"):
        tilegemm.dequantize(q.astype(np.float32), 1.0)
    with pytest.raises(TypeError, match="zero_point"):
        tilegemm.dequantize(q, 1.0, 0.5)


def test_dequantize_int32_accumulators_of_a_product():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 40)), rng.standard_normal((40, 6))
    (qx, sx), (qw, sw) = tilegemm.quantize(x), tilegemm.quantize(w, axis=1)
    acc = tilegemm.qmatmul(qx, qw)
    got = tilegemm.dequantize(acc, sx * sw, axis=1)
    np.testing.assert_allclose(got, (qx.astype(np.float64) * sx) @ (qw * sw), rtol=1e-12)
    assert np.abs(got - x @ w).max() < 0.1 * np.abs(x @ w).max()


# --------------------------------------------------------------------------- qmatmul contracts

@pytest.mark.parametrize("da, za, db, zb", [(np.int8, 0, np.int8, 0), (np.uint8, 0, np.uint8, 0),
                                            (np.uint8, 128, np.int8, -128),
                                            (np.int8, 127, np.uint8, 255)])
def test_overflow_bound_is_exact(da, za, db, zb):
    """At k = bound the worst-case sum still fits and is exact; one more is refused."""
    bound = overflow_bound(da, za, db, zb)
    ia, ib = np.iinfo(da), np.iinfo(db)
    a_far = ia.min if za - ia.min >= ia.max - za else ia.max     # farthest from the zero point
    b_far = ib.min if zb - ib.min >= ib.max - zb else ib.max
    a, b = np.full((1, bound), a_far, da), np.full((bound, 1), b_far, db)
    got = tilegemm.qmatmul(a, b, a_zero_point=za, b_zero_point=zb)
    want = _int64_product(a, b, za, zb)
    assert abs(int(want[0, 0])) <= 2 ** 31 - 1 and np.array_equal(got, want)
    with pytest.raises(ValueError, match=f"at most {bound}"):
        tilegemm.qmatmul(np.zeros((1, bound + 1), da), np.zeros((bound + 1, 1), db),
                         a_zero_point=za, b_zero_point=zb)


def test_qmatmul_rejects_bad_input():
    a, b = np.ones((2, 3), np.int8), np.ones((3, 4), np.int8)
    cases = [
        (TypeError, "dtype float32", dict(a=a.astype(np.float32))),
        (TypeError, "dtype int16", dict(b=b.astype(np.int16))),
        (ValueError, "range", dict(a_zero_point=128)),
        (ValueError, "range", dict(b=b.astype(np.uint8), b_zero_point=-1)),
        (TypeError, "integer", dict(a_zero_point=1.5)),
        (TypeError, "integer", dict(b_zero_point=True)),
        (ValueError, "not aligned", dict(b=np.ones((4, 4), np.int8))),
        (ValueError, "at least 1-D", dict(a=np.int8(3))),
        (ValueError, "do not broadcast", dict(a=np.ones((2, 2, 3), np.int8),
                                              b=np.ones((3, 3, 4), np.int8))),
        (TypeError, "dtype", dict(out=np.zeros((2, 4), np.int64))),
        (ValueError, "shape", dict(out=np.zeros((4, 2), np.int32))),
        (ValueError, "read-only", dict(out=np.broadcast_to(np.zeros(4, np.int32), (2, 4)))),
    ]
    for error, words, change in cases:
        kw = dict(a=a, b=b)
        kw.update(change)
        x, y = kw.pop("a"), kw.pop("b")
        with pytest.raises(error, match=words):
            tilegemm.qmatmul(x, y, **kw)


def test_qmatmul_dtypes_come_from_the_arrays_and_out_is_returned():
    got = tilegemm.qmatmul(np.array([[1, -2]], np.int8), np.array([[3], [4]], np.int8))
    assert got.tolist() == [[-5]] and got.dtype == np.int32
    with pytest.raises(TypeError, match="int64"):      # a list of ints is int64, not int8
        tilegemm.qmatmul([[1, -2]], np.array([[3], [4]], np.int8))
    out = np.zeros((1, 1), np.int32)
    assert tilegemm.qmatmul(np.array([[1, 2]], np.uint8), np.array([[3], [4]], np.uint8),
                            out=out, a_zero_point=1) is out
    assert out[0, 0] == 4


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 65, 13), (13, 129, 389), (13, 65, 392),
                                   (37, 65, 2100)], ids=lambda s: "x".join(map(str, s)))
def test_qmatmul_against_guard_pages(shape):
    """No read past A or B and no write past C when each ends (or starts) at a guard page
    (k = 392: a uint8 A is read in place by the VNNI tile, its last rows included;
    37 x 65 x 2100: AMX tiles where the host has them, k over two blocks)."""
    m, n, k = shape
    rng = np.random.default_rng(4)
    for da, db in [(np.int8, np.int8), (np.uint8, np.uint8)]:
        a_vals = rng.integers(np.iinfo(da).min, np.iinfo(da).max + 1, (m, k)).astype(da)
        b_vals = rng.integers(np.iinfo(db).min, np.iinfo(db).max + 1, (k, n)).astype(db)
        for where in ("after", "before"):
            a, b = guarded_empty((m, k), da, where=where), guarded_empty((k, n), db, where=where)
            out = guarded_empty((m, n), np.int32, where=where)
            a[...], b[...] = a_vals, b_vals
            assert tilegemm.qmatmul(a, b, out=out, a_zero_point=3, b_zero_point=5) is out
            assert np.array_equal(out, _int64_product(a_vals, b_vals, 3, 5)), (da, where)


def test_qmatmul_from_several_python_threads():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (70, 300)).astype(np.uint8)
    bs = [rng.integers(-128, 128, (300, 90)).astype(np.int8) for _ in range(6)]
    want = [_int64_product(a, b, 7) for b in bs]

    def work(i):
        for _ in range(10):
            assert np.array_equal(tilegemm.qmatmul(a, bs[i], a_zero_point=7), want[i])

    in_threads(work, 6)


@pytest.mark.parametrize("shape", [(520, 130, 520), (130, 520, 520)], ids=["rows", "columns"])
def test_qmatmul_shared_among_threads_is_exact(shape):
    """Products past SHARE_OPS go to several threads, by rows or by columns."""
    m, n, k = shape
    rng = np.random.default_rng(6)
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(0, 256, (k, n)).astype(np.uint8)
    want = _int64_product(a, b, -5, 200)
    for threads in (1, 2):
        with tilegemm.thread_limit(threads):
            got = tilegemm.qmatmul(a, b, a_zero_point=-5, b_zero_point=200)
        assert np.array_equal(got, want), threads
