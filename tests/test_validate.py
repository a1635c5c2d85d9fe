"""The shared input checks of tilegemm.ground.validate: what passes, what raises, the messages."""
import numpy as np
import pytest

from tilegemm.ground import validate


def test_float_dtypes_pass_and_others_say_how_to_cast():
    x = np.ones(3, np.float32)
    assert validate.check_float_dtype(x, "a", "f") is x
    with pytest.raises(TypeError, match=r"^f: a has dtype int64; tilegemm computes in float32"):
        validate.check_float_dtype(np.ones(3, np.int64), "a", "f")


def test_float_array_keeps_subclasses_and_wraps_conversion_errors():
    m = np.ma.masked_array(np.ones(2))
    assert validate.float_array(m, "x", "f") is m
    assert validate.float_array([1.0, 2.0], "x", "f").dtype == np.float64
    with pytest.raises(TypeError, match=r"^f: x is not array-like"):
        validate.float_array([[1.0], [1.0, 2.0]], "x", "f")


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_plain_float_array_refuses_masked_and_drops_subclasses():
    with pytest.raises(TypeError, match="masked array"):
        validate.plain_float_array(np.ma.masked_array(np.ones(2)), "a", "f")
    m = np.asmatrix(np.ones((2, 2)))
    plain = validate.plain_float_array(m, "a", "f")
    assert type(plain) is np.ndarray and np.shares_memory(plain, m)


def test_check_out():
    out = np.empty((2, 3), np.float32)
    assert validate.check_out(out, (2, 3), np.dtype(np.float32), "f").base is out
    with pytest.raises(TypeError, match="must be a numpy.ndarray, got list"):
        validate.check_out([], (2, 3), np.float32, "f")
    with pytest.raises(ValueError, match=r"has shape \(2, 3\), expected \(3, 2\)"):
        validate.check_out(out, (3, 2), np.float32, "f")
    with pytest.raises(TypeError, match="has dtype float32, expected float64"):
        validate.check_out(out, (2, 3), np.dtype(np.float64), "f")
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^f: c is read-only"):
        validate.check_out(out, (2, 3), np.float32, "f", name="c")


def test_overlaps():
    a = np.ones((4, 4))
    assert validate.overlaps(a[:2], np.ones(2), a)
    assert not validate.overlaps(a, np.ones(2))


def test_check_choice():
    validate.check_choice(None, (None, "relu"), "activation", "f")
    with pytest.raises(ValueError, match=r"^f: unknown algorithm 'fft'; expected one of 'a', 'b'"):
        validate.check_choice("fft", ("a", "b"), "algorithm", "f")
    with pytest.raises(ValueError, match="unknown algorithm"):
        validate.check_choice(["a"], ("a",), "algorithm", "f")


def test_real_scalar_and_finite_cast():
    assert validate.real_scalar(np.float32(2), "alpha", "f") == 2.0
    with pytest.raises(TypeError, match="alpha must be a real number, got bool"):
        validate.real_scalar(True, "alpha", "f")
    with pytest.raises(ValueError, match="too large for float32"):
        validate.real_scalar(1e300, "alpha", "f", np.dtype(np.float32))
    with pytest.raises(ValueError, match="too large"):
        validate.real_scalar(10 ** 400, "alpha", "f")
    assert validate.real_scalar(float("inf"), "alpha", "f", np.dtype(np.float32)) == float("inf")


def test_check_flag_and_threads():
    assert validate.check_flag(np.bool_(True), "trans_a", "f") is True
    with pytest.raises(TypeError, match="'N'/'T' strings are not accepted"):
        validate.check_flag("T", "trans_a", "f")
    assert validate.check_threads(None, "f") is None and validate.check_threads(2, "f") == 2
    with pytest.raises(TypeError, match="threads must be an int"):
        validate.check_threads(True, "f")
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        validate.check_threads(0, "f")


@pytest.mark.parametrize("order", [">", "<"])
def test_byte_swapped_operands_compute_as_native_ones(order):
    """Either byte order in, the machine's out: the same values as native operands."""
    import tilegemm
    rng = np.random.default_rng(3)
    a, b = rng.random((7, 5), np.float32), rng.random((5, 9))
    sa, sb = a.astype(order + "f4"), b.astype(order + "f8")
    before = sa.copy()
    assert np.array_equal(tilegemm.matmul(sa, sb), tilegemm.matmul(a, b))
    assert np.array_equal(tilegemm.gemm(sa, sa.T), tilegemm.gemm(a, a.T))
    assert np.array_equal(sa, before) and sa.dtype == np.dtype(order + "f4")   # untouched
    x, w = rng.random((1, 2, 6, 6), np.float32), rng.random((3, 2, 3, 3), np.float32)
    got = tilegemm.conv2d(x.astype(order + "f4"), w.astype(order + "f4"), padding=1)
    assert got.dtype == np.float32 and np.array_equal(got, tilegemm.conv2d(x, w, padding=1))
    with pytest.raises(TypeError, match="byte order"):
        tilegemm.matmul(a, a.T, out=np.empty((7, 7), np.dtype(np.float32).newbyteorder("S")))


def test_new_style_dtypes_get_the_project_message():
    strings = np.array(["a", "b"], dtype=np.dtypes.StringDType()) if hasattr(
        np, "dtypes") and hasattr(np.dtypes, "StringDType") else np.array(["a", "b"])
    with pytest.raises(TypeError, match="computes in float32 and float64 only"):
        validate.check_float_dtype(strings, "a", "f")


def test_out_with_a_batch_stride_between_elements_is_still_written():
    import tilegemm
    rec = np.zeros(4, [("m", "f4", (3, 5)), ("tag", "i2")])
    out = rec["m"]                                 # strides (62, 20, 4)
    rng = np.random.default_rng(5)
    a, b = rng.random((4, 3, 2), np.float32), rng.random((4, 2, 5), np.float32)
    assert tilegemm.matmul(a, b, out=out) is out
    assert np.allclose(rec["m"], a @ b, rtol=1e-6)


def test_a_jitted_code_only_function_refuses_a_python_call():
    """``inner_jit`` functions have no CPython wrapper: a Python call raises, never
    jumps into code that cannot take Python arguments (before and after a jitted
    caller has compiled them)."""
    from jitted import trampoline
    from tilegemm.packing.im2col import valid_range

    with pytest.raises(TypeError, match="runs inside jitted code only"):
        valid_range(0, 1, 4, 4)
    assert trampoline(valid_range)(0, 1, 4, 4) == (0, 4)
    with pytest.raises(TypeError, match="runs inside jitted code only"):
        valid_range(0, 1, 4, 4)


def test_imin_imax_match_min_max_in_python_and_in_jitted_code():
    import numba

    from tilegemm.ground.contracts import imax, imin

    @numba.njit
    def picks(a, b):
        return imin(a, b), imax(a, b), imin(a, 3), imax(-2, b)

    cases = [(5, -7), (-7, 5), (4, 4), (np.int32(-9), np.int64(2**40)),
             (np.uint8(200), np.uint8(7)), (np.int64(-2**63), np.int64(2**63 - 1))]
    for a, b in cases:
        want = (min(a, b), max(a, b), min(a, 3), max(-2, b))
        assert picks(a, b) == want, (a, b)
        assert (imin(a, b), imax(a, b)) == want[:2]
    with pytest.raises(numba.TypingError):
        picks(1.5, 2.0)                     # integers only: floats keep min/max
