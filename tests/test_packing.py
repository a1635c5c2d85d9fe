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
@pytest.mark.parametrize("operand, rows, cols", [
    ("A", 1, 1), ("A", 5, 3), ("A", 13, 17), ("A", 16, 33), ("A", 23, 64), ("A", 40, 7),
    ("B", 1, 1), ("B", 3, 5), ("B", 17, 70), ("B", 33, 16), ("B", 7, 129)])
def test_packers_match_reference(spec, operand, rows, cols):
    """A is rows (m) x cols (k) in MR panels; B is rows (k) x cols (n) in NR panels."""
    kern = get_kernel(*spec)
    dt = kern.dtype
    if operand == "A":
        panel, count, kc = kern.mr, rows, cols
        ours = lambda flat, off, rs, cs, buf: kern.module.pack_a(flat, off, rs, cs, rows, cols, buf)
        ref = lambda flat, off, rs, cs, buf: _ref_a(flat, off, rs, cs, rows, cols, panel, buf)
    else:
        panel, count, kc = kern.nr, cols, rows
        ours = lambda flat, off, rs, cs, buf: kern.module.pack_b(flat, off, rs, cs, rows, cols, buf)
        ref = lambda flat, off, rs, cs, buf: _ref_b(flat, off, rs, cs, rows, cols, panel, buf)
    size = -(-count // panel) * panel * kc
    rng = np.random.default_rng(rows * 1000 + cols)
    for name, x in operands(dt, rows, cols, rng):
        flat, off, rs, cs = flat_view(x)
        got = np.full(size + 9, -7.0, dt)
        want = got.copy()
        ours(flat, off, rs, cs, got)
        ref(flat, off, rs, cs, want)
        assert np.array_equal(got, want), f"{kern.name} pack_{operand.lower()}, {name} {rows}x{cols}"
        assert np.all(got[size:] == -7.0), f"{kern.name} pack_{operand.lower()} wrote past its panels ({name})"
