"""The vector-IR packers of every registered kernel against the plain-Numba reference.

``tilegemm.packing.pack`` states the packed layouts in plain Numba; each kernel
module packs with intrinsics from the generator (vector rows when the panel's
direction is contiguous, vector columns when k is, scalars otherwise).  Both
must produce the same buffer, padding included, from every kind of stride, and
neither may write past the panels it was asked for.
"""
import numba
import numpy as np
import pytest

from tilegemm.kernels.registry import get_kernel, registered_kernels
from tilegemm.packing import flat_view
from tilegemm.packing.pack import pack_a as ref_pack_a, pack_b as ref_pack_b

KERNELS = registered_kernels()
IDS = [f"{dt.name}-{mr}x{nr}-{isa}" for dt, mr, nr, isa in KERNELS]


@numba.njit
def _ref_a(a, off, rs, cs, mc, kc, MR, buf):
    ref_pack_a(a, off, rs, cs, mc, kc, MR, buf)


@numba.njit
def _ref_b(b, off, rs, cs, kc, nc, NR, buf):
    ref_pack_b(b, off, rs, cs, kc, nc, NR, buf)


def operands(dtype, rows, cols, rng):
    """Views of one random matrix with every kind of stride the drivers may see."""
    base = rng.standard_normal((rows * 2 + 3, cols * 2 + 5)).astype(dtype)
    c_order = base[:rows, :cols]
    yield "C order", c_order
    yield "Fortran order", np.asfortranarray(c_order)
    yield "transposed", np.ascontiguousarray(c_order.T).T
    yield "every other", base[1:2 * rows:2, 3:3 + 2 * cols:2]
    yield "reversed rows", base[rows - 1::-1, :cols]
    yield "reversed columns", base[:rows, cols - 1::-1]
    yield "zero row stride", np.broadcast_to(base[0, :cols], (rows, cols))


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
@pytest.mark.parametrize("mc, kc", [(1, 1), (5, 3), (13, 17), (16, 33), (23, 64), (40, 7)])
def test_pack_a_matches_reference(spec, mc, kc):
    kern = get_kernel(*spec)
    MR, dt = kern.mr, kern.dtype
    rng = np.random.default_rng(mc * 100 + kc)
    size = -(-mc // MR) * MR * kc
    for name, a in operands(dt, mc, kc, rng):
        flat, off, rs, cs = flat_view(a)
        got = np.full(size + 9, -7.0, dt)
        want = got.copy()
        kern.module.pack_a(flat, off, rs, cs, mc, kc, got)
        _ref_a(flat, off, rs, cs, mc, kc, MR, want)
        assert np.array_equal(got, want), f"{kern.name} pack_a, {name} A {mc}x{kc}"
        assert np.all(got[size:] == -7.0), f"{kern.name} pack_a wrote past its panels ({name})"


@pytest.mark.parametrize("spec", KERNELS, ids=IDS)
@pytest.mark.parametrize("kc, nc", [(1, 1), (3, 5), (17, 70), (33, 16), (7, 129)])
def test_pack_b_matches_reference(spec, kc, nc):
    kern = get_kernel(*spec)
    NR, dt = kern.nr, kern.dtype
    rng = np.random.default_rng(kc * 1000 + nc)
    size = -(-nc // NR) * NR * kc
    for name, b in operands(dt, kc, nc, rng):
        flat, off, rs, cs = flat_view(b)
        got = np.full(size + 9, -7.0, dt)
        want = got.copy()
        kern.module.pack_b(flat, off, rs, cs, kc, nc, got)
        _ref_b(flat, off, rs, cs, kc, nc, NR, want)
        assert np.array_equal(got, want), f"{kern.name} pack_b, {name} B {kc}x{nc}"
        assert np.all(got[size:] == -7.0), f"{kern.name} pack_b wrote past its panels ({name})"
