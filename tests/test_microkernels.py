"""Every registered micro-kernel through the one kernel tester (tests/kernel_tester.py).

The kernels are those :func:`tilegemm.kernels.registry.microkernel_specs` lists for
every ISA this host runs (the detected one, or ``TILEGEMM_ISA``, and the narrower
ones), float32 and float64: the GEMM flavours on every register tile of the host's
ISA, the convolution flavours on the blocking's tile.  A new kernel is a new entry
in that listing; a new case for all of them is one line below.
"""
import zlib

import numpy as np
import pytest

from tilegemm.kernels.microkernel import Flavour
from tilegemm.kernels.registry import microkernel_specs, runnable_isas
from tilegemm.tuning.machine import detect

from conftest import assert_close, error_bound
from kernel_tester import MicrokernelTester

SPECS = list(dict.fromkeys(microkernel_specs(isas=(detect().isa,), all_tiles=True)
                           + microkernel_specs()))
IDS = [spec.name for spec in SPECS]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("case", [
    "test_subtiles",        # every m <= MR x n <= NR corner (edge flavours), beta 0 / 1 / 0.5
    "test_k_sweep",         # k = 1, the unroll -1/0/+1, KC -1/0/+1; every beta; ldc > NR
    "test_epilogues",       # bias row / col, relu, relu6 and their combinations, every beta
    "test_nan_and_inf",     # NaN and Inf through the epilogue
])
def test_microkernel(spec, case):
    getattr(MicrokernelTester(spec, seed=zlib.crc32(spec.name.encode())), case)()


def test_every_runnable_isa_is_covered():
    """The listing covers the detected ISA and every narrower one, both dtypes."""
    isas = runnable_isas()
    assert isas[0] == detect().isa
    assert {(s.isa, s.dtype) for s in SPECS} == {(i, np.dtype(d)) for i in isas
                                                  for d in (np.float32, np.float64)}


@pytest.mark.parametrize("spec", [s for s in SPECS if s.flavour is Flavour.PACKED],
                         ids=lambda s: s.name)
def test_agrees_with_plain_numba_reference(spec):
    """The vector-IR tile against the readable plain-Numba ladder rung 3 (packed panels,
    sums in a local array) on the same operands."""
    from tilegemm import ladder
    tester = MicrokernelTester(spec, seed=7)
    rng = np.random.default_rng(7)
    for k in (1, 7, 130):
        A = rng.standard_normal((1, spec.mr, k)).astype(spec.dtype)
        B = rng.standard_normal((1, k, spec.nr)).astype(spec.dtype)
        got = tester.test(k, beta=0.0, operands=(A, B))
        expected = 1.5 * ladder.compute(3, A[0], B[0]).astype(np.float64)
        assert_close(got, expected, 3 * error_bound(A[0], B[0], k, spec.dtype),
                     f"{spec.name} against the plain-Numba tile, k={k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["loads", "sum"])
def test_taps_mask_zeroes_lanes_before_the_product(dtype, where):
    """An Inf or NaN in a masked-out lane of B never reaches C (masking is not 0 * value),
    whether the mask applies to the loads or to the sum of the taps."""
    import numba
    from tilegemm.conv import engine
    mod = engine.family_module("taps", dtype)
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
