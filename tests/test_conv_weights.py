"""Weights prepared once: ConvWeights, the prepared-weights cache and its comparisons,
and the weight packers against their layouts written as loops."""
import threading
import time

import numpy as np
import pytest

import tilegemm
from conv_cases import RNG, numba_threads, tolerance
from reference import reference_conv
from thread_runs import in_threads
from tilegemm.conv import engine
from tilegemm.conv.params import conv_params
from tilegemm.ground.contracts import round_up


def test_weight_changed_in_place_is_not_served_stale():
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((8, 8, 3, 3)).astype(np.float32)
    for alg in ("winograd", "im2col"):
        first = tilegemm.conv2d(x, w, padding=1, algorithm=alg)
        np.testing.assert_allclose(first, reference_conv(x, w, padding=1), atol=1e-4)
        w2 = w.copy()
        w[0, 0, 1, 1] += 1.0
        second = tilegemm.conv2d(x, w, padding=1, algorithm=alg)
        np.testing.assert_allclose(second, reference_conv(x, w, padding=1), atol=1e-4)
        w[...] = w2


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, size", [(np.float32, 1152), (np.float64, 3 * 4096 + 5)])
def test_same_contents_finds_any_changed_bit(threads, dtype, size, monkeypatch):
    """The cache's check that a weight array is unchanged: one flipped bit anywhere (the
    ends of each thread's part and of each block) is found; NaN matches itself."""
    monkeypatch.setattr(engine, "COMPARE_BYTES_PER_THREAD", 1024)   # cut even small arrays
    w = RNG.standard_normal(size).astype(dtype)
    w[7] = np.nan
    copy = w.copy()
    with numba_threads(threads):
        assert engine.same_contents(copy, w)
        ends = {0, size - 1, 4095, 4096} | {size * t // 2 + d for t in (1,) for d in (-1, 0)}
        for i in sorted(e for e in ends if e < size):
            for bit in (0, 8 * w.itemsize - 1):                  # lowest bit, sign bit
                changed = w.copy()
                changed.view(f"u{w.itemsize}")[i] ^= np.array(1 << bit).astype(f"u{w.itemsize}")
                assert not engine.same_contents(copy, changed), (i, bit)
    assert not engine.same_contents(np.zeros(3, dtype), np.array([0.0, -0.0, 0.0], dtype))


@pytest.mark.parametrize("algorithm", ["im2col", "winograd", "direct", "auto"])
@pytest.mark.parametrize("C", [8, 64])
def test_conv_weights_match_plain_weights(algorithm, C):
    """ConvWeights gives exactly what the plain array gives, call after call."""
    x = RNG.standard_normal((2, C, 9, 11)).astype(np.float32)
    w = RNG.standard_normal((10, C, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(10).astype(np.float32)
    cw = tilegemm.ConvWeights(w)
    assert cw.shape == w.shape and cw.dtype == w.dtype
    expected = tilegemm.conv2d(x, w, b, padding=1, activation="relu", algorithm=algorithm)
    for _ in range(2):
        got = tilegemm.conv2d(x, cw, b, padding=1, activation="relu", algorithm=algorithm)
        np.testing.assert_array_equal(got, expected)


def test_conv_weights_hold_their_own_copy():
    x = RNG.standard_normal((1, 64, 8, 8)).astype(np.float32)
    w = RNG.standard_normal((6, 64, 3, 3)).astype(np.float32)
    expected = reference_conv(x, w, padding=1)
    cw = tilegemm.ConvWeights(w)
    w += 1.0                                                  # after preparing: no effect
    for algorithm in ("im2col", "winograd", "direct"):
        got = tilegemm.conv2d(x, cw, padding=1, algorithm=algorithm)
        assert np.abs(got - expected).max() <= tolerance(x, w, np.float32)


def test_conv_weights_are_never_compared_nor_evicted(monkeypatch):
    """Built once per object and algorithm, kept however many objects there are, and
    never compared with anything (a plain array is, on every call)."""
    builds, compares = [], []
    real_prepared, real_same = engine.prepared, engine.same_contents

    def counted_prepared(kind, weight, params, build):
        return real_prepared(kind, weight, params, lambda w: (builds.append(kind), build(w))[1])

    monkeypatch.setattr(engine, "prepared", counted_prepared)
    monkeypatch.setattr(engine, "same_contents",
                        lambda *a: (compares.append(1), real_same(*a))[1])
    x = RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)
    layers = [tilegemm.ConvWeights(RNG.standard_normal((4, 4, 3, 3)).astype(np.float32))
              for _ in range(engine.PREPARED_MAX + 8)]
    for _ in range(2):
        for cw in layers:
            tilegemm.conv2d(x, cw, padding=1, algorithm="winograd")
    assert len(builds) == len(layers)
    assert not compares
    plain = RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)
    for _ in range(2):
        tilegemm.conv2d(x, plain, padding=1, algorithm="winograd")
    assert len(builds) == len(layers) + 1 and len(compares) == 1


def test_conv_weights_bad_input():
    with pytest.raises(TypeError, match="dtype"):
        tilegemm.ConvWeights(np.ones((2, 2, 3, 3), np.int32))
    with pytest.raises(ValueError, match="4-D"):
        tilegemm.ConvWeights(np.ones((3, 3), np.float32))
    cw = tilegemm.ConvWeights(np.ones((2, 3, 3, 3), np.float32))
    with pytest.raises(ValueError, match="channel"):
        tilegemm.conv2d(np.ones((1, 4, 5, 5), np.float32), cw)


def test_conv_weights_shared_by_python_threads():
    x = RNG.standard_normal((2, 64, 10, 10)).astype(np.float32)
    w = RNG.standard_normal((12, 64, 3, 3)).astype(np.float32)
    cw = tilegemm.ConvWeights(w)
    expected = reference_conv(x, w, padding=1)

    def work(i):
        algorithm = ("im2col", "winograd", "direct")[i % 3]
        for _ in range(3):
            got = tilegemm.conv2d(x, cw, padding=1, algorithm=algorithm)
            assert np.abs(got - expected).max() <= tolerance(x, w, np.float32)

    in_threads(work, 6)


def test_prepared_weights_describe_what_was_built():
    """A weight written while its prepared form is built (by another thread) must not
    poison the cache: the copy kept for comparison is the one built from, so the next
    call sees the change and rebuilds."""
    w = np.ones((4, 4, 3, 3), np.float32)

    def build(snapshot):
        w[...] = 2.0                   # the racing write, in the middle of the build
        return float(snapshot.sum())

    assert engine.prepared("test_race", w, (), build) == 4 * 4 * 9
    assert engine.prepared("test_race", w, (), lambda s: float(s.sum())) == 2 * 4 * 4 * 9


@pytest.mark.parametrize("algorithm", ["winograd", "im2col"])
def test_weights_raced_in_place_leave_later_calls_right(algorithm):
    """One thread flips a plain weight array between two values in place while another
    convolves with it; once the writes stop, every later call gives the reference of
    the weights the array then holds."""
    x = RNG.standard_normal((1, 16, 10, 10)).astype(np.float32)
    w0 = RNG.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w1 = RNG.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w = w0.copy()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            w[...] = (w0, w1)[i % 2]
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            tilegemm.conv2d(x, w, padding=1, algorithm=algorithm)   # result undefined
    finally:
        stop.set()
        t.join()
    for final in (w0, w1, w0):
        w[...] = final
        expected = reference_conv(x, final, padding=1)
        for _ in range(3):
            got = tilegemm.conv2d(x, w, padding=1, algorithm=algorithm)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _pack_taps_by_loops(w, groups, KC, MR):
    """The taps kernel's packed weights written out loop by loop (the layout of
    ``taps.pack_weights``' docstring): the reference for its array copies."""
    K, Cg, kh, kw = w.shape
    T, Kg = kh * kw, K // groups
    Mp = round_up(Kg, MR)
    a_group = T * Cg * Mp + 1
    buf = np.zeros(groups * a_group, w.dtype)
    for g in range(groups):
        for pc in range(0, Cg, KC):
            kc = min(KC, Cg - pc)
            for ir in range(0, Mp, MR):
                for t in range(T):
                    i, j = t % kh, t // kh             # column by column
                    for k in range(kc):
                        for r in range(MR):
                            if ir + r < Kg:
                                at = (g * a_group + pc * Mp * T + ir * kc * T + t * MR * kc
                                      + k * MR + r)
                                buf[at] = w[g * Kg + ir + r, pc + k, i, j]
    return buf, Mp


def _pack_rows_by_loops(w, groups, KC, NR):
    """``rows.pack_weights``' layout written out loop by loop."""
    K, Cg, kh, kw = w.shape
    T, Kg = kh * kw, K // groups
    Np = round_up(Kg, NR)
    buf = np.zeros(groups * Cg * T * Np + 1, w.dtype)
    for g in range(groups):
        for pc in range(0, Cg, KC):
            kc = min(KC, Cg - pc)
            for jr in range(0, Np, NR):
                for t in range(T):
                    for k in range(kc):
                        for c in range(NR):
                            if jr + c < Kg:
                                at = ((g * Cg + pc) * T * Np + jr * T * kc + t * kc * NR
                                      + k * NR + c)
                                buf[at] = w[g * Kg + jr + c, pc + k, t // kw, t % kw]
    return buf, Np


@pytest.mark.parametrize("K, Cg, kh, kw, groups, KC, tile", [
    (8, 1, 3, 3, 8, 4, 6), (12, 5, 2, 3, 3, 2, 4), (64, 1, 7, 7, 64, 8, 16),
    (6, 7, 1, 4, 2, 3, 8), (32, 16, 3, 3, 2, 5, 6)])
def test_weight_packers_match_their_layouts(K, Cg, kh, kw, groups, KC, tile):
    """The taps and rows weight packers (array copies over all groups at once, where a
    Python loop per group and tap made depthwise layers 50x slower) against their
    layouts written out element by element."""
    from tilegemm.conv import rows as rows_mod
    from tilegemm.conv import taps as taps_mod
    w = RNG.standard_normal((K, Cg, kh, kw)).astype(np.float32)
    buf, Mp = taps_mod.pack_weights(w, groups, KC, tile)
    ref, Mp_ref = _pack_taps_by_loops(w, groups, KC, tile)
    assert Mp == Mp_ref and np.array_equal(buf, ref)
    p = conv_params((1, Cg * groups, kh + 2, kw + 2), w.shape, groups=groups)
    buf, Np = rows_mod.pack_weights(w, p, KC, tile)
    ref, Np_ref = _pack_rows_by_loops(w, groups, KC, tile)
    assert Np == Np_ref and np.array_equal(buf, ref)
