"""Differential fuzzing of ``tilegemm.qmatmul`` against int64 numpy: bit-exact or wrong.

Generated: int8/uint8 operands over their whole range (or their extremes only, the
sums' worst case), zero points anywhere in range, shapes around the int8 tile's
MR, NR and k group and around its KC, 1-D operands and broadcast batches, layouts
(C, Fortran, negative strides, rows a byte off a word boundary, steps), and
``out=`` in C or Fortran
order or sharing memory with an input.  Checks: equality with ``(a - za) @ (b - zb)``
in int64, inputs unchanged, ``out`` returned.

The kernel tester below runs every int8 kernel this process can run (``kernels/int8.py``:
VNNI, int16 pair products and the generic one, at each width) on the same edges.
"""
import contextlib
from unittest import mock

import numpy as np
import pytest
from fuzz_settings import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

import tilegemm
from tilegemm.conv import qconv as qconv_module
from tilegemm.kernels import qgemm
from tilegemm.kernels.int8 import BYTE_KINDS, GROUP, MADDUBS_B_LIMIT, TILES
from tilegemm.kernels.int8_taps import amx_rows_past
from tilegemm.kernels.requant import finish_rows, fold
from tilegemm.kernels.qgemm import (amx_taps_shape, int8_blocking, int8_kind, int8_kind_for,
                                     pack_b_once, qgemm_into, runnable_int8_kinds, taps_into,
                                     taps_serve, widen_rows_into)

DTYPES = (np.int8, np.uint8)
LAYOUTS = ("C", "C", "F", "reversed", "offset", "step")


def _edges():
    """Sizes where the int8 engine changes behaviour: around MR, NR, GROUP and KC."""
    kind, bits = int8_kind()
    mr, nr = TILES[(kind, bits)]
    kc = int8_blocking(kind, bits)[0]
    sizes = {0, 1, 2, 3, 5, mr - 1, mr, mr + 1, nr - 1, nr, nr + 1, GROUP[kind] + 1, kc, kc + 1}
    return sorted(s for s in sizes if s >= 0)


EDGES = _edges()


def values(rng, shape, dtype, extremes, seven=False):
    """Random ``dtype`` values over the whole range, or its two ends only (``extremes``);
    with ``seven`` the 7-bit range the ``maddubs`` kernel takes for B (within +-64 of
    0, or of 128 for uint8), or its ends."""
    info = np.iinfo(dtype)
    low, high = info.min, info.max
    if seven:
        low, high = (-MADDUBS_B_LIMIT, MADDUBS_B_LIMIT) if dtype == np.int8 else (
            128 - MADDUBS_B_LIMIT, 128 + MADDUBS_B_LIMIT)
    if extremes:
        return rng.choice(np.array([low, high], dtype), size=shape)
    return rng.integers(low, high + 1, size=shape, endpoint=False).astype(dtype)


def laid_out(x, layout):
    """``x``'s values in the memory layout named ``layout`` (a view where it can be)."""
    if layout == "F":
        return np.asfortranarray(x)
    if layout == "reversed":
        return np.ascontiguousarray(x[..., ::-1, ::-1])[..., ::-1, ::-1]
    if layout == "offset":     # rows a byte past a 4-byte boundary: unaligned words
        big = np.zeros(x.shape[:-1] + (x.shape[-1] + 4,), x.dtype)
        big[..., 1:1 + x.shape[-1]] = x
        return big[..., 1:1 + x.shape[-1]]
    if layout == "step":
        big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    return np.ascontiguousarray(x)


def expected(a, b, za, zb):
    """The exact product of the shifted operands.  In float64, through numpy's BLAS:
    every term and partial sum is an integer below 2^53 (|a - za|, |b - zb| <= 255),
    so no rounding happens, and numpy's integer matmul (no BLAS) took most of this
    test's time at the KC-sized edges."""
    k = a.shape[-1]
    assert k * 255 * 255 < 2 ** 53
    shifted_a = a.astype(np.float64) - za
    shifted_b = b.astype(np.float64) - zb
    return (shifted_a @ shifted_b).astype(np.int64)


@fuzz_settings()
@given(data=st.data())
def test_qmatmul_matches_int64_numpy(data):
    da, db = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(DTYPES))
    m, n, k = (data.draw(st.sampled_from(EDGES) | st.integers(0, 80), label=name)
               for name in "mnk")
    ia, ib = np.iinfo(da), np.iinfo(db)
    za = data.draw(st.sampled_from([0, ia.min, ia.max]) | st.integers(ia.min, ia.max))
    zb = data.draw(st.sampled_from([0, ib.min, ib.max]) | st.integers(ib.min, ib.max))
    batch_a = data.draw(st.sampled_from([(), (2,), (1,), (2, 1)]), label="batch of a")
    batch_b = data.draw(st.sampled_from([(), (2,), (1, 2)]), label="batch of b")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16), label="seed"))
    extremes = data.draw(st.booleans(), label="extremes only")
    seven = data.draw(st.booleans(), label="7-bit b (maddubs on AVX2)")
    a = laid_out(values(rng, batch_a + (m, k), da, extremes),
                 data.draw(st.sampled_from(LAYOUTS), label="layout of a"))
    b = laid_out(values(rng, batch_b + (k, n), db, extremes, seven),
                 data.draw(st.sampled_from(LAYOUTS), label="layout of b"))
    vector = data.draw(st.sampled_from([None, "a", "b"]), label="1-D operand")
    if vector == "a" and not batch_a:
        a = a[0] if m else values(rng, (k,), da, extremes)
    if vector == "b" and not batch_b:
        b = b[:, 0] if n else values(rng, (k,), db, extremes, seven)
    a0, b0 = a.copy(), b.copy()
    want = expected(a, b, za, zb)
    out_kind = data.draw(st.sampled_from([None, "C", "F"]), label="out")
    out = None if out_kind is None else np.full(want.shape, -7, np.int32, order=out_kind)
    got = tilegemm.qmatmul(a, b, out=out, a_zero_point=za, b_zero_point=zb)
    assert out is None or got is out
    assert got.dtype == np.int32 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(a, a0) and np.array_equal(b, b0)


def test_qmatmul_out_sharing_memory_with_an_input():
    rng = np.random.default_rng(3)
    buf = np.zeros(64 * 4, np.int8)
    a = buf[:64].reshape(8, 8)
    a[...] = values(rng, (8, 8), np.int8, False)
    b = values(rng, (8, 8), np.int8, False)
    want = expected(a, b, 1, -2)
    out = buf.view(np.int32).reshape(8, 8)       # the same bytes as a
    assert tilegemm.qmatmul(a, b, out=out, a_zero_point=1, b_zero_point=-2) is out
    assert np.array_equal(out, want)


# --------------------------------------------------------------------------- kernel tester

KINDS = runnable_int8_kinds()


@pytest.mark.parametrize("kind", KINDS, ids=lambda kb: f"{kb[0]}{kb[1]}")
@pytest.mark.parametrize("da", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("db", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_int8_kernel_is_exact(kind, da, db):
    """Every kernel on its own edges: MR, NR, the k group and KC, one below and above,
    full-range and extreme values, zero points at both ends of the range."""
    mr, nr = TILES[kind]
    kc, _, nc = int8_blocking(*kind)
    rng = np.random.default_rng(11)
    ia, ib = np.iinfo(da), np.iinfo(db)
    seven = kind[0] == "maddubs"     # a B that kernel takes: within +-64 as packed
    # k a multiple of 4 over several KC blocks: a uint8 A is read in place with VNNI.
    # 63 and 65: either side of amx's step of k; nc + nr + 1 columns: two NC blocks of
    # panels packed once.
    for m, n, k in [(1, 1, 1), (mr, nr, GROUP[kind[0]]), (mr + 1, nr - 1, kc + 1),
                    (2 * mr - 1, 2 * nr + 1, 2 * kc - 3), (mr - 1, 1, 0), (3, nr + 1, 7),
                    (2 * mr + 1, nr + 3, 2 * kc + 8), (mr, nr, 63), (mr - 1, nr + 1, 65),
                    (mr + 3, nc + nr + 1, 70)]:
        for za, zb, extremes in [(0, 0, False), (ia.max, ib.min, True), (ia.min, ib.max, False)]:
            a, b = values(rng, (m, k), da, extremes), values(rng, (k, n), db, extremes, seven)
            want = expected(a, b, za, zb)
            # B packed here, and B's panels packed once beforehand (a layer's weights)
            for panels in (None, pack_b_once(b, zb, kind)):
                c = np.full((m, n), 99, np.int32)
                qgemm_into(a, b, c, za, zb, kind, b_panels=panels)
                assert np.array_equal(c, want), (kind, m, n, k, za, zb, panels is None)
    # Shared among threads: blocks of rows (m >= n) and of columns; rows with panels.
    for m, n, k in [(4 * mr + 1, 2 * nr - 3, kc + 5), (mr + 2, 3 * nr + 1, 2 * kc)]:
        a, b = values(rng, (m, k), da, False), values(rng, (k, n), db, False, seven)
        for panels in (None, pack_b_once(b, 1, kind)):
            c = np.full((m, n), 99, np.int32)
            qgemm_into(a, b, c, 2, 1, kind, threads=3, b_panels=panels)
            assert np.array_equal(c, expected(a, b, 2, 1)), (kind, m, n, k, "threads")


def test_amx_runs_where_the_host_has_it():
    """Where the CPU and Numba's target have AMX-INT8 (and ``TILEGEMM_AMX`` is not 0),
    Linux grants the tile state and qmatmul's products of m, n >= 32 take ``amx``, a
    thinner one a vector kind; the vector kinds never include it (a process that only
    convolves never asks for the tile state)."""
    import os
    from tilegemm.kernels.qgemm import (AMX_MIN_SIDE, amx_permitted, matrix_kind_for,
                                         target_features, vector_int8_kinds)
    from tilegemm.tuning.machine import detect
    b = np.zeros((64, AMX_MIN_SIDE), np.int8)
    assert all(kind[0] != "amx" for kind in vector_int8_kinds())
    has = (detect().isa == "avx512" and {"amx-int8", "amx-tile"} <= target_features()
           and os.environ.get("TILEGEMM_AMX", "1") != "0")
    if not has:
        assert "amx" not in [kind[0] for kind in KINDS]
        assert matrix_kind_for(b, 0, 64)[0] != "amx"
        pytest.skip("this host or Numba target has no AMX-INT8")
    if not amx_permitted():
        pytest.skip("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    assert KINDS[0] == ("amx", 512)
    assert matrix_kind_for(b, 0, AMX_MIN_SIDE) == ("amx", 512)
    assert matrix_kind_for(b, 0, AMX_MIN_SIDE - 1) == int8_kind()
    assert matrix_kind_for(b[:, :AMX_MIN_SIDE - 1], 0, 64) == int8_kind()


#: Layers for the taps kernel: (C, K, H, W, kernel, stride, (top, bottom, left, right),
#: dilation, groups).  Output rows narrower than a tile, k over several KC blocks (a
#: block ending inside a tap) and n over several NC blocks, asymmetric padding, groups,
#: odd channel counts (a zero channel added); bytes widened from NCHW in 8 x 8 blocks
#: with channels and pixels left over, and with none.
TAPS_LAYERS = [(6, 5, 7, 9, (3, 3), (1, 1), (1, 1, 1, 1), 1, 1),
               (3, 17, 11, 10, (7, 7), (2, 2), (3, 3, 3, 3), 1, 1),
               (5, 4, 6, 5, (3, 1), (1, 1), (0, 2, 1, 0), 1, 1),
               (160, 400, 4, 5, (3, 3), (1, 1), (1, 1, 1, 1), 1, 1),
               (4, 8, 9, 8, (3, 2), (2, 1), (2, 0, 1, 2), 2, 2),
               (8, 6, 6, 7, (1, 1), (1, 2), (0, 0, 0, 0), 1, 1),
               (2, 3, 5, 5, (5, 5), (1, 1), (3, 3, 3, 3), 1, 1),
               (20, 9, 5, 19, (3, 3), (1, 1), (1, 1, 1, 1), 1, 1),
               (16, 5, 3, 16, (1, 1), (1, 1), (0, 0, 0, 0), 1, 1)]


def _taps_case(kind, layer, rng, where=None):
    """The taps kernel's int32 sums of one layer (``TAPS_LAYERS``) over a run of output
    pixels starting and ending inside an output row, against the int64 reference;
    with ``where`` its widened rows end (or start) at a guard page."""
    from guard import guarded_empty
    from reference import reference_conv
    C, K, H, W, (kh, kw), (sy, sx), pads, d, groups = layer
    top, bottom, left, right = pads
    Ho = (H + top + bottom - d * (kh - 1) - 1) // sy + 1
    Wo = (W + left + right - d * (kw - 1) - 1) // sx + 1
    dtype = (np.uint8, np.int8)[rng.integers(2)]
    info = np.iinfo(dtype)
    x = values(rng, (1, H, W, C), dtype, False)
    zx = int(rng.integers(info.min, info.max + 1))
    w = values(rng, (K, C // groups, kh, kw), np.int8, False, kind[0] == "maddubs")
    want = reference_conv(x.transpose(0, 3, 1, 2).astype(np.float64) - zx, w, None, (sy, sx),
                          pads, d, groups)[0].reshape(K, -1).T
    p0, p1 = min(1, Ho * Wo - 1), max(Ho * Wo - 2, 2)
    r0, r1 = (p0 // Wo) * sy, ((p1 - 1) // Wo) * sy + (kh - 1) * d + 1
    group = GROUP[kind[0]]
    # zero channels fill the last word (amx: its runs' steps, or zero taps do)
    whole, kw_t = amx_taps_shape(C // groups, groups, (kw, d)) if kind[0] == "amx" else (group, kw)
    Wp, Cw = left + W + right, -(-C // whole) * whole // group
    size = (r1 - r0) * Wp * Cw
    # amx tiles read whole tiles of pixels: up to amx_rows_past rows more
    past = amx_rows_past(Wp, Wo, (kw_t, d), (sy, sx)) * Wp * Cw if kind[0] == "amx" else 0
    xw = (np.empty(size + past, np.int32) if where is None
          else guarded_empty((size + past,), np.int32, where=where))
    pad = widen_rows_into(x, 0, (top, left, Wp, group * Cw), zx, (r0, r1), xw, kind)
    from_nchw = np.full(size + past, 7, np.int32)    # the same rows widened from NCHW
    xw[size:] = 7
    widen_rows_into(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), 0, (top, left, Wp, group * Cw),
                    zx, (r0, r1), from_nchw, kind, layout="NCHW")
    assert np.array_equal(from_nchw, xw)
    Cg, Kg = C // groups, K // groups
    geom = (Wp, Cw, Wo, kh, kw_t, sy, sx, d, d, r0)
    padded = np.zeros((K, Cg + -Cg % whole, kh, kw_t), np.int8)
    padded[:, :Cg, :, :kw] = w
    for g in range(groups):
        mat = np.ascontiguousarray(padded[g * Kg:(g + 1) * Kg].transpose(2, 3, 1, 0)
                                   .reshape(-1, Kg))
        sums = np.full((p1 - p0) * Kg, 99, np.int32)
        panels = pack_b_once(mat, 0, kind)
        channels = (g * Cg // group, -(-Cg // whole) * whole // group, Kg)
        taps_into(xw, geom, channels, panels, sums, (p0, p1), pad=pad)
        exact = want[p0:p1, g * Kg:(g + 1) * Kg]
        assert np.array_equal(sums.reshape(-1, Kg), exact), (kind, layer, g)
        _check_codes(xw, geom, channels, panels, (p0, p1), pad, exact, rng)


def _check_codes(xw, geom, channels, panels, pixels, pad, exact, rng):
    """The codes tile on the same sums: the codes the epilogue
    (``kernels/requant.py`` :func:`finish_rows`) gives ``exact`` with the same folded
    requantization, bit for bit, wherever the kernel writes codes (k in one block);
    else nothing written.  The codes are checked against float64 in the qconv2d tests."""
    Kg = channels[2]
    odtype = (np.uint8, np.int8)[rng.integers(2)]
    info = np.iinfo(odtype)
    mult = rng.uniform(5e-6, 5e-4, Kg)
    bias = rng.uniform(-3, 3, Kg)
    act = int(rng.integers(3))
    zero = int(rng.integers(info.min, info.max + 1))
    requant = (0.05, zero, info.min, info.max)      # relu6 then clips at 120
    folded = fold(mult, bias, act, requant, int(np.abs(exact).max(initial=0)) + 1)
    o = np.full(exact.size, 7, odtype)
    written = taps_into(xw, geom, channels, panels, np.zeros(exact.size, np.int32), pixels,
                        pad=pad, codes=(o,) + folded)
    want = np.empty(exact.size, odtype)
    finish_rows(np.ascontiguousarray(exact, np.int32).reshape(-1), 0, Kg,
                (mult, bias, act, requant, folded), 0, want, 0, Kg, exact.shape)
    want = want.reshape(exact.shape)
    assert np.array_equal(o.reshape(exact.shape), want if written else np.full_like(want, 7))
    CODES_CHECKED.append(written)


TAPS_KINDS = [kind for kind in KINDS if taps_serve(kind, 2, 1)]
CODES_CHECKED = []


@pytest.mark.parametrize("kind", TAPS_KINDS, ids=lambda kb: f"{kb[0]}{kb[1]}")
@pytest.mark.parametrize("layer", TAPS_LAYERS, ids=lambda layer: "x".join(map(str, layer[:2])))
def test_every_int8_taps_kernel_is_exact(kind, layer):
    """The taps kernel (the input widened once, every tap read in place) of every kind
    that has one: exact int32 sums, and no read outside the rows it widened."""
    from guard import GUARD_PAGES
    if not taps_serve(kind, layer[0] // layer[8], layer[8]):
        pytest.skip(f"{kind[0]} has no taps kernel for groups of {layer[0] // layer[8]} channels")
    rng = np.random.default_rng(len(layer) + layer[0])
    for where in (None,) + (("after", "before") if GUARD_PAGES else ()):
        _taps_case(kind, layer, rng, where)


def test_zz_the_codes_tile_was_checked():
    """Most taps layers have k in one block: the codes tile wrote and was compared."""
    if TAPS_KINDS:
        assert sum(CODES_CHECKED) >= len(TAPS_KINDS) * (len(TAPS_LAYERS) - 2), CODES_CHECKED


def test_taps_kernel_word_offsets_past_2_to_the_31():
    """Widened rows of more than 2**31 words (a 65536-wide image of 128 channels):
    the pixels' and the runs' word offsets are intp, not wrapped to int32 (the pages
    of the 8.6 GB of zeros are never touched but the few read)."""
    C, K, Wp = 128, 16, 65536
    try:
        xw = np.zeros(513 * Wp * C // 2, np.int32)
    except MemoryError:
        pytest.skip("no 8.6 GB of address space here")
    rng = np.random.default_rng(0)
    vals = rng.integers(-200, 200, (4, C)).astype(np.int16)
    at = 512 * Wp * C                  # pixel (512, 0): word 2**31
    xw.view(np.int16)[at:at + 4 * C] = vals.reshape(-1)
    w = values(rng, (C, K), np.int8, False)
    c = np.full(4 * K, 99, np.int32)
    p0 = 512 * Wp
    # the int16-pair kinds: the offsets are the tile generator's, the same for every kind
    for kind in [kind for kind in TAPS_KINDS if GROUP[kind[0]] == 2]:
        taps_into(xw, (Wp, C // 2, Wp, 1, 1, 1, 1, 1, 1, 0), (0, C // 2, K),
                  pack_b_once(w, 0, kind), c, (p0, p0 + 4))
        assert np.array_equal(c.reshape(4, K), vals.astype(np.int64) @ w.astype(np.int64)), kind


@pytest.mark.skipif(("maddubs", 256) not in KINDS, reason="no AVX2 here")
@pytest.mark.parametrize("db", DTYPES, ids=lambda d: np.dtype(d).name)
def test_maddubs_only_for_a_b_it_sums_exactly(db):
    """``maddubs`` is chosen exactly when B's packed values lie within +-64 (its int16
    pair sums cannot saturate), and refuses any other B rather than saturate."""
    centre = 0 if db == np.int8 else 128
    a = np.full((3, 4), 255, np.uint8)
    for step, fits in [(MADDUBS_B_LIMIT, True), (MADDUBS_B_LIMIT + 1, False)]:
        for sign in (1, -1):
            b = np.full((4, 5), centre, db)
            b[2, 3] = centre + sign * step
            chosen = int8_kind_for(b, 9)
            if int8_kind() == ("madd", 256):
                assert (chosen == ("maddubs", 256)) == fits, (step, sign, chosen)
            if fits:
                c = np.empty((3, 5), np.int32)
                qgemm_into(a, b, c, 1, 9, ("maddubs", 256))
                assert np.array_equal(c, expected(a, b, 1, 9))
            else:
                for call in (lambda: pack_b_once(b, 9, ("maddubs", 256)),
                             lambda: qgemm_into(a, b, np.empty((3, 5), np.int32), 1, 9,
                                                ("maddubs", 256))):
                    with pytest.raises(ValueError, match="maddubs kernel needs"):
                        call()


def test_panels_of_another_b_are_refused():
    b = np.zeros((5, 6), np.int8)
    panels = pack_b_once(b)
    with pytest.raises(ValueError, match="packed for another shape"):
        qgemm_into(np.zeros((2, 5), np.uint8), np.zeros((5, 7), np.int8),
                   np.empty((2, 7), np.int32), 0, 0, b_panels=panels)


# --------------------------------------------------------------------------- qconv2d

QCONV_CHECKED = []
#: Per layer drawn with amx allowed everywhere, whether it took amx tiles.
AMX_CHOSEN = []
#: NCHW layers drawn with the NHWC twin allowed whatever their channels whose twin ran.
TWIN_TAKEN = []
#: The row transposes of strided 1x1 layers' twins, wrapped (their calls counted).
ROWS_TAKEN = []
#: Layers whose residual sum was checked (see :func:`_check_sum`).
SUM_CHECKED = []

def qconv_reference(x, zx, w, x_scale, w_scale, bias, geometry, activation, layout):
    """float64 of the dequantized math: conv2d(x - zx, w) * x_scale * w_scale[k] + bias[k]."""
    from reference import reference_conv
    stride, padding, dilation, groups = geometry
    xs = x.astype(np.float64) - zx
    if layout == "NHWC":
        xs = xs.transpose(0, 3, 1, 2)
    y = reference_conv(xs, w, None, stride, padding, dilation, groups)
    y = y * (x_scale * np.broadcast_to(w_scale, (w.shape[0],)))[None, :, None, None]
    y = y + (0 if bias is None else bias[None, :, None, None])
    if activation:
        y = np.maximum(y, 0)
    if activation == "relu6":
        y = np.minimum(y, 6)
    return y.transpose(0, 2, 3, 1) if layout == "NHWC" else y


@fuzz_settings(scale=0.5)
@given(data=st.data())
def test_qconv2d_matches_the_dequantized_math(data):
    """Float output equal to the float64 reference up to float32 rounding; requantized
    codes within one step of the reference's (a tie may round either way); on amx
    tiles too where the host has them, for any layer they can run."""
    with contextlib.ExitStack() as stack:
        _qconv_case(data.draw, stack)


def _qconv_case(draw, stack):
    """One drawn layer of :func:`test_qconv2d_matches_the_dequantized_math`."""
    layout = draw(st.sampled_from(["NCHW", "NHWC"]), label="layout")
    groups = draw(st.sampled_from([1, 1, 2, 3]), label="groups")
    cg, kg = draw(st.integers(1, 9), label="C/groups"), draw(st.integers(1, 9), label="K/groups")
    if draw(st.booleans(), label="depthwise"):    # 16 and more: vectors of 16 channels
        groups, cg, kg = draw(st.sampled_from([2, 5, 12, 16, 17, 32, 40]), label="channels"), 1, 1
    kh, kw = draw(st.sampled_from([1, 3, 5]), label="kh"), draw(st.sampled_from([1, 2, 3]), label="kw")
    stride = draw(st.sampled_from([1, 1, 2, (1, 2)]), label="stride")
    dilation = draw(st.sampled_from([1, 1, 2]), label="dilation")
    padding = draw(st.sampled_from([0, 1, 2, (1, 0)]), label="padding")
    n, h, w_ = draw(st.integers(1, 2)), draw(st.integers(5, 13)), draw(st.integers(5, 13))
    xd = draw(st.sampled_from(DTYPES), label="x dtype")
    info = np.iinfo(xd)
    zx = draw(st.integers(info.min, info.max), label="x zero point")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16), label="seed"))
    shape = (n, groups * cg, h, w_) if layout == "NCHW" else (n, h, w_, groups * cg)
    x = values(rng, shape, xd, draw(st.booleans(), label="extremes"))
    seven = draw(st.booleans(), label="7-bit weights (maddubs on AVX2)")
    w = values(rng, (groups * kg, cg, kh, kw), np.int8, False, seven)
    w_scale = rng.uniform(1e-3, 1e-2, groups * kg) if draw(st.booleans()) else 0.004
    bias = rng.standard_normal(groups * kg) if draw(st.booleans()) else None
    activation = draw(st.sampled_from([None, "relu", "relu6"]), label="activation")
    geometry = (stride, padding, dilation, groups)
    kwargs = dict(x_zero_point=zx, stride=stride, padding=padding, dilation=dilation,
                  groups=groups, activation=activation, layout=layout)
    weights = tilegemm.QConvWeights(w, w_scale) if draw(st.booleans()) else w
    depthwise = cg == kg == 1 and groups > 1
    if (layout == "NCHW" and not depthwise
            and draw(st.sampled_from([True, False]), label="the NHWC twin for any NCHW layer")):
        stack.enter_context(mock.patch.object(qconv_module, "TWIN_MIN_CHANNELS", 1))
        if draw(st.sampled_from([True, False]), label="a strided 1x1 twin on its rows"):
            # 16 channels or more, 16 wide or more: the twin transposes every other row
            prepared, cg, groups, kh, kw = weights is not w, 16 * n, 1, 1, 1
            stride, padding, dilation, w_ = 2, 0, 1, max(w_ + 8, 16)
            x = values(rng, (n, cg, h, w_), xd, False)
            w = values(rng, (kg, cg, kh, kw), np.int8, False, seven)
            w_scale = w_scale if np.isscalar(w_scale) else rng.uniform(1e-3, 1e-2, kg)
            bias, geometry = None if bias is None else rng.standard_normal(kg), (2, 0, 1, 1)
            kwargs.update(stride=2, padding=0, dilation=1, groups=1)
            weights = tilegemm.QConvWeights(w, w_scale) if prepared else w
            ROWS_TAKEN.append(stack.enter_context(mock.patch.object(
                qconv_module, "transpose_rows", wraps=qconv_module.transpose_rows)))
        transpose = qconv_module.transpose_bytes    # the layers whose twin ran, counted
        took = []

        def counted_transpose(*args):
            if not took:
                took.append(1)
                TWIN_TAKEN.append(1)
            return transpose(*args)
        stack.enter_context(mock.patch.object(qconv_module, "transpose_bytes", counted_transpose))
    if draw(st.booleans(), label="amx tiles for any layer they can run"):
        stack.enter_context(mock.patch.multiple(qgemm, AMX_MIN_SIDE=1, AMX_WASTE=np.inf,
                                                AMX_PIXELS=0))
        choose = qconv_module.taps_kind_for       # each layer's choice, counted once
        counted_layers = set()                   # (an NCHW layer's twin chooses again)

        def counted(*args):
            chosen = choose(*args)
            if args not in counted_layers:
                counted_layers.add(args)
                AMX_CHOSEN.append(chosen[0][0] == "amx")
            return chosen
        stack.enter_context(mock.patch.object(qconv_module, "taps_kind_for", counted))
    x0 = x.copy()
    pads = np.broadcast_to(padding, 2)
    fits = (h + 2 * pads[0] >= dilation * (kh - 1) + 1
            and w_ + 2 * pads[1] >= dilation * (kw - 1) + 1)
    if not fits:            # the kernel does not fit: refused, as conv2d refuses it
        with pytest.raises(ValueError, match="output"):
            tilegemm.qconv2d(x, 0.02, weights, None if weights is not w else w_scale, **kwargs)
        return
    want = qconv_reference(x, zx, w, 0.02, w_scale, bias, geometry, activation, layout)
    got = tilegemm.qconv2d(x, 0.02, weights, None if weights is not w else w_scale, bias, **kwargs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(want).max()))
    out_dtype = draw(st.sampled_from(DTYPES), label="out dtype")
    oz = draw(st.integers(np.iinfo(out_dtype).min, np.iinfo(out_dtype).max), label="out zero point")
    q = tilegemm.qconv2d(x, 0.02, weights, None if weights is not w else w_scale, bias,
                         out_scale=0.03, out_zero_point=np.dtype(out_dtype).type(oz), **kwargs)
    low, high = np.iinfo(out_dtype).min, np.iinfo(out_dtype).max
    codes = np.clip(np.rint(want / 0.03) + oz, low, high)
    assert q.dtype == out_dtype and np.abs(q.astype(np.int64) - codes).max(initial=0) <= 1
    if draw(st.booleans(), label="a residual sum fused in"):
        _check_sum(draw, rng, x, weights if weights is not w else tilegemm.QConvWeights(w, w_scale),
                   bias, dict(kwargs, out_scale=0.03, out_zero_point=np.dtype(out_dtype).type(oz)),
                   q)
    assert np.array_equal(x, x0)
    QCONV_CHECKED.append(1)


def _check_sum(draw, rng, x, weights, bias, options, codes):
    """The layer with a QDQ residual sum fused in: bit for bit the float32 steps on its
    ``codes`` (:func:`reference.qdq_sum`)."""
    from reference import qdq_sum
    from tilegemm.conv.qconv import PreparedQConv, QuantizedSum
    # the residual's and the sum's codes of one dtype: every dtype triple compiles the
    # driver anew (test_qconv_sum.py mixes them)
    r_dtype = s_dtype = draw(st.sampled_from(DTYPES), label="residual and sum dtype")
    zr, zs = (draw(st.integers(np.iinfo(d).min, np.iinfo(d).max), label=f"{what} zero point")
              for d, what in ((r_dtype, "residual"), (s_dtype, "sum")))
    s = QuantizedSum(float(rng.uniform(0.01, 0.1)), np.dtype(r_dtype).type(zr),
                     float(rng.uniform(0.01, 0.1)), np.dtype(s_dtype).type(zs),
                     draw(st.sampled_from([None, "relu"]), label="sum activation"),
                     draw(st.booleans(), label="conv first"))
    layer = PreparedQConv(x.shape, x.dtype, 0.02, weights, bias, residual=s, **options)
    residual = values(rng, layer.output_shape, r_dtype, False)
    got = layer(x, residual=residual)
    want = qdq_sum(codes, residual, (options["out_scale"], options["out_zero_point"]), s)
    assert got.dtype == s_dtype and np.array_equal(got, want)
    SUM_CHECKED.append(1)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kernel", ["host", "seven", "amx"])
@pytest.mark.parametrize("threads, geometry", [(1, dict(padding=1)), (2, dict(padding=1)),
                                               (2, dict(stride=2, groups=2)),
                                               (1, dict(dilation=2, padding=2)),
                                               (1, dict()), (2, dict(stride=2))])
def test_qconv2d_blocks_of_several_chunks(layout, kernel, threads, geometry, monkeypatch):
    """Blocks of pixels longer than the taps driver's chunk (its sums in a quarter of
    L2, here a 64 KiB one): every chunk's sums and epilogue land at their pixels, in
    both layouts, one block or one per thread, grouped, strided, dilated, and with
    no padding (an NHWC input then read in place by the byte kinds); on the host's
    vector kernel, with 7-bit weights (``maddubs`` on AVX2) and on amx tiles."""
    import dataclasses
    from tilegemm.conv import quantized
    from tilegemm.conv.qconv import PreparedQConv
    from tilegemm.conv.quantized import TapsPlan
    from tilegemm.kernels.qgemm import taps_serve
    small_l2 = dataclasses.replace(quantized.detect(), l2_bytes=64 << 10)
    monkeypatch.setattr(quantized, "detect", lambda: small_l2)
    monkeypatch.setattr(quantized, "SHARE_OPS", 0)
    blocking = quantized.int8_blocking

    def small_mc(kind, bits):      # chunks are whole MC blocks: keep them short too
        kc, mc, nc = blocking(kind, bits)
        return kc, min(mc, 4 * TILES[(kind, bits)][0]), nc
    monkeypatch.setattr(quantized, "int8_blocking", small_mc)
    from guard import guarded_empty
    rng = np.random.default_rng(31)
    shape = (1, 16, 40, 41) if layout == "NCHW" else (1, 40, 41, 16)
    # at a guard page: read in place, amx tiles must not read past the input's end
    x = guarded_empty(shape, np.uint8, where="after")
    x[...] = values(rng, shape, np.uint8, False)
    groups = geometry.get("groups", 1)
    w = values(rng, (64, 16 // groups, 3, 3), np.int8, False, kernel == "seven")
    qw = tilegemm.QConvWeights(w, 0.004)
    kind = runnable_int8_kinds()[0] if kernel == "amx" else qw.kind
    if kernel == "amx" and kind[0] != "amx":
        pytest.skip("no amx here")
    if not taps_serve(kind, 16 // groups, groups):
        pytest.skip(f"{kind[0]} has no taps kernel for groups of {16 // groups} channels")
    layer = PreparedQConv(x.shape, x.dtype, 0.02, qw, x_zero_point=9, layout=layout, **geometry)
    taps_shape = ((kind,) + amx_taps_shape(16 // groups, groups, (3, geometry.get("dilation", 1)))
                  if kind[0] == "amx" else None)
    plan = TapsPlan(layer.params, x.dtype, 9, qw.taps(groups, taps_shape), layer.epilogue,
                    threads)
    pixels = int(np.prod(layer.output_shape)) // 64
    assert len(plan.blocks) == threads and plan.chunk < pixels // threads
    # amx in place where its taps take the channels as they are (no zero channels)
    in_place = (layout == "NHWC" and "padding" not in geometry and kind[0] in BYTE_KINDS
                and (kind[0] != "amx" or (16 // groups) % taps_shape[1] == 0))
    assert plan.in_place == in_place
    IN_PLACE_RUN.append(kind[0] if in_place else None)
    want = qconv_reference(x, 9, w, 0.02, 0.004, None, (geometry.get("stride", 1),
                           geometry.get("padding", 0), geometry.get("dilation", 1), groups),
                           None, layout)
    with tilegemm.thread_limit(threads):
        got = plan(x, np.empty(layer.output_shape, np.float32))
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


IN_PLACE_RUN = []


def test_zz_qconv2d_fuzz_checked_enough_layers():
    """The generated geometries mostly have outputs: the checks above ran, not the early exits."""
    assert len(QCONV_CHECKED) >= 50, len(QCONV_CHECKED)
    assert len(SUM_CHECKED) >= 15, len(SUM_CHECKED)
    assert len(TWIN_TAKEN) >= 5, len(TWIN_TAKEN)
    assert sum(rows.call_count for rows in ROWS_TAKEN) >= 2, ROWS_TAKEN
    if runnable_int8_kinds()[0][0] == "amx":
        assert sum(AMX_CHOSEN) >= 10, AMX_CHOSEN
        assert "amx" in IN_PLACE_RUN, IN_PLACE_RUN
