"""Packing A and B into the micro-panels the micro-kernels read.

Every operand arrives as a flat 1-D view plus an element offset and two element
strides (see :func:`tilegemm.packing.flat_view`), so one compiled packer serves C
order, Fortran order, transposed views, and negative or zero strides alike.

Layouts (both zero padded to whole panels, so kernels always read full panels):

* packed A: ``ceil(mc/MR)`` micro-panels of ``MR x kc``; panel ``q`` starts at
  ``q*MR*kc`` and holds ``A[q*MR + i, p]`` at ``p*MR + i`` (k-major).
* packed B: ``ceil(nc/NR)`` micro-panels of ``kc x NR``; panel ``q`` starts at
  ``q*NR*kc`` and holds ``B[p, q*NR + j]`` at ``p*NR + j`` (k-major).

These plain-Numba packers are the readable statement of the layouts and the
reference the tests hold the engine to.  The engine itself packs through
``make_pack_panel`` (``kernels/packers.py``, bound in each generated kernel
module as ``pack_a``/``pack_b``): Numba compiles these flat-index loops through
its negative-index wraparound into gathers and scatters, several times slower
than the vector copy.
"""
import numba

from tilegemm.ground.contracts import JIT, imin


@numba.njit(inline='always', **JIT)
def pack_a_panel(a, off, rs, cs, rows, kc, MR, buf, dst):
    """Pack ``rows <= MR`` rows x ``kc`` columns of A (starting at ``off``) into one panel at ``dst``.

    Assumes ``buf`` holds ``dst + MR*kc`` elements and ``a`` every element addressed;
    callers pass MR as a compile-time constant (a module global) so loops over it unroll.
    """
    if rows == MR:
        # Full panel: MR is a compile-time constant here, so the i loop unrolls into
        # MR streams read in step and MR adjacent stores per k.
        for p in range(kc):
            src = off + p * cs
            for i in range(MR):
                buf[dst + p * MR + i] = a[src + i * rs]
    else:
        # A partial panel: the same walk with a run-time row count, then zero rows.
        for p in range(kc):
            src = off + p * cs
            for i in range(rows):
                buf[dst + p * MR + i] = a[src + i * rs]
    if rows < MR:
        for p in range(kc):
            for i in range(rows, MR):
                buf[dst + p * MR + i] = 0


@numba.njit(inline='always', **JIT)
def pack_b_panel(b, off, rs, cs, cols, kc, NR, buf, dst):
    """Pack ``kc`` rows x ``cols <= NR`` columns of B (starting at ``off``) into one panel at ``dst``.

    Assumes ``buf`` holds ``dst + NR*kc`` elements and ``b`` every element addressed.
    """
    if cs == 1 and cols == NR:
        # Full panel of a row-major B: each k is one fixed-length contiguous copy.
        for p in range(kc):
            src = off + p * rs
            row = dst + p * NR
            for j in range(NR):
                buf[row + j] = b[src + j]
    elif cs == 1:
        for p in range(kc):
            src = off + p * rs
            row = dst + p * NR
            for j in range(cols):
                buf[row + j] = b[src + j]
            for j in range(cols, NR):
                buf[row + j] = 0
    else:
        # Columns not contiguous (e.g. a transposed B): read down each column,
        # write with stride NR.
        for j in range(cols):
            src = off + j * cs
            for p in range(kc):
                buf[dst + p * NR + j] = b[src + p * rs]
        if cols < NR:
            for p in range(kc):
                for j in range(cols, NR):
                    buf[dst + p * NR + j] = 0


@numba.njit(inline='always', **JIT)
def pack_a(a, off, rs, cs, mc, kc, MR, buf):
    """Pack an ``mc x kc`` block of A into ``ceil(mc/MR)`` MR-row micro-panels at ``buf[0:]``."""
    for ir in range(0, mc, MR):
        pack_a_panel(a, off + ir * rs, rs, cs, imin(MR, mc - ir), kc, MR, buf, ir * kc)


@numba.njit(inline='always', **JIT)
def pack_b(b, off, rs, cs, kc, nc, NR, buf):
    """Pack a ``kc x nc`` block of B into ``ceil(nc/NR)`` NR-column micro-panels at ``buf[0:]``."""
    for jr in range(0, nc, NR):
        pack_b_panel(b, off + jr * cs, rs, cs, imin(NR, nc - jr), kc, NR, buf, jr * kc)
