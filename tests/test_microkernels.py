"""Micro-kernel tester, run over every registered kernel.

Each case drives exactly one tile through the kernel's macro-kernel (``mc <= MR``,
``nc <= NR``), so full tiles exercise the vector-IR kernel and partial ones its
masked edge flavour: every m <= MR x n <= NR subtile, k of 0, 1, just below / at /
above the vector width and KC, strided C, beta in {0, 1, 0.5} with NaN in C when
beta is 0, and the fused bias/activation epilogue.  The oracles are float64
numpy and the plain-Numba register-tile kernel of the cache-blocking ladder.
"""
import numpy as np
import pytest

from tilegemm.ground.contracts import EPI_BIAS_COL, EPI_BIAS_ROW, EPI_RELU, EPI_RELU6
from tilegemm.kernels.registry import get_kernel, registered_kernels
from tilegemm.packing import aligned_empty
from tilegemm.tuning.blocking import blocking

from conftest import assert_close, error_bound

KERNELS = registered_kernels()
IDS = [f"{dt.name}-{mr}x{nr}-{isa}" for dt, mr, nr, isa in KERNELS]


def run_tile(kern, mr, nr, k, beta, rng, ldc_pad=3, epi=0, a_scale=1.0):
    """Pack random A (mr x k), B (k x nr), run one tile into a strided C, return (got, A, B, C0, bias)."""
    dt = kern.dtype
    MR, NR = kern.mr, kern.nr
    A = (rng.standard_normal((mr, k)) * a_scale).astype(dt)
    B = rng.standard_normal((k, nr)).astype(dt)
    apack = aligned_empty(MR * max(k, 1), dt)
    bpack = aligned_empty(NR * max(k, 1), dt)
    apack[:] = 0
    bpack[:] = 0
    apack[:MR * k].reshape(k, MR)[:, :mr] = A.T
    bpack[:NR * k].reshape(k, NR)[:, :nr] = B
    ldc = NR + ldc_pad
    c_off = 5
    cflat = np.full(c_off + MR * ldc + 7, 7.0, dt)
    C = cflat[c_off:c_off + mr * ldc].reshape(mr, ldc)[:, :nr]
    if beta == 0:
        C[...] = np.nan  # must be overwritten, never read
    else:
        C[...] = rng.standard_normal((mr, nr))
    C0 = C.copy()
    bias = rng.standard_normal(max(MR, NR) + 3).astype(dt)
    kern.module.macro_kernel(mr, nr, k, apack, 0, bpack, 0, cflat, c_off, ldc, dt.type(1.5),
                             dt.type(beta), bias, 0, 0, epi)
    # Nothing outside the tile was touched.
    untouched = np.ones(cflat.shape, bool)
    for i in range(mr):
        untouched[c_off + i * ldc:c_off + i * ldc + nr] = False
    assert np.all(cflat[untouched] == 7.0), "the kernel wrote outside its tile"
    return C.copy(), A, B, C0, bias


def reference(A, B, C0, beta, alpha=1.5):
    ref = alpha * (A.astype(np.float64) @ B.astype(np.float64))
    if beta != 0:
        ref += beta * C0.astype(np.float64)
    return ref


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
def test_every_subtile(spec, rng):
    dt, MR, NR, isa = spec
    kern = get_kernel(dt, MR, NR, isa)
    k = 9
    for mr in range(1, MR + 1):
        for nr in range(1, NR + 1):
            beta = (0.0, 1.0, 0.5)[(mr + nr) % 3]
            got, A, B, C0, _ = run_tile(kern, mr, nr, k, beta, rng)
            assert_close(got, reference(A, B, C0, beta),
                         1.5 * error_bound(A, B, k, dt, extra=C0 if beta else None),
                         f"{kern.name} m={mr} n={nr} k={k} beta={beta}")


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
def test_k_values_and_beta(spec, rng):
    dt, MR, NR, isa = spec
    kern = get_kernel(dt, MR, NR, isa)
    KC = blocking(dt, mr=MR, nr=NR).kc
    lanes = kern.lanes
    ks = sorted({0, 1, 2, 3, lanes - 1, lanes, lanes + 1, KC - 1, KC, KC + 1, 2 * KC + 5})
    for k in ks:
        for beta in (0.0, 1.0, 0.5):
            for mr, nr in ((MR, NR), (MR - 1, NR - 1), (1, NR), (MR, 1)):
                got, A, B, C0, _ = run_tile(kern, max(mr, 1), max(nr, 1), k, beta, rng)
                assert_close(got, reference(A, B, C0, beta),
                             1.5 * error_bound(A, B, k, dt, extra=C0 if beta else None),
                             f"{kern.name} m={mr} n={nr} k={k} beta={beta}")


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
@pytest.mark.parametrize("epi", [EPI_BIAS_ROW, EPI_BIAS_COL, EPI_RELU, EPI_RELU6,
                                 EPI_BIAS_ROW | EPI_RELU, EPI_BIAS_COL | EPI_RELU6])
def test_fused_epilogue(spec, epi, rng):
    dt, MR, NR, isa = spec
    kern = get_kernel(dt, MR, NR, isa)
    for mr, nr, beta in ((MR, NR, 0.0), (MR, NR, 1.0), (max(MR - 1, 1), max(NR - 3, 1), 0.5)):
        got, A, B, C0, bias = run_tile(kern, mr, nr, 33, beta, rng, epi=epi, a_scale=2.0)
        ref = reference(A, B, C0, beta)
        if epi & EPI_BIAS_ROW:
            ref += bias[:mr, None]
        if epi & EPI_BIAS_COL:
            ref += bias[None, :nr]
        if epi & (EPI_RELU | EPI_RELU6):
            ref = np.maximum(ref, 0)
        if epi & EPI_RELU6:
            ref = np.minimum(ref, 6)
        c_part = np.abs(C0) if beta else 0.0
        bound = 1.5 * error_bound(A, B, 33, dt, extra=c_part + np.abs(bias).max())
        assert_close(got, ref, bound, f"{kern.name} epi={epi} m={mr} n={nr} beta={beta}")


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
def test_nan_and_inf_propagate_through_epilogue(spec, rng):
    dt, MR, NR, isa = spec
    kern = get_kernel(dt, MR, NR, isa)
    for mr, nr in ((MR, NR), (max(MR - 1, 2), 2)):  # rows 0 and 1 are checked
        dtype = kern.dtype
        k = 4
        apack = np.zeros(MR * k, dtype)
        bpack = np.zeros(NR * k, dtype)
        apack.reshape(k, MR)[0, 0] = np.nan      # row 0 becomes NaN
        apack.reshape(k, MR)[1, 1] = np.inf      # row 1 becomes +Inf where B > 0
        bpack.reshape(k, NR)[:, :] = 1.0
        c = np.zeros(MR * NR, dtype)
        bias = np.zeros(max(MR, NR), dtype)
        kern.module.macro_kernel(mr, nr, k, apack, 0, bpack, 0, c, 0, nr, dtype.type(1), dtype.type(0),
                                 bias, 0, 0, EPI_RELU6)
        out = c[:mr * nr].reshape(mr, nr)
        assert np.isnan(out[0]).all(), f"{kern.name}: relu6 dropped NaN"
        assert (out[1] == 6).all(), f"{kern.name}: relu6(+Inf) should clamp to 6"


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
def test_agrees_with_plain_numba_reference(spec, rng):
    """The vector-IR tile against the readable plain-Numba one on the same packed panels."""
    from tilegemm.ladder import tile_in_local_array
    dt, MR, NR, isa = spec
    kern = get_kernel(dt, MR, NR, isa)
    for k in (1, 7, 130):
        got, A, B, C0, _ = run_tile(kern, MR, NR, k, 1.0, rng)
        apack = np.ascontiguousarray(A.T).reshape(-1)
        bpack = np.ascontiguousarray(B).reshape(-1)
        acc = np.empty(MR * NR, dt)
        tile_in_local_array(k, apack, bpack, acc, MR, NR)
        tile = acc.reshape(MR, NR)
        expected = 1.5 * tile.astype(np.float64) + C0
        assert_close(got, expected, 3 * error_bound(A, B, k, dt, extra=C0),
                     f"{kern.name} against the plain-Numba tile, k={k}")


def _c_flat(size, beta, dt, rng):
    """C for a convolution kernel's tile, and a copy: NaN where beta is 0 (never read)."""
    c = np.full(size, np.nan, dt) if beta == 0 else rng.standard_normal(size).astype(dt)
    return c, c.copy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kc, ntaps", [(1, 1), (7, 3), (33, 9)])
@pytest.mark.parametrize("beta, epi", [(0.0, 0), (0.5, 0), (1.0, EPI_BIAS_ROW | EPI_RELU)])
def test_taps_flavour(dtype, kc, ntaps, beta, epi):
    """The convolution's taps kernel: sum over taps of packed A times B rows at tap offsets."""
    import numba
    from tilegemm.conv import engine
    mod = engine.conv_module(dtype)
    MR, NR = mod.MR, mod.NR
    dt = np.dtype(dtype)
    rng = np.random.default_rng(kc * 10 + ntaps)
    a_tap = MR * kc + 5                                  # panels of successive taps, apart
    apack = rng.standard_normal(a_off := 3 + ntaps * a_tap).astype(dt)
    ldb = NR + 11
    taps = rng.integers(0, 40, ntaps).astype(np.int64)
    b = rng.standard_normal(2 + 40 + kc * ldb + NR).astype(dt)
    ldc = NR + 2
    c, c0 = _c_flat(MR * ldc, beta, dt, rng)
    bias = rng.standard_normal(MR + 4).astype(dt)
    # Lane masks: tap t loads through the NR lanes at 5 + sched[t] (even taps), or
    # none (-1); the sum of the first n_and taps is ANDed with the lanes at 5 + and_at.
    itype = np.int32 if dt == np.float32 else np.int64
    masks = -rng.integers(0, 2, 5 + 3 * NR).astype(itype)
    n_and, and_at = min(ntaps - 1, 2), int(rng.integers(0, 2 * NR))
    tap_masks = np.where(np.arange(ntaps) % 2 == 0, rng.integers(0, 2 * NR, ntaps), -1)
    tap_masks[:n_and] = -1
    sched = np.r_[tap_masks, n_and, and_at].astype(np.int64)

    @numba.njit
    def run(kc, apack, b, taps, ntaps, masks, sched, c, bias, beta, epi):
        mod.ukernel_taps(kc, apack, 3, a_tap, b, 2, ldb, taps, ntaps, masks, 5, sched,
                         c, 0, ldc, dt.type(1.5), beta, bias, 1, epi)

    b_in = b.copy()
    run(kc, apack, b, taps, ntaps, masks, sched, c, bias, dt.type(beta), epi)
    assert np.array_equal(b, b_in)
    want = np.zeros((MR, NR))
    for t in range(ntaps):
        A = apack[3 + t * a_tap:3 + t * a_tap + MR * kc].reshape(kc, MR).T.astype(np.float64)
        rows = np.array([b[2 + taps[t] + p * ldb:2 + taps[t] + p * ldb + NR] for p in range(kc)])
        if tap_masks[t] >= 0:
            rows = np.where(masks[5 + tap_masks[t]:5 + tap_masks[t] + NR] != 0, rows, 0)
        want += A @ rows.astype(np.float64)
        if t + 1 == n_and:
            want = np.where(masks[5 + and_at:5 + and_at + NR] != 0, want, 0)
    want *= 1.5
    tile0 = c0.reshape(MR, ldc)[:, :NR].astype(np.float64)
    if beta != 0:
        want += beta * tile0
    if epi & EPI_BIAS_ROW:
        want += bias[1:1 + MR, None]
    if epi & EPI_RELU:
        want = np.maximum(want, 0)
    got = c.reshape(MR, ldc)
    bound = 4 * kc * ntaps * np.finfo(dt).eps * (1 + np.abs(want))
    assert_close(got[:, :NR], want, bound, f"taps kernel {dt.name} kc={kc} ntaps={ntaps}")
    assert np.array_equal(got[:, NR:], c0.reshape(MR, ldc)[:, NR:], equal_nan=True), \
        "the taps kernel wrote outside its tile"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kc, ntaps", [(1, 1), (7, 3), (33, 9)])
@pytest.mark.parametrize("beta, epi", [(0.0, 0), (0.5, 0), (1.0, EPI_BIAS_COL | EPI_RELU6)])
@pytest.mark.parametrize("rows, cols", [(None, None), (1, 1), (4, 3)])
@pytest.mark.parametrize("a_cs", [None, 5])
def test_rows_flavour(dtype, kc, ntaps, beta, epi, rows, cols, a_cs):
    """The convolution's rows kernel: sum over taps of A rows read at their own offsets
    (the zero row where negative) times packed B, a row's values contiguous (channels
    last) or ``a_cs`` apart (the strided flavour, channels first); the edge flavours
    touch C[:rows, :cols] only."""
    import numba
    from tilegemm.conv import engine
    mod = engine.conv_module(dtype)
    MR, NR = mod.MR, mod.NR
    dt = np.dtype(dtype)
    rng = np.random.default_rng(kc * 10 + ntaps)
    step = 1 if a_cs is None else a_cs
    a = rng.standard_normal(300 + kc * step).astype(dt)
    o_step = MR + 2                                      # taps' offsets, apart
    offs = rng.integers(0, 300, o_step * ntaps + 4)
    offs[rng.random(offs.size) < 0.3] = -1               # taps in the padding
    zeros = np.zeros((kc - 1) * step + 1, dt)
    b_tap = kc * NR + 3
    b = rng.standard_normal(2 + ntaps * b_tap).astype(dt)
    ldc = NR + 2
    c, c0 = _c_flat(MR * ldc, beta, dt, rng)
    bias = rng.standard_normal(NR + 4).astype(dt)
    edge = rows is not None
    rows, cols = (rows, cols) if edge else (MR, NR)

    @numba.njit
    def run(kc, a, offs, ntaps, zeros, b, c, bias, beta, epi):
        if a_cs is not None and edge:
            mod.ukernel_rows_strided_edge(kc, a, 1, a_cs, offs, 4, o_step, ntaps, zeros, b, 2,
                                          b_tap, c, 0, ldc, dt.type(1.5), beta, bias, 3, epi,
                                          rows, cols)
        elif a_cs is not None:
            mod.ukernel_rows_strided(kc, a, 1, a_cs, offs, 4, o_step, ntaps, zeros, b, 2, b_tap,
                                     c, 0, ldc, dt.type(1.5), beta, bias, 3, epi)
        elif edge:
            mod.ukernel_rows_edge(kc, a, 1, offs, 4, o_step, ntaps, zeros, b, 2, b_tap, c, 0, ldc,
                                  dt.type(1.5), beta, bias, 3, epi, rows, cols)
        else:
            mod.ukernel_rows(kc, a, 1, offs, 4, o_step, ntaps, zeros, b, 2, b_tap, c, 0, ldc,
                             dt.type(1.5), beta, bias, 3, epi)

    a_in, b_in = a.copy(), b.copy()
    run(kc, a, offs, ntaps, zeros, b, c, bias, dt.type(beta), epi)
    assert np.array_equal(a, a_in) and np.array_equal(b, b_in) and not zeros.any()
    want = np.zeros((MR, NR))
    for t in range(ntaps):
        o = offs[4 + t * o_step:4 + t * o_step + MR]
        A = np.array([a[1 + q:1 + q + kc * step:step] if q >= 0 else np.zeros(kc) for q in o])
        B = b[2 + t * b_tap:2 + t * b_tap + kc * NR].reshape(kc, NR)
        want += A.astype(np.float64) @ B.astype(np.float64)
    want *= 1.5
    tile0 = c0.reshape(MR, ldc)[:, :NR].astype(np.float64)
    if beta != 0:
        want += beta * tile0
    if epi & EPI_BIAS_COL:
        want += bias[3:3 + NR]
    if epi & EPI_RELU6:
        want = np.minimum(np.maximum(want, 0), 6)
    got = c.reshape(MR, ldc)
    bound = 4 * kc * ntaps * np.finfo(dt).eps * (1 + np.abs(want))
    assert_close(got[:rows, :cols], want[:rows, :cols], bound[:rows, :cols],
                 f"rows kernel {dt.name} kc={kc} ntaps={ntaps}")
    outside = np.ones((MR, ldc), bool)
    outside[:rows, :cols] = False
    assert np.array_equal(got[outside], c0.reshape(MR, ldc)[outside], equal_nan=True), \
        "the rows kernel wrote outside its tile"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["loads", "sum"])
def test_taps_mask_zeroes_lanes_before_the_product(dtype, where):
    """An Inf or NaN in a masked-out lane of B never reaches C (masking is not 0 * value),
    whether the mask applies to the loads or to the sum of the taps."""
    import numba
    from tilegemm.conv import engine
    mod = engine.conv_module(dtype)
    MR, NR = mod.MR, mod.NR
    dt = np.dtype(dtype)
    kc = 5
    apack = np.ones(MR * kc, dt)
    lane_on = np.arange(NR) % 3 != 0
    b = np.where(lane_on, 2.0, np.inf).astype(dt)
    b = np.tile(b, kc)
    b[NR] = np.nan                                       # row 1, lane 0 (masked out)
    masks = np.where(lane_on, -1, 0).astype(np.int32 if dt == np.float32 else np.int64)
    c = np.full((MR, NR), np.nan, dt)

    sched = np.array([0, 0, 0] if where == "loads" else [-1, 1, 0], np.int64)

    @numba.njit
    def run(apack, b, masks, sched, c):
        mod.ukernel_taps(kc, apack, 0, 0, b, 0, NR, np.zeros(1, np.int64), 1, masks, 0,
                         sched, c, 0, NR, dt.type(1), dt.type(0), apack, 0, 0)

    run(apack, b, masks, sched, c)
    want = np.where(lane_on, 2.0 * kc, 0.0)
    assert np.array_equal(c, np.broadcast_to(want, (MR, NR)).astype(dt))


@pytest.mark.parametrize("dtype, lanes", [(np.float32, 8), (np.float64, 4), (np.float32, 16)])
def test_transpose_block(dtype, lanes):
    """make_transpose: y[dst + j*dst_step + i] = x[src + i*src_step + j], nothing else
    written, with steps longer than a vector on both sides."""
    import numba
    from tilegemm.kernels.transforms import make_transpose
    transpose = make_transpose(dtype, lanes)

    @numba.njit
    def run(x, src, src_step, y, dst, dst_step):
        transpose(x, src, src_step, y, dst, dst_step)

    x = np.arange(40 * lanes, dtype=dtype)
    y = np.full(40 * lanes, -1, dtype)
    src, src_step, dst, dst_step = 3, lanes + 5, 7, 2 * lanes + 1
    run(x, src, src_step, y, dst, dst_step)
    want = np.full_like(y, -1)
    for i in range(lanes):
        for j in range(lanes):
            want[dst + j * dst_step + i] = x[src + i * src_step + j]
    np.testing.assert_array_equal(y, want)
    with pytest.raises(ValueError, match="power-of-two"):
        make_transpose(dtype, 6)


@pytest.mark.parametrize("dtype, lanes", [(np.float32, 8), (np.float64, 4), (np.float32, 16)])
def test_deinterleave_row(dtype, lanes):
    """make_deinterleave: the even and odd elements of 2*lanes from src, each phase
    stored at its own offset, nothing else written."""
    import numba
    from tilegemm.kernels.transforms import make_deinterleave
    deinterleave = make_deinterleave(dtype, lanes)

    @numba.njit
    def run(x, src, y, even, odd):
        deinterleave(x, src, y, even, odd)

    x = np.arange(8 * lanes, dtype=dtype)
    y = np.full(8 * lanes, -1, dtype)
    src, even, odd = 3, 5, 2 * lanes + 7
    run(x, src, y, even, odd)
    want = np.full_like(y, -1)
    want[even:even + lanes] = x[src:src + 2 * lanes:2]
    want[odd:odd + lanes] = x[src + 1:src + 2 * lanes:2]
    np.testing.assert_array_equal(y, want)
